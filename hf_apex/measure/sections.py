"""The sections ``ApexTrainer`` adds to the metrics JSON at the end of a run: what was rewired, the loss, autotune's
decisions, what the compiled graphs and the attention ran, and the DDP wrapper's settings."""

from __future__ import annotations

import torch

from ..internals import FUNCTORCH_CONFIG, INDUCTOR_CONFIG, attn_implementation, uncompiled
from ..kernels.apex.norms import is_swapped
from ..kernels.models.attention import STATIC_MASKS
from ..kernels.trace import APEX, TORCH
from ..policy import why_not_fuse_projections
from ..runtime import DropFullAttentionMask, loss_reads_outputs
from ..training_args import graph_norm_kernel


def norms_in_graphs(trainer) -> str:
    """Which norm kernels run inside the run's compiled graphs."""
    inside = {m.hf_apex_graph_kernel for m in trainer.model.modules() if is_swapped(m)}
    if APEX in inside:
        return "apex's kernel inside the CUDA graphs (the cudagraphs backend: no code generation)" + (
            "; the stock op where apex's kernel cannot run" if TORCH in inside else ""
        )
    if graph_norm_kernel(trainer.args) == APEX:
        return "stock torch op inside the CUDA graphs (apex's norms cannot run there: the log says why)"
    return "stock torch op inside the compiled graph (Inductor)"


def batches_section(trainer) -> dict:
    """The run's batch layout (``packing``): what was packed or bucketed, and why."""
    if trainer.batches is not None:
        return dict(trainer.batches.report)
    if not trainer.ARRANGES_BATCHES:
        return {"layout": "the trainer's own", "why": f"{type(trainer).__name__}'s data pipeline arranges the batches"}
    return {"layout": "off"}


def trainer_sections(trainer) -> dict:
    """What ``trainer`` adds to the metrics JSON at the end of its run."""
    kernels = {}
    plan = trainer.plan
    settings = plan.compile_settings  # (empty in a run that skipped compiling: args of eager)
    inductor = settings.get(INDUCTOR_CONFIG, {})
    if trainer.args.apex_fused_norms and trainer.args.torch_compile:
        kernels["norms_under_torch_compile"] = norms_in_graphs(trainer)
    if trainer.graphs_blocked:
        kernels["cuda_graphs"] = f"not used: {trainer.graphs_blocked}"
    if trainer.compile_skipped:
        kernels["torch_compile"] = f"not used: {trainer.compile_skipped}"
    elif "ban_recompute_materialized_backward" in settings.get(FUNCTORCH_CONFIG, {}):
        kernels["compiled_backward"] = "recomputes the pointwise results its matmuls read (recompute_pointwise)"
    elif trainer.args.torch_compile and trainer.args.recipe.recompute_pointwise == "auto":
        kernels["compiled_backward"] = (
            "keeps the pointwise results its matmuls read (recompute_pointwise=auto: the loss runs without the logits)"
        )
    if "fallback_random" in inductor:
        kernels["random_ops"] = "torch's own kernels inside the compiled graph (eager_random)"
    if "pre_grad_custom_pass" in inductor:
        kernels["projections"] = (
            "Inductor's pre-grad pass runs the linears that read one input as one matmul, where it can "
            "(fuse_projections)"
        )
    elif trainer.args.torch_compile and trainer.args.recipe.fuse_projections != "false":
        kernels["projections"] = f"not fused: {why_not_fuse_projections(trainer.args, trainer.model)}"
    if isinstance(trainer.data_collator, DropFullAttentionMask):
        kernels["attention_mask"] = "left out of batches where it is all ones"
    if plan.masks.report:
        implementation = attn_implementation(trainer.model) or STATIC_MASKS
        kernels["attention_masks"] = (
            f"{implementation}: decided without reading a tensor (a batch without an attention mask builds none, "
            "SDPA's is_causal; a padded batch keeps its mask; a batch without position_ids: one sequence per row)"
        )
    if trainer.args.attention_backend:
        kernels["attention_backend"] = plan.sdpa_backend or "torch (PyTorch's own choice)"
    if plan.rotary.report is not None and trainer.args.torch_compile:
        kernels["rotary_embedding"] = (
            f"cos/sin computed once per compiled forward ({plan.rotary.report} module(s), rotary_once)"
            if plan.rotary.report
            else "no rotary embedding in this model (rotary_once)"
        )
    autocast = trainer.args.bf16 or trainer.args.fp16
    if trainer.fp32_outputs_dropped:
        kernels["model_outputs"] = "autocast dtype (accelerate's FP32 conversion left out; the loss is FP32)"
    elif autocast and loss_reads_outputs(trainer) and not trainer.args.recipe.fp32_outputs:
        kernels["model_outputs"] = "FP32 (accelerate's conversion kept: the loss is computed from the outputs)"
    return {
        "rewire": plan.norms.report.to_dict() if plan.norms.report else None,
        "lm_loss": plan.loss.report,
        "autotune": plan.autotuner.report() if plan.autotuner else [],
        "kernels": kernels,
        "ddp": ddp_settings(trainer),
        "compile_cache": compile_cache_section(trainer),
        "batches": batches_section(trainer),
    }


def compile_cache_section(trainer) -> dict:
    """Whether the run's compiled work came from an earlier run's compile-cache artifacts ("warm"), was compiled here
    ("cold"), or the cache was not used ("off", and why)."""
    payback = {"payback": trainer.compile_payback} if trainer.compile_payback else {}
    if trainer.compile_cache is not None:
        return {**trainer.compile_cache.report(), **payback}
    if trainer.compile_skipped:
        why = f"the run does not compile: {trainer.compile_skipped}"
    elif not trainer.args.torch_compile:
        why = "the run does not compile"
    else:
        why = "stage_recipe compile_cache=False"
    return {"state": "off", "why": why, **payback}


def ddp_settings(trainer) -> dict | None:
    """What the DistributedDataParallel wrapper of this run really used (None without DDP)."""
    ddp = uncompiled(trainer.model_wrapped)  # torch.compile wraps the DDP module
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        return None
    return {
        "find_unused_parameters": ddp.find_unused_parameters,
        "static_graph": ddp.static_graph,
        "bucket_cap_mb": ddp.bucket_bytes_cap / 2**20,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "broadcast_buffers": ddp.broadcast_buffers,
    }
