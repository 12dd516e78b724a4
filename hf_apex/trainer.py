"""``ApexTrainer``: the stock ``Trainer`` with apex kernels plugged in and stage metrics recorded.

The trainer owns this run's state: its :class:`~hf_apex.autotune.Autotuner` (decisions, cache), the rewire
report, and the stage-metrics callback; the swapped norms and the optimizer keep their own call tallies. Two
trainers in one process share none of it.

Override points (each calls ``super()`` and can be replaced alone):

- ``rewire_model(model)``: the norm surgery applied to the model given to ``__init__`` and to every model
  ``model_init`` produces, before any DDP or compile wrapping.
- ``fuse_loss(model)``: the same for ``fused_linear_cross_entropy`` (the causal-LM loss without logits).
- ``get_optimizer_cls_and_kwargs(args, model)``: apex FusedAdam/FusedLAMB when ``args.apex_optimizer`` asks.
- ``create_stage_metrics_callback()``: the ``StageMetricsCallback`` attached when ``args.stage_metrics``.

What the ``Trainer`` overrides add, each in a line where it is defined: ``__init__`` runs eager where compiling would
not repay itself (:func:`why_not_compile`) and leaves all-ones attention masks out (:class:`DropFullAttentionMask`);
``train`` starts a run (strict FP32, autotune decisions, the model's switches, SDPA masks decided without reading a
tensor, this run's compile settings) and undoes what it set when it returns; ``training_step`` runs under those
settings and makes the run's one-off decisions on its first batch; ``create_optimizer`` marks CUDA-graph steps;
``prediction_step`` copies logits out of CUDA-graph memory; ``_maybe_log_save_evaluate`` reads a logging step's loss a
step later (:class:`HostCopy`); ``log`` merges the stage metrics. With plain ``TrainingArguments`` it behaves like
``Trainer``, except that a compile mode with CUDA graphs gets the step marks and the logits' copies it needs, and is
refused with gradient accumulation.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import json
import logging
import math
import os
import weakref
from collections.abc import Mapping
from types import MethodType

import torch
from accelerate.utils.operations import ConvertOutputsToFp32
from torch import nn
from torch.utils._pytree import tree_map_only
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from transformers.training_args import ParallelMode

from .autotune import STATE_FILE, TRIAL_MIN_STEPS, TRIAL_WARMUP, Autotuner, DecisionCache, training_pass
from .kernels.attention import STATIC_MASKS, one_sequence_per_row, preferring, use_static_masks
from .kernels.attention import capture as capture_attention
from .kernels.availability import blocker, cpu_has_native_bf16, fix_for
from .kernels.loss import fuse_linear_cross_entropy, is_causal_lm, is_fused, unfuse_linear_cross_entropy
from .kernels.norms import is_swapped
from .kernels.optim import apex_optimizer_cls_and_kwargs
from .kernels.rotary import compute_rotary_once, restore_rotary
from .kernels.surgery import RewireReport, rewire, unrewire
from .kernels.trace import APEX, TORCH
from .measure.callback import StageMetricsCallback
from .stages import STAGES
from .training_args import (
    CUDA_GRAPHS_BACKEND,
    ApexTrainingArguments,
    graph_norm_kernel,
    refuse_accumulation_under_cuda_graphs,
    uses_cuda_graphs,
)

logger = logging.getLogger("hf_apex")


def _fsdp_version(args) -> int | None:
    """1 or 2 when the run is sharded with FSDP (transformers' flags, else `accelerate launch`'s), else None."""
    if getattr(args, "fsdp", None):
        return int((getattr(args, "fsdp_config", None) or {}).get("version", 2))  # transformers' default: FSDP2
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        return int(os.environ.get("FSDP_VERSION", "1"))  # accelerate's default
    return None


def validate_apex_args(args: ApexTrainingArguments) -> None:
    """Refuse, before any data or model is loaded, combinations that cannot work: one ``ValueError`` naming
    the real blocker and the fix. ``recipes/finetune.py`` calls it right after parsing; ``ApexTrainer`` too."""
    fsdp = _fsdp_version(args)
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


def why_not_compile(args, train_dataset) -> str | None:
    """Why a run asked to compile should run eager, or None: fewer optimizer steps than the recipe's ``min_steps``, or
    a stage's CUDA graphs of the eager kernels (``auto``'s ``cudagraphs`` backend) without a GPU to record them on (the
    backend of yours compiles as asked)."""
    if not isinstance(args, ApexTrainingArguments) or not args.torch_compile:
        return None
    stage_backend = STAGES[args.stage].torch_compile_backend if args.stage else None
    if stage_backend == args.torch_compile_backend == CUDA_GRAPHS_BACKEND and (
        args.use_cpu or not torch.cuda.is_available()
    ):
        return f"no CUDA GPU to record stage {args.stage!r}'s CUDA graphs on: its eager kernels run as they are"
    min_steps = args.recipe.min_steps
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
    return (
        f"the run has {steps} optimizer steps, fewer than the stage recipe's min_steps={min_steps}, so "
        """compilation would cost more than it saves (--stage_recipe '{"min_steps": 0}' compiles anyway)"""
    )


def compile_settings(args, model: nn.Module | None) -> dict[str, dict]:
    """torch.compile's settings for a run's training steps on ``model``, by config module (empty: torch's defaults),
    from the run's :class:`~hf_apex.stages.StageRecipe`:

    - ``recompute_pointwise`` (``"true"``, or ``"auto"`` for a model whose loss reads its logits): the partitioner
      recomputes in the backward the pointwise results that the backward's matmuls read (``torch._functorch.config``).
    - ``eager_random``: random ops run torch's own kernels inside the graph (Inductor's ``fallback_random``).
    - ``fuse_projections``: linears that read one input run as one matmul (:mod:`hf_apex.kernels.projections`,
      Inductor's ``pre_grad_custom_pass``), where :func:`why_not_fuse_projections` has no objection."""
    if not (isinstance(args, ApexTrainingArguments) and args.torch_compile):
        return {}
    recipe, settings, inductor = args.recipe, {}, {}
    wanted = recipe.recompute_pointwise
    if wanted == "true" or (wanted == "auto" and (model is None or not is_fused(model))):
        settings["torch._functorch.config"] = {"ban_recompute_materialized_backward": False}
    if recipe.eager_random:
        inductor["fallback_random"] = True
    if why_not_fuse_projections(args, model) is None:
        from .kernels.projections import FUSE_SHARED_INPUT_LINEARS

        inductor["pre_grad_custom_pass"] = FUSE_SHARED_INPUT_LINEARS
    if inductor:
        settings["torch._inductor.config"] = inductor
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
    import torch._inductor.config

    if torch._inductor.config.pre_grad_custom_pass is not None:
        return "torch._inductor.config.pre_grad_custom_pass is set already (yours is kept)"
    return None


@contextlib.contextmanager
def compiled_step_settings(args, model: nn.Module | None):
    """:func:`compile_settings` set around one training step (torch.compile compiles inside the first), then torch's
    own again: another trainer's steps, and compiled code of yours, keep theirs."""
    with contextlib.ExitStack() as stack:
        for module, settings in compile_settings(args, model).items():
            stack.enter_context(importlib.import_module(module).patch(**settings))
        yield


# The compile settings of the graphs the last compiled ApexTrainer run left in Dynamo's cache. Dynamo's cache is the
# process's, and it reuses a graph for another model of the same class without looking at these settings.
# None: no compiled run yet (the graphs compiled before, if any, are yours, under torch's settings).
_graphs_compiled_under: dict | None = None


def compile_under_own_settings(args, model: nn.Module | None) -> None:
    """Before a compiled run: when its compile settings differ from those of the graphs the previous compiled run of
    this process left, drop torch's compiled graphs (``torch._dynamo.reset``), so that this run compiles its own
    (yours recompile at their next call)."""
    global _graphs_compiled_under
    if not (isinstance(args, ApexTrainingArguments) and args.torch_compile):
        return
    settings = compile_settings(args, model)
    if settings != (_graphs_compiled_under or {}):
        if _graphs_compiled_under is not None:
            logger.info(
                "hf_apex: this run compiles under another stage recipe than the graphs an earlier run compiled in "
                "this process: torch's compiled graphs are dropped, to compile this run's own."
            )
        torch._dynamo.reset()
    _graphs_compiled_under = settings


def keep_fp32_strict() -> None:
    """FP32 matmuls and convolutions without TF32, set on the backends (what a run with ``tf32=False`` starts with).

    transformers' ``tf32=False`` sets only torch's global FP32 precision, which a backend-level TF32 switch made
    earlier in the process overrides (accelerate turns it on for torch.compile in FP32)."""
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    except RuntimeError:  # the process set them through torch's newer per-backend API: use that one
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"


# The FP32-converting forwards taken off models (weakly held: a model can be freed), to put back when a later run
# asks for FP32 outputs again.
_CONVERTING_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_fp32_outputs(model: nn.Module, fp32: bool) -> bool:
    """Whether ``model``'s outputs stay in the autocast dtype after this: with ``fp32=False``, take accelerate's
    conversion of its outputs to FP32 off its forward and keep accelerate's autocast; with ``fp32=True``, put back
    a conversion taken off earlier. accelerate wraps the forward of the model it prepares under native AMP:
    autocast inside, the conversion (``ConvertOutputsToFp32``) outside."""
    if fp32:
        if model in _CONVERTING_FORWARDS:
            model.forward = _CONVERTING_FORWARDS.pop(model)
        return False
    if model in _CONVERTING_FORWARDS:  # taken off by an earlier run of the same model
        return True
    forward = model.__dict__.get("forward")
    converting = getattr(forward, "__wrapped__", None)
    if "_original_forward" not in model.__dict__ or not isinstance(converting, ConvertOutputsToFp32):
        return False
    _CONVERTING_FORWARDS[model] = forward
    autocast_forward = converting.model_forward  # unbound when the forward was a method, as accelerate found it
    model.forward = MethodType(autocast_forward, model) if isinstance(forward, MethodType) else autocast_forward
    return True


class DropFullAttentionMask:
    """A data collator that leaves out an ``attention_mask`` of all ones (it means what no mask means), so that the
    model's mask is decided without reading a tensor (:data:`~hf_apex.kernels.attention.STATIC_MASKS`): no mask,
    SDPA's ``is_causal``, and no host-device sync. It runs on the CPU batch, in the loader's workers. A batch with
    ``position_ids`` keeps its mask: without one, transformers would read packed sequences from the positions.
    Whether a run uses it: :func:`drops_full_attention_mask`."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        batch = self.collator(features)
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if torch.is_tensor(mask) and "position_ids" not in batch and bool(mask.all()):
            batch = {k: v for k, v in batch.items() if k != "attention_mask"}
        return batch

    def __repr__(self) -> str:
        return f"DropFullAttentionMask({self.collator!r})"


def drops_full_attention_mask(args, model: nn.Module | None) -> bool:
    """Whether a run leaves all-ones attention masks out of its batches (the recipe's ``static_masks``). Under
    ``torch.compile``, yes. In eager only for a model without a ``pad_token_id``: given no mask, transformers checks
    whether the first or last token of each row is the pad token (``warn_if_padding_and_no_attention_mask``), a
    device sync on every forward; with the mask kept, ``STATIC_MASKS`` builds it without one."""
    if not args.recipe.static_masks:
        return False
    return bool(args.torch_compile) or getattr(getattr(model, "config", None), "pad_token_id", None) is None


def _reads_logs(callback) -> bool:
    """Whether ``callback`` has an ``on_log`` of its own, other than transformers' (progress, printing, the
    report_to integrations) and hf_apex's: such a callback may act on a log (ask for an evaluation, a save, a stop)."""
    on_log = getattr(type(callback), "on_log", TrainerCallback.on_log)
    module = getattr(on_log, "__module__", "") or ""
    return on_log is not TrainerCallback.on_log and not module.startswith(("transformers.", "hf_apex."))


class HostCopy:
    """Values copied to the host without blocking; :meth:`get` waits for the copy alone, not for work queued since.

    ApexTrainer reads a logging step's loss and gradient norm this way, at the end of the next step. Read at once,
    as the stock Trainer reads them, they make the host wait for the device, which then idles while the host logs
    and starts the next step. Read a step later, they are the same values, and the step they belong to has finished
    while the next one is queued behind it.
    """

    def __init__(self, *values):
        self.values = [self._to_host(v) if torch.is_tensor(v) else v for v in values]
        self.events = []  # one per GPU a value came from: each copy runs on its own device's stream
        for device in {v.device for v in values if torch.is_tensor(v) and v.is_cuda}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.events.append(event)

    @staticmethod
    def _to_host(value: torch.Tensor) -> torch.Tensor:
        value = value.detach()
        if not value.is_cuda:
            return value.clone()
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        return host.copy_(value, non_blocking=True)

    def get(self) -> list:
        for event in self.events:
            event.synchronize()
        return self.values


class ApexTrainer(Trainer):
    """A ``Trainer`` that applies the apex switches of :class:`ApexTrainingArguments` (see module docstring)."""

    autotuner: Autotuner | None = None
    rewire_report: RewireReport | None = None
    loss_fusion: dict | None = None  # what fuse_loss did (fused_linear_cross_entropy)
    rotary_once: int | None = None  # rotary embeddings whose cos/sin are computed once (the recipe's rotary_once)
    static_masks = False  # whether train() runs the model with SDPA masks decided on the host (STATIC_MASKS)
    compile_skipped: str | None = None  # why torch_compile was asked for and not used (the recipe's min_steps)
    stage_metrics: StageMetricsCallback | None = None
    _deferred_log: tuple | None = None  # a logging step's (HostCopy, state, calls, arguments): logged a step later
    _deferred_calls: dict | None = None  # while it is logged: the kernel call counts at its own step
    _norms_to_tune = False  # the next training step first decides the model's norms (autotune)
    _attention_to_tune = False  # the next training step first decides the SDPA backend (attention_backend="fastest")
    _outputs_to_set = False  # the next training step first sets the model's output dtype (fp32_outputs)
    fp32_outputs_dropped = False  # whether this run's forwards return outputs in the autocast dtype
    sdpa_backend: str | None = None  # the SDPA backend put first for this run's steps (None: PyTorch's choice)

    def __init__(self, *args, **kwargs):
        # Decided before Trainer.__init__, which hands the compile backend to accelerate for good; on a copy of
        # the arguments, so that yours stay as you made them.
        given = inspect.signature(Trainer.__init__).bind_partial(self, *args, **kwargs)
        self.compile_skipped = why_not_compile(given.arguments.get("args"), given.arguments.get("train_dataset"))
        if self.compile_skipped:
            logger.warning("hf_apex: not compiling: %s.", self.compile_skipped)
            eager = copy.copy(given.arguments["args"])
            eager.torch_compile, eager.torch_compile_backend, eager.torch_compile_mode = False, "no", None
            given.arguments["args"] = eager
            args, kwargs = given.args[1:], given.kwargs
        super().__init__(*args, **kwargs)
        refuse_accumulation_under_cuda_graphs(self.args)  # (ApexTrainingArguments refuse it already; plain ones)
        if not isinstance(self.args, ApexTrainingArguments):
            return
        validate_apex_args(self.args)
        if _fsdp_version(self.args) and not self.is_fsdp_enabled and self.args.world_size > 1:
            logger.warning(
                "hf_apex: FSDP was asked for but accelerate did not enable it (it shards on accelerators only, not "
                "on the CPU): this run is DDP, and every process holds the whole model and optimizer state."
            )
        if self.args.device.type == "cpu" and (self.args.fp16 or self.args.bf16 and not cpu_has_native_bf16()):
            logger.warning(
                "hf_apex: %s autocast on the CPU is often far slower than FP32; here prefer an FP32 stage "
                "(baseline, fused_adam, fused_adam_ln).",
                "FP16" if self.args.fp16 else "BF16 (this CPU has neither AVX512-BF16 nor AMX)",
            )
        if self.args.autotune or self.args.attention_backend == "fastest":
            self.autotuner = Autotuner(DecisionCache(self.args.autotune_cache))
        if self.args.attention_backend != "fastest":  # (decided when training starts)
            self.sdpa_backend = self.args.attention_backend
        if self.model_init is None:
            self._apply_model_switches(self.model)
        if self.args.apex_fused_norms and self.args.torch_compile and graph_norm_kernel(self.args) == TORCH:
            logger.warning(
                "hf_apex: torch_compile is on, so the swapped norms run the torch op inside the compiled graph "
                "(Inductor fuses it), not apex's kernel. This is recorded in the metrics JSON."
            )
        if self.data_collator is not None and drops_full_attention_mask(self.args, self.model):
            self.data_collator = DropFullAttentionMask(self.data_collator)
        if self.args.stage_metrics:
            self.stage_metrics = self.create_stage_metrics_callback()
            self.add_callback(self.stage_metrics)

    # Start a run: strict FP32 when asked, this run's autotune decisions (or the resumed checkpoint's), fresh routes.
    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        if isinstance(self.args, ApexTrainingArguments):
            if self.args.tf32 is False:
                keep_fp32_strict()
            if self.autotuner is not None:
                self.autotuner.begin_run(pinned=self._checkpoint_decisions(resume_from_checkpoint))
            if self.model_init is None and self.model is not None:
                # Again: another trainer built on the same model may have rewired it its own way since __init__.
                self._apply_model_switches(self.model)
            self._norms_to_tune = self._tunes_norms_in_step()
            self._attention_to_tune = self.args.attention_backend == "fastest"
            self._outputs_to_set = True
            self.sdpa_backend = None if self._attention_to_tune else self.args.attention_backend
            if self.model_init is None and self.model is not None:
                self._use_attention(self.model)
            compile_under_own_settings(self.args, self.model)
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        finally:
            self._log_deferred()  # (a run that stopped between a logging step and the next keeps its log)
            if self.autotuner is not None:
                self.autotuner.end_run()
            if self.static_masks:  # the model leaves train() with transformers' own attention (and pickles so)
                use_static_masks(self.model, on=False)

    def _tunes_norms_in_step(self) -> bool:
        # Not under torch.compile (the graphs run graph_norm_kernel's op), FSDP (a forward on one rank would hang the
        # others) or activation checkpointing (reentrant checkpoints refuse autograd.grad): there each norm type
        # is timed alone instead.
        args = self.args
        return (
            self.autotuner is not None
            and args.apex_fused_norms
            and not args.torch_compile
            and _fsdp_version(args) is None
            and not args.gradient_checkpointing
            and not getattr(args, "activation_checkpointing", False)
            and not getattr(self.model, "is_gradient_checkpointing", False)  # enabled on the model itself
            and not self.is_deepspeed_enabled  # ZeRO-3 gathers parameters across ranks in a forward
        )

    def _one_sequence_per_row(self, inputs) -> bool:
        """Whether this batch's rows are one sequence each, known without reading a tensor: under static masks, a
        batch without ``position_ids`` (see :func:`~hf_apex.kernels.attention.one_sequence_per_row`)."""
        return self.static_masks and isinstance(inputs, Mapping) and "position_ids" not in inputs

    def training_step(self, model, inputs, *args, **kwargs):
        masks, compiled = self._one_sequence_per_row(inputs), compiled_step_settings(self.args, self.model)
        with one_sequence_per_row(masks), compiled:
            return self._training_step(model, inputs, *args, **kwargs)

    def _training_step(self, model, inputs, *args, **kwargs):
        if self._outputs_to_set:  # (accelerate wrapped the forward when train() prepared the model)
            self._outputs_to_set = False
            self.fp32_outputs_dropped = set_fp32_outputs(
                self.accelerator.unwrap_model(self.model, keep_torch_compile=False),  # (FSDP1: self.model wraps it)
                fp32=self.args.fp32_outputs or self._loss_reads_outputs(),
            )
        if self.autotuner is not None:
            self.autotuner.at_step(self.state.global_step)  # (the norms' trial on whole steps, while it runs)
        if self._norms_to_tune:
            self._norms_to_tune = False
            self._choose_norms(self._prepare_inputs(inputs))
        if self._attention_to_tune:
            self._attention_to_tune = False
            self.sdpa_backend = self._choose_attention(self._prepare_inputs(inputs))
        try:
            with preferring(self.sdpa_backend):  # (under torch.compile: the backend the graph is traced with)
                return super().training_step(model, inputs, *args, **kwargs)
        except RuntimeError as error:
            if "find_unused_parameters" in str(error) and self.args.ddp_find_unused_parameters is False:
                raise RuntimeError(
                    "hf_apex: DDP stopped on a parameter the previous step did not use. ApexTrainingArguments turn "
                    "DDP's unused-parameter search off by default (ddp_find_unused_parameters=False, it costs every "
                    "step); this model needs it: pass --ddp_find_unused_parameters true."
                ) from error
            raise

    def _loss_reads_outputs(self) -> bool:
        """Whether the training loss is computed from the model's outputs outside its forward (label smoothing, a
        ``compute_loss_func``, a ``compute_loss`` of a subclass): from FP32 outputs, as accelerate gives them."""
        return (
            getattr(self, "label_smoother", None) is not None
            or getattr(self, "compute_loss_func", None) is not None
            or type(self).compute_loss is not Trainer.compute_loss
        )

    def _choose_norms(self, inputs: dict) -> None:
        raw = self.model  # unwrapped: no DDP hooks or collectives in the timed passes (rank 0 times alone)

        def loss_fn():
            with self.accelerator.autocast():
                return self.compute_loss(raw, dict(inputs))  # (compute_loss may pop the labels)

        main = getattr(raw, "main_input_name", "input_ids")
        shape = next((tuple(v.shape) for k, v in inputs.items() if k == main and torch.is_tensor(v)), ())
        amp = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else None
        long_run = self.state.max_steps - self.state.global_step >= TRIAL_MIN_STEPS  # worth checking on whole steps
        self.autotuner.choose_norms(raw, training_pass(raw, loss_fn), shape, amp, trial=long_run)
        if self.autotuner.trial is not None and self.stage_metrics is not None:
            # The trial's steps are warm-up, and so is the step after them: the profiled one, which then proves
            # the kernels of the verdict. (This step is the run's first; the trial takes the next TRIAL_STEPS.)
            self.stage_metrics.hold_warmup(TRIAL_WARMUP)

    def _choose_attention(self, inputs: dict) -> str:
        """The SDPA backend timed fastest on the model's first attention call in ``inputs`` (rank 0 decides)."""
        if _fsdp_version(self.args) or self.is_deepspeed_enabled:  # a partial forward would strand gathered shards
            return self.autotuner.choose_attention(None, blocked="not timed under FSDP or DeepSpeed")
        raw = self.model  # unwrapped: eager, no DDP hooks
        raw.train()  # as the training step will run it: with dropout (a model from from_pretrained is in eval mode)

        def forward():
            with self.accelerator.autocast():
                self.compute_loss(raw, dict(inputs))

        return self.autotuner.choose_attention(capture_attention(forward))

    def _use_attention(self, model: nn.Module) -> None:
        """Run ``model``'s attention with masks decided on the host where the recipe asks (``static_masks``)."""
        self.static_masks = use_static_masks(model, self.args.recipe.static_masks)

    def evaluate(self, *args, **kwargs):
        if self.autotuner is not None:
            self.autotuner.interrupt()  # (an evaluation inside the norms' trial on whole steps is not a training step)
        return super().evaluate(*args, **kwargs)

    def prediction_step(self, model, inputs, *args, **kwargs):
        with preferring(self.sdpa_backend), one_sequence_per_row(self._one_sequence_per_row(inputs)):
            outputs = super().prediction_step(model, inputs, *args, **kwargs)
        if uses_cuda_graphs(self.args):  # the next batch's replay reuses its outputs' memory: keep the logits' copy
            loss, logits, labels = outputs  # (the loss is a new tensor already, the labels are the batch's)
            outputs = loss, tree_map_only(torch.Tensor, torch.clone, logits), labels
        return outputs

    def _checkpoint_decisions(self, resume_from_checkpoint) -> dict | None:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
        if not resume_from_checkpoint:
            return None
        path = os.path.join(resume_from_checkpoint, STATE_FILE)
        if not os.path.isfile(path):
            logger.warning(
                "hf_apex: %s has no %s (it was saved without autotune): if autotune now picks another optimizer "
                "than the one whose state it holds, loading that state fails.",
                resume_from_checkpoint,
                STATE_FILE,
            )
            return None
        with open(path) as f:
            return json.load(f)

    # Re-apply the surgery to every model model_init builds (Trainer re-creates the model in train()).
    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        if isinstance(self.args, ApexTrainingArguments):
            self._apply_model_switches(model)
            self._use_attention(model)
        return model

    def _apply_model_switches(self, model: nn.Module) -> None:
        self.rewire_report = self.rewire_model(model)
        self.loss_fusion = self.fuse_loss(model)
        if self.args.torch_compile and self.args.recipe.rotary_once:
            self.rotary_once = compute_rotary_once(model)
        else:
            restore_rotary(model)  # a model reused from a run that had it
            self.rotary_once = None

    def rewire_model(self, model: nn.Module) -> RewireReport | None:
        """Swap norms for apex fused norms when ``args.apex_fused_norms``; returns the report (or None)."""
        if not self.args.apex_fused_norms:
            if any(is_swapped(m) for m in model.modules()):  # rewire() works in place: a model reused from an
                # earlier fused-norm run must not carry apex norms into a stage that has none
                logger.warning("hf_apex: apex_fused_norms is off; restoring the stock norms of the rewired model.")
                unrewire(model)
            return None
        report = rewire(
            model,
            strict_kernels=self.args.apex_strict_kernels,
            chooser=self._choose_norm if self.args.autotune else None,
            compiled=self.args.torch_compile,
            graph_kernel=graph_norm_kernel(self.args),
        )
        if report.num_swapped == 0:
            logger.warning("hf_apex: apex_fused_norms is on but no norm of %s could be swapped.", type(model).__name__)
        return report

    def fuse_loss(self, model: nn.Module) -> dict | None:
        """With ``args.fused_linear_cross_entropy``, compute the causal-LM training loss without the logits
        (:mod:`hf_apex.kernels.loss`); returns what was done (None when not asked), which the metrics JSON records."""
        if not self.args.fused_linear_cross_entropy:
            unfuse_linear_cross_entropy(model)  # a model reused from a run that had it
            return None
        reason = fuse_linear_cross_entropy(model) if not self.args.fp16 else "FP16 autocast keeps the stock loss"
        # a stage turns it on for every model: only a switch of yours warrants a warning; train() applies the
        # switches again to the same model, which says nothing new
        if reason is not None and reason != (self.loss_fusion or {}).get("reason"):
            log = logger.info if self.args.stage else logger.warning
            log("hf_apex: fused_linear_cross_entropy is on but not used: %s.", reason)
        return {"fused_linear_cross_entropy": reason is None, "reason": reason}

    def _choose_norm(self, module, x, amp) -> str:
        return self.autotuner.choose_norm(module, x, amp)

    # transformers >= 5.8 has no `adamw_apex_fused`: apex optimizers come in through this hook.
    def get_optimizer_cls_and_kwargs(self, args, model=None):
        if isinstance(args, ApexTrainingArguments) and args.apex_optimizer != "none":
            choose = None
            if self.autotuner is not None:

                def choose(kwargs, blocked):
                    return self.autotuner.choose_optimizer(model, kwargs, blocked)

            return apex_optimizer_cls_and_kwargs(args, model, choose)
        return super().get_optimizer_cls_and_kwargs(args, model)

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        if uses_cuda_graphs(self.args) and not getattr(optimizer, "_hf_apex_marks_steps", False):
            # Once the optimizer has stepped, the step's graph outputs (its gradients among them) are done with: the
            # next step's replays may reuse their memory. (Gradient accumulation is refused here, in __init__:
            # GRAPHS_CANNOT_ACCUMULATE.)
            optimizer.register_step_post_hook(lambda *_: torch.compiler.cudagraph_mark_step_begin())
            optimizer._hf_apex_marks_steps = True
        return optimizer

    # A resumed run must rebuild the optimizer whose state it loads: keep this run's decisions with the checkpoint
    # (written first, so that a checkpoint pushed to the Hub carries them too).
    def _save_checkpoint(self, model, trial):
        if self.autotuner is not None:
            self.autotuner.interrupt()  # (a save inside the norms' trial on whole steps is not a training step)
        if self.autotuner is not None and self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, STATE_FILE), "w") as f:
                json.dump(self.autotuner.state(), f, indent=1)
        super()._save_checkpoint(model, trial)

    # The stock method walks every parameter on each micro-batch (0.3-0.5 ms of host time for BERT-base); the
    # count only changes with the model.
    def floating_point_ops(self, inputs) -> int:
        main_input = getattr(self.model, "main_input_name", "input_ids")
        apex_args = isinstance(self.args, ApexTrainingArguments)
        if not apex_args or main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return super().floating_point_ops(inputs)
        cached = getattr(self, "_hf_apex_param_count", None)
        if cached is None or cached[0] is not self.model:
            cached = self._hf_apex_param_count = (self.model, self.model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main_input].numel() * cached[1]

    def create_stage_metrics_callback(self) -> StageMetricsCallback:
        return StageMetricsCallback(
            stage=self.args.stage,
            warmup_steps=self.args.metrics_warmup_steps,
            peak_tflops=self.args.peak_tflops,
            profile_kernels=self.args.profile_kernels,
            extra=self._metrics_sections,
        )

    def _norms_in_graphs(self) -> str:
        inside = {m.hf_apex_graph_kernel for m in self.model.modules() if is_swapped(m)}
        if APEX in inside:
            return "apex's kernel inside the CUDA graphs (the cudagraphs backend: no code generation)" + (
                "; the stock op where apex's kernel cannot run" if TORCH in inside else ""
            )
        if graph_norm_kernel(self.args) == APEX:
            return "stock torch op inside the CUDA graphs (apex's norms cannot run there: the log says why)"
        return "stock torch op inside the compiled graph (Inductor)"

    def _metrics_sections(self) -> dict:
        """What the trainer adds to the metrics JSON at the end of a run."""
        kernels = {}
        settings = compile_settings(self.args, self.model)  # (empty in a run that skipped compiling: args of eager)
        inductor = settings.get("torch._inductor.config", {})
        if self.args.apex_fused_norms and self.args.torch_compile:
            kernels["norms_under_torch_compile"] = self._norms_in_graphs()
        if self.compile_skipped:
            kernels["torch_compile"] = f"not used: {self.compile_skipped}"
        elif "torch._functorch.config" in settings:
            kernels["compiled_backward"] = "recomputes the pointwise results its matmuls read (recompute_pointwise)"
        elif self.args.torch_compile and self.args.recipe.recompute_pointwise == "auto":
            kernels["compiled_backward"] = (
                "keeps the pointwise results its matmuls read (recompute_pointwise=auto: the loss runs without the "
                "logits)"
            )
        if "fallback_random" in inductor:
            kernels["random_ops"] = "torch's own kernels inside the compiled graph (eager_random)"
        if "pre_grad_custom_pass" in inductor:
            kernels["projections"] = (
                "Inductor's pre-grad pass runs the linears that read one input as one matmul, where it can "
                "(fuse_projections)"
            )
        elif self.args.torch_compile and self.args.recipe.fuse_projections != "false":
            kernels["projections"] = f"not fused: {why_not_fuse_projections(self.args, self.model)}"
        if isinstance(self.data_collator, DropFullAttentionMask):
            kernels["attention_mask"] = "left out of batches where it is all ones"
        if self.static_masks:
            implementation = getattr(getattr(self.model, "config", None), "_attn_implementation", STATIC_MASKS)
            kernels["attention_masks"] = (
                f"{implementation}: decided without reading a tensor (no padding: no mask, SDPA's is_causal; "
                "a batch without position_ids: one sequence per row)"
            )
        if self.args.attention_backend:
            kernels["attention_backend"] = self.sdpa_backend or "torch (PyTorch's own choice)"
        if self.rotary_once is not None and self.args.torch_compile:
            kernels["rotary_embedding"] = (
                f"cos/sin computed once per compiled forward ({self.rotary_once} module(s), rotary_once)"
                if self.rotary_once
                else "no rotary embedding in this model (rotary_once)"
            )
        if self.fp32_outputs_dropped:
            kernels["model_outputs"] = "autocast dtype (accelerate's FP32 conversion left out; the loss is FP32)"
        elif not self.args.fp32_outputs and self._loss_reads_outputs() and (self.args.bf16 or self.args.fp16):
            kernels["model_outputs"] = "FP32 (accelerate's conversion kept: the loss is computed from the outputs)"
        return {
            "rewire": self.rewire_report.to_dict() if self.rewire_report else None,
            "lm_loss": self.loss_fusion,
            "autotune": self.autotuner.report() if self.autotuner else [],
            "kernels": kernels,
            "ddp": self._ddp_settings(),
        }

    def _ddp_settings(self) -> dict | None:
        """What the DistributedDataParallel wrapper of this run really used (None without DDP)."""
        ddp = getattr(self.model_wrapped, "_orig_mod", self.model_wrapped)  # torch.compile wraps the DDP module
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            return None
        return {
            "find_unused_parameters": ddp.find_unused_parameters,
            "static_graph": ddp.static_graph,
            "bucket_cap_mb": ddp.bucket_bytes_cap / 2**20,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "broadcast_buffers": ddp.broadcast_buffers,
        }

    # A logging step's loss and gradient norm are read on the host at the end of the next step (HostCopy): no
    # host-device sync at a logging step. Not where an evaluation, a save or the end of training follows at once
    # (they log first), under torch.distributed (the loss is gathered with a collective), under the NaN/Inf filter,
    # with auto_find_batch_size (a retried attempt starts afresh), or where a callback of yours reads the logs (it
    # could ask for an evaluation, a save or a stop, which must see the logging step's model).
    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        self._log_deferred()
        if self._defers_log():
            state = self.state
            at = state.global_step, state.epoch, state.num_input_tokens_seen
            calls = self.stage_metrics.calls() if self.stage_metrics is not None else None  # (host tallies)
            self._deferred_log = HostCopy(tr_loss, grad_norm), at, calls, args, kwargs
            tr_loss -= tr_loss  # as the stock log resets it (on the device, after the copy)
            return  # (no evaluation or save is due at this step: _defers_log)
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def _defers_log(self) -> bool:
        c, args = self.control, self.args
        return (
            isinstance(args, ApexTrainingArguments)
            and c.should_log
            and self.state.global_step > self._globalstep_last_logged
            and not (c.should_evaluate or c.should_save or c.should_training_stop or c.should_epoch_stop)
            and args.parallel_mode != ParallelMode.DISTRIBUTED
            and args.world_size == 1
            and not (args.logging_nan_inf_filter or args.auto_find_batch_size)
            and not any(_reads_logs(cb) for cb in self.callback_handler.callbacks)
        )

    def _log_deferred(self) -> None:
        """Log the deferred logging step as the stock Trainer would have logged it then."""
        pending, self._deferred_log = self._deferred_log, None
        if pending is None:
            return
        copy, at, self._deferred_calls, args, kwargs = pending
        state, control = self.state, self.control
        now = state.global_step, state.epoch, state.num_input_tokens_seen
        flags = control.should_log, control.should_evaluate, control.should_save
        state.global_step, state.epoch, state.num_input_tokens_seen = at
        control.should_log, control.should_evaluate, control.should_save = True, False, False
        try:
            super()._maybe_log_save_evaluate(*copy.get(), *args, **kwargs)
        finally:
            state.global_step, state.epoch, state.num_input_tokens_seen = now
            self.control.should_log, self.control.should_evaluate, self.control.should_save = flags
            self._deferred_calls = None

    # Merge the stage metrics into the logs before Trainer.log copies them to log_history and the integrations.
    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self.stage_metrics is not None and "loss" in logs:
            logs.update(self.stage_metrics.pop_log_metrics(self.state.global_step, self._deferred_calls))
        super().log(logs, *args, **kwargs)
