"""What a stage does to a model and to a training step, without the Trainer: :class:`StagePlan`.

A stage is a list of model converters and one compile plan. ``StagePlan(args)`` decides them once per run from
:class:`~hf_apex.ApexTrainingArguments`; a training loop of any kind then asks it for what it needs::

    plan = StagePlan(args)
    plan.convert(model)                                  # apex's norms, the loss without logits, RoPE once
    opt_cls, kwargs = plan.optimizer_cls_and_kwargs(model)  # apex FusedAdam / FusedLAMB, as the stage asks
    with plan.run(model):                                # owns the compiled graphs and the masks until it ends
        for step, batch in enumerate(batches):
            if step == 0:
                plan.decide_on_first_batch(model, loss_of(batch), batch, steps_left=max_steps)
            with plan.step(batch):                       # the compiler's settings, SDPA's backend and masks
                ...                                      # forward, backward
            ...                                          # optimizer step (mark_graph_steps marks it for CUDA graphs)

Each converter's ``report`` says what it did (the metrics JSON's sections, :mod:`hf_apex.measure.sections`), and
``print(plan)`` all of it. :class:`~hf_apex.ApexTrainer` is a thin adapter over it and ``recipes/plain_loop.py`` uses
it as it is; neither decides anything of a stage itself."""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
from collections.abc import Callable, Mapping

import torch
from torch import nn

from . import data, policy, runtime
from .autotune import TRIAL_MIN_STEPS, TRIAL_WARMUP, Autotuner, DecisionCache, compiled, training_pass
from .kernels.apex.norms import is_swapped
from .kernels.apex.optim import apex_optimizer_cls_and_kwargs
from .kernels.models.attention import capture as capture_attention
from .kernels.models.attention import one_sequence_per_row, preferring, use_static_masks
from .kernels.models.loss import fuse_linear_cross_entropy, settle_problem_type, unfuse_linear_cross_entropy
from .kernels.models.rotary import compute_rotary_once, restore_rotary
from .kernels.models.surgery import RewireReport, rewire, unrewire
from .training_args import CUDA_GRAPHS_BACKEND, ApexTrainingArguments, graph_norm_kernel, uses_cuda_graphs

logger = logging.getLogger("hf_apex")


def decide_compile(args, model: nn.Module | None, train_dataset) -> tuple:
    """Whether a run asked to compile does, before anything compiles (a Trainer hands the backend to accelerate in
    its ``__init__``): ``(args, why_not, payback, payback_key)``, ``args`` a copy with compilation off where it would
    not repay itself here (:func:`hf_apex.policy.why_not_compile`); ``payback``: what compiling repays on this GPU
    (:func:`hf_apex.autotune.compiled.compile_payback`), under ``payback_key``."""
    payback = key = None
    if isinstance(args, ApexTrainingArguments) and args.torch_compile and not policy.graphs_without_gpu(args):
        key, payback = compiled.payback_key(args, model), compiled.compile_payback(args, model)
    why_not = policy.why_not_compile(args, train_dataset, payback)
    if why_not:
        logger.warning("hf_apex: not compiling: %s.", why_not)
        args = copy.copy(args)
        args.torch_compile, args.torch_compile_backend, args.torch_compile_mode = False, "no", None
    return args, why_not, payback, key


def without_cuda_graphs(args, why: str | None) -> tuple:
    """``(args, why)``, ``args`` as they are where ``why`` is None (no reason the steps cannot run under CUDA graphs)
    or they record none (``why`` is then None too); else a copy that compiles without them: Inductor's default mode
    for a mode that records them, eager for the ``cudagraphs`` backend (graphs of the eager kernels)."""
    if not (why and isinstance(args, ApexTrainingArguments) and uses_cuda_graphs(args)):
        return args, None
    logger.warning("hf_apex: compiling without CUDA graphs: %s.", why)
    args = copy.copy(args)
    if args.torch_compile_backend == CUDA_GRAPHS_BACKEND:
        args.torch_compile, args.torch_compile_backend, args.torch_compile_mode = False, "no", None
    else:
        args.torch_compile_mode = None
    return args, why


def mark_graph_steps(args, optimizer: torch.optim.Optimizer) -> None:
    """Under CUDA graphs (:func:`~hf_apex.training_args.uses_cuda_graphs`): once ``optimizer`` has stepped, the step's
    graph outputs (its gradients among them) are done with, and the next step's replays may reuse their memory."""
    if uses_cuda_graphs(args) and not getattr(optimizer, "_hf_apex_marks_steps", False):
        optimizer.register_step_post_hook(lambda *_: torch.compiler.cudagraph_mark_step_begin())
        optimizer._hf_apex_marks_steps = True


class Converter:
    """One conversion of a stage's model: ``convert`` (in place, again for every model the run trains; a converter
    that is off restores the stock model), ``revert`` (the stock model back) and ``report`` (what the last
    ``convert`` did, for the metrics JSON; None while it is off)."""

    name = ""

    def __init__(self, args):
        self.args, self.report = args, None

    def convert(self, model: nn.Module):
        raise NotImplementedError

    def revert(self, model: nn.Module) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"

    def describe(self) -> str:
        return "on" if self.report else "off"


class FusedNorms(Converter):
    """apex's fused LayerNorm and RMSNorm in place of the model's norms (``apex_fused_norms``): :func:`rewire`."""

    name = "rewire"

    def __init__(self, args, chooser: Callable | None = None):
        super().__init__(args)
        self.chooser = chooser  # autotune's choice per norm (apex or torch), asked at each norm's first call

    def convert(self, model: nn.Module) -> RewireReport | None:
        if not self.args.apex_fused_norms:
            if any(is_swapped(m) for m in model.modules()):  # a model reused from an earlier fused-norm run
                logger.warning("hf_apex: apex_fused_norms is off; restoring the stock norms of the rewired model.")
                unrewire(model)
            self.report = None
            return None
        self.report = rewire(
            model,
            strict_kernels=self.args.apex_strict_kernels,
            chooser=self.chooser if self.args.autotune else None,
            compiled=self.args.torch_compile,
            graph_kernel=graph_norm_kernel(self.args),
        )
        if self.report.num_swapped == 0:
            logger.warning("hf_apex: apex_fused_norms is on but no norm of %s could be swapped.", type(model).__name__)
        return self.report

    def revert(self, model: nn.Module) -> None:
        unrewire(model)

    def describe(self) -> str:
        return f"{self.report.num_swapped} swapped" if self.report else "off"


class LossWithoutLogits(Converter):
    """A causal LM's training loss without its logits (``fused_linear_cross_entropy``,
    :mod:`hf_apex.kernels.models.loss`).
    ``loss_owner``: the class whose ``compute_loss`` computes the loss from the model's outputs itself (a Trainer
    subclass's), which keeps the stock loss."""

    name = "lm_loss"

    def __init__(self, args, loss_owner: str | None = None):
        super().__init__(args)
        self.loss_owner = loss_owner

    def convert(self, model: nn.Module) -> dict | None:
        if not self.args.fused_linear_cross_entropy:
            unfuse_linear_cross_entropy(model)  # a model reused from a run that had it
            self.report = None
            return None
        if self.args.fp16:
            reason = "FP16 autocast keeps the stock loss"
        elif self.loss_owner is not None:
            reason = f"{self.loss_owner}.compute_loss computes the loss from the model's outputs itself"
        else:
            reason = fuse_linear_cross_entropy(model)
        if reason is not None:
            unfuse_linear_cross_entropy(model)
        # a stage turns it on for every model: only a switch of yours warrants a warning, once
        if reason is not None and reason != (self.report or {}).get("reason"):
            (logger.info if self.args.stage else logger.warning)(
                "hf_apex: fused_linear_cross_entropy is on but not used: %s.", reason
            )
        self.report = {"fused_linear_cross_entropy": reason is None, "reason": reason}
        return self.report

    def revert(self, model: nn.Module) -> None:
        unfuse_linear_cross_entropy(model)

    def describe(self) -> str:
        if not self.report:
            return "off"
        return "on" if self.report["fused_linear_cross_entropy"] else f"not used: {self.report['reason']}"


class RotaryOnce(Converter):
    """A RoPE model's cos/sin computed once per compiled forward (the recipe's ``rotary_once``, when compiling):
    ``report`` is how many rotary modules (0: the model has none)."""

    name = "rotary"

    def convert(self, model: nn.Module) -> int | None:
        if self.args.torch_compile and self.args.recipe.rotary_once:
            self.report = compute_rotary_once(model)
        else:
            restore_rotary(model)  # a model reused from a run that had it
            self.report = None
        return self.report

    def revert(self, model: nn.Module) -> None:
        restore_rotary(model)

    def describe(self) -> str:
        return "off" if self.report is None else f"{self.report} module(s)"


class StaticMasks(Converter):
    """SDPA's masks decided on the host (the recipe's ``static_masks``, :data:`~hf_apex.kernels.models.attention.
    STATIC_MASKS`): a run's change, undone when it ends (the model leaves with transformers' own attention, and
    saves so). ``report``: whether the model runs them."""

    name = "attention_masks"

    def __init__(self, args):
        super().__init__(args)
        self.model: nn.Module | None = None  # the model they were put on

    def convert(self, model: nn.Module) -> bool:
        self.model, self.report = model, use_static_masks(model, self.args.recipe.static_masks)
        return self.report

    def revert(self, model: nn.Module | None = None) -> None:
        """The model's own masks back (``report`` stays: what the run decided, which its metrics say)."""
        model = model if model is not None else self.model
        if self.report and model is not None:
            use_static_masks(model, on=False)
        self.model = None


class StagePlan:
    """A stage's converters, optimizer, compile plan, per-step context and first-batch decisions for one run.

    ``args``: :class:`~hf_apex.ApexTrainingArguments` (the run's, as they stand after any compile decision).
    ``loss_owner``: see :class:`LossWithoutLogits`. ``autotuner``: the run's (one is made where the arguments ask
    for timing: ``autotune``, ``attention_backend="fastest"``). ``hooks``: by converter name, a callable that
    converts in its place and returns its report (a Trainer subclass's ``rewire_model``)."""

    def __init__(
        self,
        args,
        *,
        loss_owner: str | None = None,
        autotuner: Autotuner | None = None,
        hooks: Mapping[str, Callable] | None = None,
    ):
        self.args, self.hooks = args, dict(hooks or {})
        if autotuner is None and (args.autotune or args.attention_backend == "fastest"):
            autotuner = Autotuner(DecisionCache())
        self.autotuner = autotuner
        self.norms = FusedNorms(args, chooser=self._choose_norm)
        self.loss = LossWithoutLogits(args, loss_owner)
        self.rotary = RotaryOnce(args)
        self.converters = [self.norms, self.loss, self.rotary]  # what stays with the model (each reversible)
        self.masks = StaticMasks(args)  # what the run changes and undoes (run)
        self.compile_settings: dict[str, dict] = {}  # the compiler's settings for the steps, by config module
        self.sdpa_backend: str | None = None  # the SDPA backend put first (None: PyTorch's choice)
        self.bucketed = False  # whether the run's batches are padded to length buckets (:meth:`collator`)

    def __repr__(self) -> str:
        parts = ", ".join(map(repr, [*self.converters, self.masks]))
        return f"StagePlan(stage={self.args.stage!r}, {parts}, compile={sorted(self.compile_settings)})"

    # -- the model ----------------------------------------------------------------------------------------
    def convert(self, model: nn.Module) -> None:
        """Every converter on ``model`` (again for each model a run builds: each one's report is the last model's),
        through its hook where it has one, then the compile plan, which depends on what they did (a loss without
        logits recomputes less)."""
        for converter in self.converters:
            hook = self.hooks.get(converter.name)
            converter.report = hook(model) if hook is not None else converter.convert(model)
        self.compile_settings = policy.compile_settings(self.args, model)

    def revert(self, model: nn.Module) -> None:
        for converter in (*self.converters, self.masks):
            converter.revert(model)

    def _choose_norm(self, module, x, amp) -> str:  # (a norm's first call: the autotuner exists by then)
        return self.autotuner.choose_norm(module, x, amp)

    # -- the run ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def run(self, model: nn.Module | None):
        """One run's scope, on ``model`` as :meth:`convert` left it (None: a model built later, whose masks
        ``masks.convert`` puts on): strict FP32 (``tf32=False``), the compiled graphs (dropped at both ends where the
        stage's settings are not torch's), the static masks; each undone, in reverse, when it ends. Yields the run's
        ``ExitStack``, for more of the same."""
        with contextlib.ExitStack() as run:
            if self.args.tf32 is False:
                run.enter_context(runtime.strict_fp32())
            run.enter_context(policy.own_compiled_graphs(self.compile_settings))
            run.callback(self.masks.revert)
            if model is not None:
                self.masks.convert(model)
            self.sdpa_backend = None if self.args.attention_backend == "fastest" else self.args.attention_backend
            yield run

    def collator(self, collator, model: nn.Module):
        """``collator``, leaving all-ones attention masks out of its batches where the run's masks are static."""
        self.bucketed = data.wraps(collator, data.BucketCollator)
        if collator is not None and policy.drops_full_attention_mask(self.args, model, collator):
            return runtime.DropFullAttentionMask(collator)
        return collator

    # -- the optimizer ------------------------------------------------------------------------------------
    def optimizer_cls_and_kwargs(self, model: nn.Module) -> tuple[type, dict]:
        """apex's optimizer (``apex_optimizer``) and its kwargs, autotune's choice where it times them."""
        tuner = self.autotuner
        choose = (lambda kwargs, blocked: tuner.choose_optimizer(model, kwargs, blocked)) if tuner else None
        return apex_optimizer_cls_and_kwargs(self.args, model, choose)

    # -- each step ----------------------------------------------------------------------------------------
    def one_sequence_per_row(self, inputs) -> bool:
        """Whether ``inputs``' rows are one sequence each, known without reading a tensor: under static masks, a
        batch without ``position_ids``."""
        return bool(self.masks.report) and isinstance(inputs, Mapping) and "position_ids" not in inputs

    @contextlib.contextmanager
    def step(self, inputs, global_step: int | None = None, first_batch: Callable[[], object] | None = None):
        """Around one training step on ``inputs``: the compiler's settings (torch.compile compiles inside the first
        step), a bucketed batch's length dynamic for it (one graph for every bucket), the masks decided on the host,
        autotune's norms trial told the optimizer steps done so far (``global_step``), ``first_batch()`` where given
        (the run's one-off decisions: :meth:`decide_on_first_batch`), then the SDPA backend put first, which
        torch.compile traces its graph with; torch's own again after it. DDP's stop on an unused parameter names the
        argument that lets it through."""
        with contextlib.ExitStack() as stack:
            for module, settings in self.compile_settings.items():
                stack.enter_context(importlib.import_module(module).patch(**settings))
            stack.enter_context(one_sequence_per_row(self.one_sequence_per_row(inputs)))
            if self.bucketed and self.args.torch_compile and isinstance(inputs, Mapping):
                runtime.mark_lengths_dynamic(inputs)
            if self.autotuner is not None and global_step is not None:
                self.autotuner.at_step(global_step)
            if first_batch is not None:
                first_batch()
            stack.enter_context(preferring(self.sdpa_backend))
            try:
                yield
            except RuntimeError as error:
                if "find_unused_parameters" in str(error) and self.args.ddp_find_unused_parameters is False:
                    raise RuntimeError(
                        "hf_apex: DDP stopped on a parameter the previous step did not use. ApexTrainingArguments "
                        "turn DDP's unused-parameter search off by default (ddp_find_unused_parameters=False, it "
                        "costs every step); this model needs it: pass --ddp_find_unused_parameters true."
                    ) from error
                raise

    @contextlib.contextmanager
    def evaluation_step(self, inputs):
        """Around one evaluation step: the SDPA backend and masks of the training steps."""
        with preferring(self.sdpa_backend), one_sequence_per_row(self.one_sequence_per_row(inputs)):
            yield

    # -- the first batch ----------------------------------------------------------------------------------
    def decide_on_first_batch(
        self,
        model: nn.Module,
        loss: Callable[[], torch.Tensor],
        inputs: Mapping,
        *,
        steps_left: int,
        sharded: bool = False,
    ) -> int:
        """The run's one-off decisions on its first batch ``inputs``, whose loss ``loss()`` computes on ``model``
        (unwrapped; ``loss`` may be None where the plan has no autotuner, which alone times): a classifier's problem
        type, which its first forward would otherwise set inside the compiled graph (:func:`settle_problem_type`);
        autotune's norms, timed on whole passes (not under torch.compile, nor with activation checkpointing, nor where
        the model is ``sharded`` by FSDP or DeepSpeed: a forward on one rank would stall the others), and the SDPA
        backend (``attention_backend="fastest"``; not timed where sharded). Returns the warm-up steps the metrics
        must skip (a norms trial's)."""
        settle_problem_type(model, inputs.get("labels") if isinstance(inputs, Mapping) else None)
        if self.autotuner is None:
            return 0
        warmup, args = 0, self.args
        checkpointed = args.gradient_checkpointing or getattr(args, "activation_checkpointing", False)
        norms_in_step = not (sharded or checkpointed or getattr(model, "is_gradient_checkpointing", False))
        attention_blocked = "not timed under FSDP or DeepSpeed" if sharded else None

        def masked():
            with one_sequence_per_row(self.one_sequence_per_row(inputs)):
                return loss()

        if norms_in_step and self.autotuner and args.autotune and args.apex_fused_norms and not args.torch_compile:
            main = getattr(model, "main_input_name", "input_ids")
            shape = next((tuple(v.shape) for k, v in inputs.items() if k == main and torch.is_tensor(v)), ())
            amp = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
            long_run = steps_left >= TRIAL_MIN_STEPS  # worth checking on whole steps
            self.autotuner.choose_norms(model, training_pass(model, masked), shape, amp, trial=long_run)
            warmup = TRIAL_WARMUP if self.autotuner.trial is not None else 0
        if args.attention_backend == "fastest":
            if attention_blocked is not None:
                self.sdpa_backend = self.autotuner.choose_attention(None, blocked=attention_blocked)
            else:
                self.sdpa_backend = self.autotuner.choose_attention(capture_attention(masked))
        return warmup
