"""What a run does, decided from its arguments (and model) before it starts: refused combinations, whether it
compiles, and the compiler settings of its training steps, from the stage's :class:`~hf_apex.stages.StageRecipe`; and
the warnings a trainer's setup deserves."""

from __future__ import annotations

import contextlib
import logging
import math
import os

import torch
from torch import nn

from . import data
from .internals import AUTOCAST_REGIONS, FUNCTORCH_CONFIG, INDUCTOR_CONFIG, inductor_config
from .kernels.apex.availability import blocker, cpu_has_native_bf16, fix_for
from .kernels.models.loss import is_causal_lm, is_fused
from .kernels.trace import TORCH
from .stages import STAGES
from .training_args import CUDA_GRAPHS_BACKEND, ApexTrainingArguments, graph_norm_kernel

logger = logging.getLogger("hf_apex")


def fsdp_version(args) -> int | None:
    """1 or 2 when the run is sharded with FSDP (transformers' flags, else `accelerate launch`'s), else None."""
    if getattr(args, "fsdp", None):
        return int((getattr(args, "fsdp_config", None) or {}).get("version", 2))  # transformers' default: FSDP2
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        return int(os.environ.get("FSDP_VERSION", "1"))  # accelerate's default
    return None


def validate_apex_args(args: ApexTrainingArguments) -> None:
    """Refuse, before any data or model is loaded, combinations that cannot work: one ``ValueError`` naming
    the real blocker and the fix. ``recipes/finetune.py`` calls it right after parsing; ``ApexTrainer`` too."""
    fsdp = fsdp_version(args)
    if args.apex_optimizer == "fused_lamb" and fsdp == 2:
        raise ValueError(
            "apex_optimizer='fused_lamb' cannot run under FSDP2: LAMB's trust ratios and global gradient norm need "
            "whole parameters, and each rank holds shards. Use fused_adam, or DDP."
        )
    if args.apex_optimizer != "none" and fsdp == 2:
        master = {"master_weights", "capturable"} & {k for k, v in (args.apex_optimizer_kwargs or {}).items() if v}
        if master:
            raise ValueError(f"apex_optimizer_kwargs {sorted(master)} are not supported under FSDP2 (local shards).")
    if args.apex_optimizer != "none" and fsdp == 1:
        raise ValueError(
            f"apex_optimizer={args.apex_optimizer!r} is not supported under FSDP1 (flat parameters); hf_apex steps "
            "apex's optimizers on FSDP2's DTensor shards. Use FSDP2 (fsdp_config={'version': 2}; accelerate: "
            "fsdp_version: 2), DDP, or optim='adamw_torch_fused' (stage=None)."
        )
    if args.apex_optimizer == "fused_lamb" and (
        reason := blocker("fused_lamb", args.device if torch.cuda.is_available() else None)
    ):
        raise ValueError(
            f"apex_optimizer='fused_lamb' has no torch fallback and cannot run here: {reason}. {fix_for(reason)}"
        )
    if not args.apex_strict_kernels:
        return
    if args.apex_fused_norms and args.torch_compile and graph_norm_kernel(args) == TORCH:
        raise ValueError(
            "apex_strict_kernels=True with apex_fused_norms and torch_compile: under Inductor the swapped norms run "
            "the torch op inside the graph, not apex's kernel. Drop one of the three, or compile with "
            "torch_compile_backend='cudagraphs' (apex's norms inside CUDA graphs)."
        )
    wanted = ["fused_adam"] * (args.apex_optimizer != "none") + ["layer_norm"] * args.apex_fused_norms
    device = args.device if torch.cuda.is_available() else None  # no GPU at all is the blocker to name
    reasons = dict.fromkeys(reason for c in wanted if (reason := blocker(c, device)))
    if reasons:
        why = "; ".join(reasons)
        raise ValueError(f"apex_strict_kernels=True but apex's kernels cannot run here: {why}. {fix_for(why)}")


def graphs_without_gpu(args) -> str | None:
    """Why a stage's CUDA graphs of the eager kernels (``auto``'s ``cudagraphs`` backend) cannot be recorded here (no
    GPU), or None; a backend of yours compiles as asked."""
    stage_backend = STAGES[args.stage].torch_compile_backend if args.stage else None
    if stage_backend == args.torch_compile_backend == CUDA_GRAPHS_BACKEND and (
        args.use_cpu or not torch.cuda.is_available()
    ):
        return f"no CUDA GPU to record stage {args.stage!r}'s CUDA graphs on: its eager kernels run as they are"
    return None


def why_not_compile(args, train_dataset, payback: dict | None = None) -> str | None:
    """Why a run asked to compile should run eager, or None: fewer optimizer steps than compiling needs to repay itself
    (``payback``, :func:`hf_apex.autotune.compiled.compile_payback`: measured on this GPU, else the recipe's
    ``min_steps``), or a stage's CUDA graphs of the eager kernels (``auto``'s ``cudagraphs`` backend) without a GPU to
    record them on (the backend of yours compiles as asked)."""
    if not isinstance(args, ApexTrainingArguments) or not args.torch_compile:
        return None
    if no_gpu := graphs_without_gpu(args):
        return no_gpu
    payback = payback or {"min_steps": args.recipe.min_steps, "source": "recipe"}
    min_steps = payback["min_steps"]
    if not min_steps:
        return None
    if args.max_steps > 0:
        steps = args.max_steps
    elif hasattr(train_dataset, "__len__"):
        batches = math.ceil(len(train_dataset) / (args.per_device_train_batch_size * max(args.world_size, 1)))
        steps = math.ceil(args.num_train_epochs * math.ceil(batches / args.gradient_accumulation_steps))
    else:
        return None  # unknown length: compile as asked
    if steps >= min_steps:
        return None
    always = """(--stage_recipe '{"min_steps": 0}' compiles anyway)"""
    if payback["source"] == "measured":
        return (
            f"the run has {steps} optimizer steps; on this GPU compiling repays itself after {min_steps} (measured "
            f"here: {payback['eager_step_ms']:.1f} ms a step eager, {payback['compiled_step_ms']:.1f} compiled, "
            f"{payback['warmup_s']:.1f} s of {payback['state']} warm-up) {always}"
        )
    return (
        f"the run has {steps} optimizer steps, fewer than the stage recipe's min_steps={min_steps}, so compilation "
        f"would cost more than it saves {always}"
    )


def compile_settings(args, model: nn.Module | None) -> dict[str, dict]:
    """torch.compile's settings for a run's training steps on ``model``, by config module (empty: torch's defaults),
    from the run's :class:`~hf_apex.stages.StageRecipe`:

    - ``recompute_pointwise`` (``"true"``, or ``"auto"`` for a model whose loss reads its logits): the partitioner
      recomputes in the backward the pointwise results that the backward's matmuls read (AOTAutograd's config).
    - ``eager_random``: random ops run torch's own kernels inside the graph (Inductor's ``fallback_random``).
    - ``fuse_projections``: linears that read one input run as one matmul (:mod:`hf_apex.kernels.passes.projections`,
      Inductor's ``pre_grad_custom_pass``), where :func:`why_not_fuse_projections` has no objection.
    - ``compile_cache``: graphs with autocast regions and custom autograd functions, whose code the traced graph
      holds, are cacheable by AOTAutograd. An autocast region inside a graph (a RoPE model's rotary embedding, the
      fused loss's FP32 part) enters and leaves through two functions whose arguments are in the graph
      (``AUTOCAST_REGIONS``): AOTAutograd's cache refuses a graph that calls a function it does not know to be safe,
      so without them such a graph is traced again at every run."""
    if not (isinstance(args, ApexTrainingArguments) and args.torch_compile):
        return {}
    recipe, settings, inductor = args.recipe, {}, {}
    wanted = recipe.recompute_pointwise
    if wanted == "true" or (wanted == "auto" and (model is None or not is_fused(model))):
        settings[FUNCTORCH_CONFIG] = {"ban_recompute_materialized_backward": False}
    if recipe.eager_random:
        inductor["fallback_random"] = True
    if why_not_fuse_projections(args, model) is None:
        from .kernels.passes.projections import FUSE_SHARED_INPUT_LINEARS

        inductor["pre_grad_custom_pass"] = FUSE_SHARED_INPUT_LINEARS
    if recipe.compile_cache:
        inductor["unsafe_marked_cacheable_functions"] = {
            **inductor_config().unsafe_marked_cacheable_functions,
            **dict.fromkeys(AUTOCAST_REGIONS, torch.__version__),
        }
        functorch = settings.setdefault(FUNCTORCH_CONFIG, {})
        functorch["autograd_cache_allow_custom_autograd_functions"] = True  # (hf_apex's fused loss is one)
    if inductor:
        settings[INDUCTOR_CONFIG] = inductor
    return settings


def why_not_fuse_projections(args, model: nn.Module | None) -> str | None:
    """Why this run's compiled graphs do not fuse projections (None: they do): the recipe's ``fuse_projections`` is
    off, or ``"auto"`` for a causal LM (where it slowed the Llama-architecture model), the backend is not Inductor's
    (the pass is), or a pre-grad pass of yours keeps its place."""
    wanted = args.recipe.fuse_projections
    if wanted == "false":
        return "fuse_projections is off"
    if wanted == "auto" and model is not None and is_causal_lm(getattr(model, "module", model)):  # (FSDP1 wraps it)
        return "fuse_projections=auto leaves a causal LM's projections apart"
    backend = args.torch_compile_backend or "inductor"
    if backend != "inductor":
        return f"its pass is Inductor's, and torch_compile_backend={backend!r}"
    if inductor_config().pre_grad_custom_pass is not None:
        return "Inductor's pre_grad_custom_pass is set already (yours is kept)"
    return None


@contextlib.contextmanager
def own_compiled_graphs(settings: dict[str, dict]):
    """Around a compiled run whose recipe changes torch's compiler ``settings`` (:func:`compile_settings`): torch's
    compiled graphs are dropped (``torch.compiler.reset``) when it starts and when it ends. Dynamo's cache is the
    process's and reuses a graph for another model of the same code without looking at the settings it was compiled
    under: this way the run compiles under its own settings, and no graph compiled under them serves code of yours
    afterwards (yours recompile at their next call). A run under torch's default settings shares the cache as any
    torch.compile does."""
    if not settings:
        yield
        return
    torch.compiler.reset()
    try:
        yield
    finally:
        torch.compiler.reset()


def drops_full_attention_mask(args, model: nn.Module | None, collator=None) -> bool:
    """Whether a run leaves all-ones attention masks out of its batches (the recipe's ``static_masks``). Under
    ``torch.compile``, yes. In eager only for a model without a ``pad_token_id``: given no mask, transformers checks
    whether the first or last token of each row is the pad token (``warn_if_padding_and_no_attention_mask``), a
    device sync on every forward; with the mask kept, ``STATIC_MASKS`` builds it without one. Never for batches
    padded to buckets (:class:`~hf_apex.data.BucketCollator`): most of them are padded, and a batch without its mask
    would be a second call signature of each bucket's compiled graph, compiled again."""
    if not args.recipe.static_masks or data.wraps(collator, data.BucketCollator):
        return False
    return bool(args.torch_compile) or getattr(getattr(model, "config", None), "pad_token_id", None) is None


def warn_about_the_setup(trainer) -> None:
    """Warn, once the trainer is built, about what will run other than asked, or slowly."""
    args = trainer.args
    if fsdp_version(args) and not trainer.is_fsdp_enabled and args.world_size > 1:
        logger.warning(
            "hf_apex: FSDP was asked for but accelerate did not enable it (it shards on accelerators only, not "
            "on the CPU): this run is DDP, and every process holds the whole model and optimizer state."
        )
    if args.device.type == "cpu" and (args.fp16 or args.bf16 and not cpu_has_native_bf16()):
        logger.warning(
            "hf_apex: %s autocast on the CPU is often far slower than FP32; here prefer an FP32 stage "
            "(baseline, fused_adam, fused_adam_ln).",
            "FP16" if args.fp16 else "BF16 (this CPU has neither AVX512-BF16 nor AMX)",
        )
    if args.apex_fused_norms and args.torch_compile and graph_norm_kernel(args) == TORCH:
        logger.warning(
            "hf_apex: torch_compile is on, so the swapped norms run the torch op inside the compiled graph "
            "(Inductor fuses it), not apex's kernel. This is recorded in the metrics JSON."
        )
