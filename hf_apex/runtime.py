"""What a run changes while it runs, each with its undo (``ApexTrainer.train`` enters them in an ``ExitStack`` that
closes when it returns or raises), and the run's data and logging helpers."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from types import MethodType

import torch
from accelerate.utils.operations import ConvertOutputsToFp32
from torch import nn
from transformers import Trainer, TrainerCallback


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
    AMP: autocast inside, the conversion (``ConvertOutputsToFp32``) outside."""
    forward = model.__dict__.get("forward")
    converting = getattr(forward, "__wrapped__", None)
    if "_original_forward" not in model.__dict__ or not isinstance(converting, ConvertOutputsToFp32):
        return False
    autocast_forward = converting.model_forward  # unbound when the forward was a method, as accelerate found it
    model.forward = MethodType(autocast_forward, model) if isinstance(forward, MethodType) else autocast_forward
    scope.callback(setattr, model, "forward", forward)
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


# ApexTrainer defers a logging step's log through Trainer._maybe_log_save_evaluate, a private method: it does so only
# where the method has the signature it was written and tested against (transformers 5.17 to 5.25); elsewhere the
# run logs as the stock Trainer does.
LOG_SAVE_EVALUATE_PARAMETERS = (
    "self",
    "tr_loss",
    "grad_norm",
    "model",
    "trial",
    "epoch",
    "ignore_keys_for_eval",
    "start_time",
    "learning_rate",
)


def can_defer_logs(trainer_cls: type = Trainer) -> bool:
    """Whether ``trainer_cls``'s ``_maybe_log_save_evaluate`` takes the arguments ApexTrainer's deferred log passes."""
    method = getattr(trainer_cls, "_maybe_log_save_evaluate", None)
    if method is None:
        return False
    return tuple(inspect.signature(method).parameters) == LOG_SAVE_EVALUATE_PARAMETERS
