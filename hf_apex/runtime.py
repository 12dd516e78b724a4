"""What a run changes while it runs, each with its undo (``ApexTrainer.train`` enters them in an ``ExitStack`` that
closes when it returns or raises), and the run's data and logging helpers."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from types import MethodType

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.training_args import ParallelMode

from .internals import (
    can_defer_logs,
    fp32_output_conversion,
    last_logged_step,
    mark_dynamic_length,
    reset_accelerate_state,
)

logger = logging.getLogger("hf_apex")


@contextlib.contextmanager
def strict_fp32():
    """FP32 matmuls, convolutions and RNNs without TF32 while it lasts (what a run with ``tf32=False`` means), then the
    settings found before, through the API they were set with: the ``allow_tf32`` switches, or the per-backend
    ``fp32_precision`` where the process set those (torch refuses to read one API after the other was set).
    transformers' ``tf32=False`` sets only torch's global FP32 precision, which a backend's TF32 switch made earlier
    in the process overrides (accelerate turns it on for torch.compile in FP32)."""
    cuda, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    precisions = [(b, "fp32_precision", b.fp32_precision) for b in (cuda, cudnn.conv, cudnn.rnn)]
    try:
        switches = [(cuda, "allow_tf32", cuda.allow_tf32), (cudnn, "allow_tf32", cudnn.allow_tf32)]
        strict = False
    except RuntimeError:
        switches, strict = precisions, "ieee"
    try:
        for target, name, _ in switches:
            setattr(target, name, strict)
        yield
    finally:
        for target, name, value in switches + precisions:  # (a switch sets the precisions its own way)
            setattr(target, name, value)


def drop_fp32_outputs(model: nn.Module, scope: contextlib.ExitStack) -> bool:
    """Take accelerate's conversion of ``model``'s outputs to FP32 off its forward (keeping accelerate's autocast)
    until ``scope`` closes; returns whether it did. accelerate wraps the forward of the model it prepares under native
    AMP: autocast inside, the conversion outside (:func:`~hf_apex.internals.fp32_output_conversion`)."""
    forward, converting = model.__dict__.get("forward"), fp32_output_conversion(model)
    if converting is None:
        return False
    autocast_forward = converting.model_forward  # unbound when the forward was a method, as accelerate found it
    model.forward = MethodType(autocast_forward, model) if isinstance(forward, MethodType) else autocast_forward
    scope.callback(setattr, model, "forward", forward)
    return True


def mark_lengths_dynamic(batch: Mapping) -> None:
    """Mark the length of ``batch``'s token-wide tensors (2-D, shaped as its ``input_ids``: the ones
    :class:`~hf_apex.data.BucketCollator` pads) dynamic for ``torch.compile``, so that its first graph serves every
    bucket. Left to itself, Dynamo compiles the first bucket as a static graph and the second again, dynamic. The mark
    is on the tensor the model is called with: the Trainer's loader has put the batch on the device by then."""
    ids = batch.get("input_ids")
    if not (torch.is_tensor(ids) and ids.dim() == 2):
        return
    for value in batch.values():
        if torch.is_tensor(value) and value.shape == ids.shape:
            mark_dynamic_length(value)


class DropFullAttentionMask:
    """A data collator that leaves out an ``attention_mask`` of all ones (it means what no mask means), so that the
    model's mask is decided without reading a tensor (:data:`~hf_apex.kernels.models.attention.STATIC_MASKS`): no mask,
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


def accelerate_settings(accelerator) -> tuple:
    """The settings accelerate keeps for the whole process (its ``AcceleratorState``): precision and compilation."""
    state = accelerator.state
    dynamo = state.dynamo_plugin
    return state.mixed_precision, getattr(dynamo, "backend", None), getattr(dynamo, "mode", None)


def loss_reads_outputs(trainer: Trainer) -> bool:
    """Whether the training loss is computed from the model's outputs outside its forward (label smoothing, a
    ``compute_loss_func``, a ``compute_loss`` of a subclass): from FP32 outputs, as accelerate gives them."""
    return (
        getattr(trainer, "label_smoother", None) is not None
        or getattr(trainer, "compute_loss_func", None) is not None
        or type(trainer).compute_loss is not Trainer.compute_loss
    )


def reads_logs(callback) -> bool:
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


class DeferredLog:
    """A logging step's log written at the end of the next step, as the stock Trainer would have written it then: its
    loss and gradient norm are read on the host a step later (:class:`HostCopy`), so the logging step waits on no
    device sync. Only where Trainer's ``_maybe_log_save_evaluate`` has the tested signature (:func:`can_defer_logs`);
    not where an evaluation, a save or the end of training follows at once, under torch.distributed (the loss is
    gathered with a collective), the NaN/Inf filter or ``auto_find_batch_size``, nor where a callback of yours reads
    the logs (it could ask for an evaluation, a save or a stop at the logging step)."""

    def __init__(self):
        self.pending: tuple | None = None
        self.calls: dict | None = None  # while a held log is written: the kernel call counts at its own step

    def applies(self, trainer: Trainer) -> bool:
        c, args = trainer.control, trainer.args
        return (
            c.should_log
            and trainer.state.global_step > last_logged_step(trainer)
            and not (c.should_evaluate or c.should_save or c.should_training_stop or c.should_epoch_stop)
            and args.parallel_mode != ParallelMode.DISTRIBUTED
            and args.world_size == 1
            and not (args.logging_nan_inf_filter or args.auto_find_batch_size)
            and not any(reads_logs(cb) for cb in trainer.callback_handler.callbacks)
            and can_defer_logs()
        )

    def hold(self, trainer: Trainer, tr_loss: torch.Tensor, grad_norm, args: tuple, kwargs: dict) -> bool:
        """Hold this logging step's log; False (nothing held) where it must be written now."""
        if not self.applies(trainer):
            return False
        state, metrics = trainer.state, getattr(trainer, "stage_metrics", None)
        at = state.global_step, state.epoch, state.num_input_tokens_seen
        calls = metrics.calls() if metrics is not None else None  # (host tallies)
        self.pending = HostCopy(tr_loss, grad_norm), at, calls, args, kwargs
        tr_loss -= tr_loss  # as the stock log resets it (on the device, after the copy)
        return True

    def write(self, trainer: Trainer, log_save_evaluate) -> None:
        """Write the held log through ``log_save_evaluate`` (Trainer's) as at its own step, if one is held."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        values, at, self.calls, args, kwargs = pending
        state, control = trainer.state, trainer.control
        now = state.global_step, state.epoch, state.num_input_tokens_seen
        flags = control.should_log, control.should_evaluate, control.should_save
        state.global_step, state.epoch, state.num_input_tokens_seen = at
        control.should_log, control.should_evaluate, control.should_save = True, False, False
        try:
            log_save_evaluate(*values.get(), *args, **kwargs)
        finally:
            state.global_step, state.epoch, state.num_input_tokens_seen = now
            control = trainer.control  # (a callback may have replaced it)
            control.should_log, control.should_evaluate, control.should_save = flags
            self.calls = None


def reclaim_accelerate_state(trainer: Trainer, settings: tuple) -> None:
    """accelerate keeps its settings (precision, compile) in one state per process, which the next ``Trainer`` built
    overwrites: a trainer built before another would train and evaluate with the other's. Re-created when that
    happened (as Trainer does between hyperparameter-search trials), so that each trainer runs with its own
    ``settings`` (:func:`accelerate_settings` when it was built)."""
    if accelerate_settings(trainer.accelerator) != settings:
        logger.info("hf_apex: another Trainer changed accelerate's process-wide state since; this one's is back.")
        reset_accelerate_state()
        trainer.create_accelerator_and_postprocess()
