"""``ApexTrainer``: the stock ``Trainer`` with apex kernels plugged in and stage metrics recorded."""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from accelerate.state import AcceleratorState
from torch import nn
from torch.utils._pytree import tree_map_only
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint
from transformers.training_args import ParallelMode

from . import data, plan, policy, runtime
from .autotune import compiled
from .autotune.cache import checkpoint_decisions, save_decisions
from .autotune.compiled import CompileCache
from .kernels.surgery import RewireReport
from .measure.callback import StageMetricsCallback
from .measure.sections import trainer_sections
from .plan import mark_graph_steps
from .training_args import (
    ADDED_ARGUMENTS,
    ApexTrainingArguments,
    refuse_accumulation_under_cuda_graphs,
    uses_cuda_graphs,
)

logger = logging.getLogger("hf_apex")


def config_refusal(trainer_cls: type, config: str) -> str:
    base = next(c for c in trainer_cls.__mro__[1:] if not issubclass(c, ApexTrainer)).__name__
    return (
        f"{base} replaces ApexTrainingArguments with {config}, dropping the stage: pass its config class through "
        f"hf_apex.with_stages as args (e.g. with_stages(SFTConfig)(..., stage=...) for SFTTrainer)."
    )


class ApexTrainer(Trainer):
    """A ``Trainer`` that trains at a stage of :class:`ApexTrainingArguments` and records its metrics: a thin adapter
    over the Trainer-free :class:`~hf_apex.plan.StagePlan`, which decides what the stage does to the model and the
    steps. With plain ``TrainingArguments`` it is the stock ``Trainer`` (a compile mode with CUDA graphs aside: it
    gets the step marks and logits' copies it needs, and gradient accumulation is refused).

    Subclassing is supported: override ``compute_loss``, ``training_step``, ``create_optimizer`` /
    ``get_optimizer_cls_and_kwargs``, ``log``, ``rewire_model`` / ``fuse_loss``, ``metrics_sections`` or
    ``create_stage_metrics_callback`` and call ``super()`` to keep what hf_apex adds (docs/extending.md says what
    each keeps; tests/test_subclass.py tests it). What a run changes outside the trainer is undone when ``train()``
    returns or raises (``StagePlan.run``, and accelerate's FP32 output conversion); what stays is owned by the model:
    swapped norms (``hf_apex.unrewire``), the fused loss and rotary embeddings computed once (restored by the next
    run that has them off)."""

    ARRANGES_BATCHES = True  # packing: False where a Trainer subclass has its own data pipeline (hf_apex.compose)
    GRAPHS_BLOCKED: str | None = None  # why a subclass's steps cannot run under CUDA graphs (hf_apex.compose)

    def __init__(
        self,
        model=None,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        *more,
        **kwargs,
    ):
        self.plan: plan.StagePlan | None = None  # what the stage does to the model and the steps (hf_apex.plan)
        self.stage_metrics: StageMetricsCallback | None = None
        self.compile_cache: CompileCache | None = None  # the run's compile-cache artifacts (compile_cache)
        self.fp32_outputs_dropped = False  # whether this run's forwards return outputs in the autocast dtype
        self._run: contextlib.ExitStack | None = None  # what train() undoes when it ends
        self._first_batch = False  # the run's one-off decisions are still to be made on its first batch
        self._deferred_log: tuple | None = None  # a logging step's log, written at the next step
        self._deferred_calls: dict | None = None  # while it is written: the kernel call counts at its own step
        self._param_count: tuple | None = None  # (model, parameters without embeddings), for floating_point_ops
        # The batches' layout (packing): decided on the data and the model before anything counts the steps.
        arranges = self.ARRANGES_BATCHES and "packing" not in getattr(args, "BASE_OWNED", ())
        self.batches = (
            data.for_run(args, model, train_dataset, eval_dataset, data_collator, processing_class)
            if arranges
            else None
        )
        if self.batches is not None:
            train_dataset, eval_dataset = self.batches.train_dataset, self.batches.eval_dataset
            args, data_collator = self.batches.arguments(args), self.batches.collator
        # Decided before Trainer.__init__ hands the compile backend to accelerate for good; on a copy of yours.
        args, self.graphs_blocked = plan.without_cuda_graphs(args, self.GRAPHS_BLOCKED)
        compiling = plan.decide_compile(args, model, train_dataset)
        args, self.compile_skipped, self.compile_payback, self._payback_key = compiling
        if isinstance(args, ApexTrainingArguments):  # (before Trainer.__init__, which builds model_init's model)
            owner = next(c for c in type(self).__mro__ if "compute_loss" in vars(c))  # (a loss of yours)
            self.plan = plan.StagePlan(args, loss_owner=None if owner is Trainer else owner.__qualname__)
        try:
            super().__init__(
                model, args, data_collator, train_dataset, eval_dataset, processing_class, *more, **kwargs
            )
        except TypeError as error:  # a subclass that rebuilds its own config from ours fails on a name of ours
            if isinstance(args, ApexTrainingArguments) and any(f"'{n}'" in str(error) for n in ADDED_ARGUMENTS):
                raise TypeError(config_refusal(type(self), "its own config")) from error
            raise
        if isinstance(args, ApexTrainingArguments) and not isinstance(self.args, ApexTrainingArguments):
            raise TypeError(config_refusal(type(self), type(self.args).__name__))
        self._accelerate_settings = runtime.accelerate_settings(self.accelerator)
        refuse_accumulation_under_cuda_graphs(self.args)  # (plain TrainingArguments; ApexTrainingArguments refuse it)
        if not isinstance(self.args, ApexTrainingArguments):
            return
        policy.validate_apex_args(self.args)
        policy.warn_about_the_setup(self)
        if not arranges and self.args.torch_compile:  # one compiled shape where the trainer's batches vary in length
            self.batches = data.as_rows(type(self).__name__, self.args, self.data_collator)
            self.data_collator = self.batches.collator if self.batches is not None else self.data_collator
        if self.model_init is None:
            self._convert(self.model)
        self.data_collator = self.plan.collator(self.data_collator, self.model)
        if self.args.stage_metrics:
            self.stage_metrics = self.create_stage_metrics_callback()
            self.add_callback(self.stage_metrics)

    @property
    def autotuner(self):
        return self.plan.autotuner if self.plan is not None else None

    def _reclaim_accelerate_state(self) -> None:
        """accelerate keeps its settings (precision, compile) in one state per process, which the next ``Trainer``
        built overwrites: a trainer built before another would train and evaluate with the other's. Re-created here
        when that happened (as Trainer does between hyperparameter-search trials), so that each trainer runs with its
        own arguments."""
        if runtime.accelerate_settings(self.accelerator) != self._accelerate_settings:
            logger.info("hf_apex: another Trainer changed accelerate's process-wide state since; this one's is back.")
            AcceleratorState._reset_state()  # (the process's distributed state, PartialState, stays)
            self.create_accelerator_and_postprocess()

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        self._reclaim_accelerate_state()
        if not isinstance(self.args, ApexTrainingArguments):
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        if self.model_init is None and self.model is not None:
            # Again: another trainer built on the same model may have converted it its own way since __init__.
            self._convert(self.model)
        with self.plan.run(self.model) as run:  # closed in reverse: each change is undone when the run ends
            self._run = run
            run.callback(setattr, self, "_run", None)
            if self.autotuner is not None:
                resumed = get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True else None
                self.autotuner.begin_run(pinned=checkpoint_decisions(resumed or resume_from_checkpoint))
                run.callback(self.autotuner.end_run)
            self.fp32_outputs_dropped, self._first_batch = False, True
            self._reuse_compiled_work(run)
            run.callback(self._log_deferred)  # a run that stops between a logging step and the next keeps its log
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
            if self.stage_metrics is not None and self.is_world_process_zero():
                state = None if self.compile_skipped else self.compile_cache.state if self.compile_cache else "cold"
                compiled.record_payback(self.args, self._payback_key, self.stage_metrics.last_summary, state)
            return output

    def _reuse_compiled_work(self, run: contextlib.ExitStack) -> None:
        """A run that compiles loads its compile-cache artifacts at the start of training, saves them after the metrics
        warm-up and again when it ends (:mod:`hf_apex.autotune.compiled`)."""
        self.compile_cache = None
        if not (self.args.torch_compile and self.args.compile_cache):
            return
        self.compile_cache = CompileCache(self.args, save_at=self.args.metrics_warmup_steps)
        self.compile_cache.begin(run)
        self.add_callback(self.compile_cache)
        run.callback(self.remove_callback, self.compile_cache)
        run.callback(self.compile_cache.save)  # (first: what an evaluation at the end compiled)

    def training_step(self, model, inputs, *args, **kwargs):
        inputs, real_tokens = data.take_real_tokens(inputs)  # (a packed or bucketed batch counts them on the host)
        if real_tokens is not None and self.stage_metrics is not None:
            self.stage_metrics.count_real_tokens(real_tokens)
        if self.plan is None:
            return super().training_step(model, inputs, *args, **kwargs)
        first = functools.partial(self._decide_on_first_batch, inputs) if self._first_batch else None
        self._first_batch = False  # (decided at the first step: accelerate has wrapped the model's forward by then)
        with self.plan.step(inputs, self.state.global_step, first):
            try:
                return super().training_step(model, inputs, *args, **kwargs)
            except RuntimeError as error:
                if "find_unused_parameters" in str(error) and self.args.ddp_find_unused_parameters is False:
                    raise RuntimeError(
                        "hf_apex: DDP stopped on a parameter the previous step did not use. ApexTrainingArguments "
                        "turn DDP's unused-parameter search off by default (ddp_find_unused_parameters=False, it "
                        "costs every step); this model needs it: pass --ddp_find_unused_parameters true."
                    ) from error
                raise

    def _decide_on_first_batch(self, inputs) -> None:
        """The run's one-off decisions: the model's output dtype (accelerate's), then the plan's (autotune's norms,
        the SDPA backend), timed on the unwrapped model without DDP's hooks (rank 0 times alone)."""
        if not (self.args.fp32_outputs or runtime.loss_reads_outputs(self)):
            model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)  # (FSDP1: self.model wraps it)
            self.fp32_outputs_dropped = runtime.drop_fp32_outputs(model, self._run)
        if self.autotuner is None:
            return
        inputs, raw = self._prepare_inputs(inputs), self.model.train()  # (as the step runs it: with dropout)
        sharded = policy.fsdp_version(self.args) or self.is_deepspeed_enabled  # (a partial forward strands shards)
        checkpointed = self.args.gradient_checkpointing or getattr(self.args, "activation_checkpointing", False)
        warmup = self.plan.decide_on_first_batch(
            raw,
            lambda: self._autocast_loss(raw, inputs),
            inputs,
            steps_left=self.state.max_steps - self.state.global_step,
            norms_in_step=not (sharded or checkpointed or getattr(raw, "is_gradient_checkpointing", False)),
            attention_blocked="not timed under FSDP or DeepSpeed" if sharded else None,
        )
        if warmup and self.stage_metrics is not None:
            self.stage_metrics.hold_warmup(warmup)  # the trial's steps and the profiled one after are warm-up

    def _autocast_loss(self, model: nn.Module, inputs: dict):
        with self.accelerator.autocast():
            return self.compute_loss(model, dict(inputs))  # (compute_loss may pop the labels)

    def evaluate(self, *args, **kwargs):
        self._reclaim_accelerate_state()
        if self.autotuner is not None:
            self.autotuner.interrupt()  # (an evaluation inside the norms' trial on whole steps is not a training step)
        return super().evaluate(*args, **kwargs)

    def prediction_step(self, model, inputs, *args, **kwargs):
        inputs, _ = data.take_real_tokens(inputs)
        with self.plan.evaluation_step(inputs) if self.plan else contextlib.nullcontext():
            outputs = super().prediction_step(model, inputs, *args, **kwargs)
        if uses_cuda_graphs(self.args):  # the next batch's replay reuses its outputs' memory: keep the logits' copy
            loss, logits, labels = outputs
            outputs = loss, tree_map_only(torch.Tensor, torch.clone, logits), labels
        return outputs

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        if self.plan is not None:  # Trainer builds the model again in train()
            self._convert(model)
            self.plan.masks.convert(model)
        return model

    def _convert(self, model: nn.Module) -> None:
        """The plan's converters on ``model``, the two of the subclass contract through their hooks."""
        self.plan.convert(model, {"rewire": self.rewire_model, "lm_loss": self.fuse_loss})

    def rewire_model(self, model: nn.Module) -> RewireReport | None:
        """Swap norms for apex fused norms when ``args.apex_fused_norms``; returns the report (or None)."""
        return self.plan.norms.convert(model)

    def fuse_loss(self, model: nn.Module) -> dict | None:
        """With ``args.fused_linear_cross_entropy``, compute the causal-LM training loss without the logits
        (:mod:`hf_apex.kernels.loss`); returns what was done (None when not asked), which the metrics JSON records."""
        return self.plan.loss.convert(model)

    # transformers >= 5.8 has no `adamw_apex_fused`: apex optimizers come in through this hook.
    def get_optimizer_cls_and_kwargs(self, args, model=None):
        if not (isinstance(args, ApexTrainingArguments) and args.apex_optimizer != "none" and self.plan):
            return super().get_optimizer_cls_and_kwargs(args, model)
        return self.plan.optimizer_cls_and_kwargs(model)

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        mark_graph_steps(self.args, optimizer)
        return optimizer

    def save_model(self, output_dir: str | None = None, *args, **kwargs):
        """The stock save, with this run's autotune decisions beside the weights (``hf_apex_autotune.json``): a
        resumed run rebuilds the optimizer whose state it loads. Checkpoints save through here before they push."""
        if self.autotuner is not None:
            self.autotuner.interrupt()  # (a save inside the norms' trial on whole steps is not a training step)
            if self.args.should_save:
                save_decisions(output_dir if output_dir is not None else self.args.output_dir, self.autotuner.state())
        super().save_model(output_dir, *args, **kwargs)

    def floating_point_ops(self, inputs) -> int:
        # The stock method walks every parameter on each micro-batch (0.3-0.5 ms of host time for BERT-base).
        main_input = getattr(self.model, "main_input_name", "input_ids")
        apex_args = isinstance(self.args, ApexTrainingArguments)
        if not apex_args or main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return super().floating_point_ops(inputs)
        if self._param_count is None or self._param_count[0] is not self.model:
            self._param_count = (self.model, self.model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main_input].numel() * self._param_count[1]

    def create_stage_metrics_callback(self) -> StageMetricsCallback:
        return StageMetricsCallback(
            stage=self.args.stage,
            warmup_steps=self.args.metrics_warmup_steps,
            peak_tflops=self.args.peak_tflops,
            profile_kernels=self.args.profile_kernels,
            extra=self.metrics_sections,
        )

    def metrics_sections(self) -> dict:
        """What the trainer adds to the metrics JSON at the end of a run (:mod:`hf_apex.measure.sections`)."""
        return trainer_sections(self)

    # A logging step's loss and gradient norm are read on the host at the end of the next step (HostCopy): no
    # host-device sync at a logging step. Through Trainer's private _maybe_log_save_evaluate, only where its signature
    # is the tested one (can_defer_logs); not where an evaluation, a save or the end of training follows at once, under
    # torch.distributed (the loss is gathered with a collective), the NaN/Inf filter or auto_find_batch_size, nor where
    # a callback of yours reads the logs (it could ask for an evaluation, a save or a stop at the logging step).
    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        self._log_deferred()
        if self._defers_log():
            state = self.state
            at = state.global_step, state.epoch, state.num_input_tokens_seen
            calls = self.stage_metrics.calls() if self.stage_metrics is not None else None  # (host tallies)
            self._deferred_log = runtime.HostCopy(tr_loss, grad_norm), at, calls, args, kwargs
            tr_loss -= tr_loss  # as the stock log resets it (on the device, after the copy)
            return
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
            and not any(runtime.reads_logs(cb) for cb in self.callback_handler.callbacks)
            and runtime.can_defer_logs()
        )

    def _log_deferred(self) -> None:
        """Log the deferred logging step as the stock Trainer would have logged it then."""
        pending, self._deferred_log = self._deferred_log, None
        if pending is None:
            return
        values, at, self._deferred_calls, args, kwargs = pending
        state, control = self.state, self.control
        now = state.global_step, state.epoch, state.num_input_tokens_seen
        flags = control.should_log, control.should_evaluate, control.should_save
        state.global_step, state.epoch, state.num_input_tokens_seen = at
        control.should_log, control.should_evaluate, control.should_save = True, False, False
        try:
            super()._maybe_log_save_evaluate(*values.get(), *args, **kwargs)
        finally:
            state.global_step, state.epoch, state.num_input_tokens_seen = now
            self.control.should_log, self.control.should_evaluate, self.control.should_save = flags
            self._deferred_calls = None

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self.stage_metrics is not None and "loss" in logs:  # merged before Trainer.log copies them anywhere
            logs.update(self.stage_metrics.pop_log_metrics(self.state.global_step, self._deferred_calls))
        super().log(logs, *args, **kwargs)
