"""``ApexTrainer``: the stock ``Trainer`` with apex kernels plugged in and stage metrics recorded."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Mapping

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

from . import data, internals, plan, policy, runtime
from .autotune import compiled
from .autotune.cache import checkpoint_decisions, save_decisions
from .autotune.compiled import CompileCache
from .kernels.models.surgery import RewireReport
from .measure.callback import StageMetricsCallback
from .measure.flops import TrainerFlops
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
    """A ``Trainer`` that trains at a stage of :class:`ApexTrainingArguments` and records its metrics: thin overrides
    over the Trainer-free :class:`~hf_apex.plan.StagePlan`, which decides what the stage does to the model and the
    steps. With plain ``TrainingArguments`` it is the stock ``Trainer`` (under CUDA graphs with the step marks and
    logits' copies they need). Subclasses override its methods and call ``super()`` (docs/extending.md says what each
    keeps). What a run changes outside the model is undone when ``train()`` returns or raises (``StagePlan.run``);
    the model keeps its converters' swaps (``print(model)`` shows them) until a run with them off restores it."""

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
        self._deferred_log = runtime.DeferredLog()  # a logging step's log, written at the next step
        self._flops = TrainerFlops()  # floating_point_ops, its parameter count kept per model
        # The batches' layout (packing): decided on the data and the model before anything counts the steps.
        arranges = self.ARRANGES_BATCHES and "packing" not in getattr(args, "BASE_OWNED", ())
        given = args, model, train_dataset, eval_dataset, data_collator, processing_class
        self.batches = data.for_run(*given) if arranges else None
        if self.batches is not None:
            train_dataset, eval_dataset = self.batches.train_dataset, self.batches.eval_dataset
            args, data_collator = self.batches.arguments(args), self.batches.collator
        # Decided before Trainer.__init__ hands the compile backend to accelerate for good; on a copy of yours.
        args, self.graphs_blocked = plan.without_cuda_graphs(args, self.GRAPHS_BLOCKED)
        compiling = plan.decide_compile(args, model, train_dataset)
        args, self.compile_skipped, self.compile_payback, self._payback_key = compiling
        if isinstance(args, ApexTrainingArguments):  # (before Trainer.__init__, which builds model_init's model)
            owner = next(c for c in type(self).__mro__ if "compute_loss" in vars(c))  # (a loss of yours)
            hooks = {"rewire": self.rewire_model, "lm_loss": self.fuse_loss}  # (the subclass contract's converters)
            self.plan = plan.StagePlan(args, loss_owner=None if owner is Trainer else owner.__qualname__, hooks=hooks)
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
            self.plan.convert(self.model)
        self.data_collator = self.plan.collator(self.data_collator, self.model)
        if self.args.stage_metrics:
            self.stage_metrics = self.create_stage_metrics_callback()
            self.add_callback(self.stage_metrics)

    @property
    def autotuner(self):
        return self.plan.autotuner if self.plan is not None else None

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        runtime.reclaim_accelerate_state(self, self._accelerate_settings)
        if not isinstance(self.args, ApexTrainingArguments):
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        if self.model_init is None and self.model is not None:
            # Again: another trainer built on the same model may have converted it its own way since __init__.
            self.plan.convert(self.model)
        with self.plan.run(self.model) as run:  # closed in reverse: each change is undone when the run ends
            self._run = run
            run.callback(setattr, self, "_run", None)
            if self.autotuner is not None:
                resumed = get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True else None
                self.autotuner.begin_run(pinned=checkpoint_decisions(resumed or resume_from_checkpoint))
                run.callback(self.autotuner.end_run)
            self.fp32_outputs_dropped, self._first_batch = False, True
            self.compile_cache = CompileCache.for_run(self, run)
            # a run that stops between a logging step and the next keeps its log
            run.callback(self._deferred_log.write, self, super()._maybe_log_save_evaluate)
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
            if self.stage_metrics is not None and self.is_world_process_zero():
                state = None if self.compile_skipped else self.compile_cache.state if self.compile_cache else "cold"
                compiled.record_payback(self.args, self._payback_key, self.stage_metrics.last_summary, state)
            return output

    def get_train_dataloader(self):
        with data.training_collator(self):  # (a layout's training batches may differ from evaluation's)
            return super().get_train_dataloader()

    def training_step(self, model, inputs, *args, **kwargs):
        inputs, real_tokens = data.take_real_tokens(inputs)  # (a packed or bucketed batch counts them on the host)
        if real_tokens is not None and self.stage_metrics is not None:
            self.stage_metrics.count_real_tokens(real_tokens)
        if self.plan is None:
            return super().training_step(model, inputs, *args, **kwargs)
        first = functools.partial(self._decide_on_first_batch, inputs) if self._first_batch else None
        self._first_batch = False  # (decided at the first step: accelerate has wrapped the model's forward by then)
        with self.plan.step(inputs, self.state.global_step, first):
            return super().training_step(model, inputs, *args, **kwargs)

    def _decide_on_first_batch(self, inputs) -> None:
        """The run's one-off decisions: the model's output dtype (accelerate's), then the plan's (a classifier's
        problem type; autotune's norms, the SDPA backend, timed on the unwrapped model without DDP's hooks: rank 0
        times alone)."""
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)  # (FSDP1: self.model wraps it)
        if not (self.args.recipe.fp32_outputs or runtime.loss_reads_outputs(self)):
            self.fp32_outputs_dropped = runtime.drop_fp32_outputs(model, self._run)
        loss = None
        if self.autotuner is not None:  # (prepared again only to time: a _prepare_inputs may do more, e.g. generate)
            inputs, raw = internals.prepare_inputs(self, inputs), self.model.train()  # (as the step runs it)
            model, loss = raw, functools.partial(self._autocast_loss, raw, inputs)
        steps_left = self.state.max_steps - self.state.global_step
        sharded = bool(policy.fsdp_version(self.args) or self.is_deepspeed_enabled)
        warmup = self.plan.decide_on_first_batch(model, loss, inputs, steps_left=steps_left, sharded=sharded)
        if warmup and self.stage_metrics is not None:
            self.stage_metrics.hold_warmup(warmup)  # the trial's steps and the profiled one after are warm-up

    def _autocast_loss(self, model: nn.Module, inputs: dict):
        with self.accelerator.autocast():
            return self.compute_loss(model, dict(inputs) if isinstance(inputs, Mapping) else inputs)  # (it may pop)

    def evaluate(self, *args, **kwargs):
        runtime.reclaim_accelerate_state(self, self._accelerate_settings)
        if self.autotuner is not None:
            self.autotuner.interrupt()  # (an evaluation inside the norms' trial on whole steps is not a training step)
        return super().evaluate(*args, **kwargs)

    def prediction_step(self, model, inputs, *args, **kwargs):
        inputs, _ = data.take_real_tokens(inputs)
        with self.plan.evaluation_step(inputs) if self.plan else contextlib.nullcontext():
            outputs = super().prediction_step(model, inputs, *args, **kwargs)
        if uses_cuda_graphs(self.args):  # the next batch's replay reuses its outputs' memory: keep the logits' copy
            loss, logits, labels = outputs
            outputs = loss, internals.tree_map_only(torch.Tensor, torch.clone, logits), labels
        return outputs

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        if self.plan is not None:  # Trainer builds the model again in train()
            self.plan.convert(model)
            self.plan.masks.convert(model)
        return model

    def rewire_model(self, model: nn.Module) -> RewireReport | None:
        """Swap norms for apex fused norms when ``args.apex_fused_norms``; returns the report (or None)."""
        return self.plan.norms.convert(model)

    def fuse_loss(self, model: nn.Module) -> dict | None:
        """With ``args.fused_linear_cross_entropy``, compute the causal-LM training loss without the logits
        (:mod:`hf_apex.kernels.models.loss`); returns what was done (None when not asked), for the metrics JSON."""
        return self.plan.loss.convert(model)

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
        flops = self._flops(self.model, inputs) if isinstance(self.args, ApexTrainingArguments) else None
        return super().floating_point_ops(inputs) if flops is None else flops

    def create_stage_metrics_callback(self) -> StageMetricsCallback:
        return StageMetricsCallback.for_args(self.args, extra=self.metrics_sections)

    def metrics_sections(self) -> dict:
        """What the trainer adds to the metrics JSON at the end of a run (:mod:`hf_apex.measure.sections`)."""
        return trainer_sections(self)

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):  # (the log deferred: runtime.DeferredLog)
        self._deferred_log.write(self, super()._maybe_log_save_evaluate)
        apex_args = isinstance(self.args, ApexTrainingArguments)
        if not (apex_args and self._deferred_log.hold(self, tr_loss, grad_norm, args, kwargs)):
            super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self.stage_metrics is not None and "loss" in logs:  # merged before Trainer.log copies them anywhere
            logs.update(self.stage_metrics.pop_log_metrics(self.state.global_step, self._deferred_log.calls))
        super().log(logs, *args, **kwargs)
