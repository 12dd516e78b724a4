"""Apex-backed norm modules that are drop-in *subclasses* of the modules they replace.

A swapped module is the same instance with its class changed to a subclass of its stock class, so it keeps
its Parameters (same objects), buffers, hooks, dtype, device, ``state_dict`` keys and ``isinstance``
relations: a swapped GPT-2 ``ln_1`` is still an ``nn.LayerNorm``, so the Trainer still exempts it from weight
decay. ``forward`` calls apex's fused kernel when it can run; otherwise it calls the stock ``forward`` (the
exact torch op of the original model) and records the fallback with its reason. ``print(model)`` shows the
new class name and which backend the module will use.
"""

from __future__ import annotations

import torch
from torch import nn

from .counters import APEX, FALLBACK, KERNEL_COUNTER, TORCH_CHOSEN
from .import_utils import APEX_BUILD_HINT, is_fused_norm_available

_SWAPPED_CLASSES: dict[type, type] = {}


class ApexKernelError(RuntimeError):
    """An apex kernel was required (strict kernels) but could not run."""


def _fallback_reason(x: torch.Tensor, weight: torch.Tensor | None) -> str | None:
    """Why apex's fused norm cannot run on this input, or None when it can."""
    if not is_fused_norm_available():
        return "apex fused_layer_norm_cuda extension not available"
    if torch.jit.is_tracing() or torch.jit.is_scripting():
        return "torch.jit tracing"
    if not x.is_cuda:
        return f"{x.device.type} tensor"
    if weight is not None and weight.dtype != x.dtype and not torch.is_autocast_enabled():
        return f"input {x.dtype} differs from weight {weight.dtype} outside autocast"
    return None


class _ApexNormMixin:
    """Shared forward logic; ``_component`` names the tally, ``_apex_forward`` calls the kernel."""

    _component = "norm"
    hf_apex_strict: bool = False
    hf_apex_autotune: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # apex's fused norm modules take the torch op under compile as well; per-call counting would
            # break the graph, so the trainer reports this case from its configuration instead.
            return super().forward(x)
        reason = _fallback_reason(x, self.weight)
        if reason is None:
            if self.hf_apex_autotune and _autotuned_backend(self, x) == TORCH_CHOSEN:
                KERNEL_COUNTER.record(self._component, TORCH_CHOSEN, "autotune measured torch faster")
                return super().forward(x)
            KERNEL_COUNTER.record(self._component, APEX)
            return self._apex_forward(x)
        if self.hf_apex_strict:
            hint = (
                APEX_BUILD_HINT
                if "extension" in reason
                else "Move the model to a CUDA device."
                if "tensor" in reason
                else ""
            )
            raise ApexKernelError(
                f"{type(self).__name__}: strict kernels are on but apex cannot run here ({reason}). {hint}".strip()
            )
        KERNEL_COUNTER.record(self._component, FALLBACK, reason)
        return super().forward(x)

    def extra_repr(self) -> str:
        backend = "apex" if is_fused_norm_available() else "torch fallback"
        return f"{super().extra_repr()}, kernel={backend}"


class ApexFusedLayerNorm(_ApexNormMixin, nn.LayerNorm):
    """``nn.LayerNorm`` that runs apex ``fused_layer_norm_cuda`` (affine or not)."""

    _component = "layer_norm"

    def _apex_forward(self, x: torch.Tensor) -> torch.Tensor:
        from apex.normalization.fused_layer_norm import fused_layer_norm, fused_layer_norm_affine

        if self.weight is None:
            return fused_layer_norm(x, self.normalized_shape, self.eps)
        return fused_layer_norm_affine(x, self.weight, self.bias, self.normalized_shape, self.eps)


class _ApexRMSNormMixin(_ApexNormMixin):
    """RMSNorm (``weight * x / sqrt(mean(x^2) + eps)``, HF's Llama/T5 family) through apex FusedRMSNorm."""

    _component = "rms_norm"

    def _apex_forward(self, x: torch.Tensor) -> torch.Tensor:
        from apex.normalization.fused_layer_norm import fused_rms_norm_affine

        return fused_rms_norm_affine(x, self.weight, tuple(self.weight.shape), rms_norm_eps(self))

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={rms_norm_eps(self)}, kernel=" + (
            "apex" if is_fused_norm_available() else "torch fallback"
        )


def _autotuned_backend(module: nn.Module, x: torch.Tensor) -> str:
    """apex or torch for this norm type, hidden size and dtype: timed once, on the first training call, at that
    call's token count (later shapes reuse the decision, so no timing lands in later steps)."""
    from .autotune import APEX as A
    from .autotune import TORCH as T
    from .autotune import get_autotuner, rel_err, tolerance

    amp = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() else None
    base = (type(module).__name__, x.shape[-1], x.dtype, amp)
    tuner = get_autotuner()
    if base in tuner.memo:
        return tuner.memo[base]
    if not module.training:  # evaluation before any training call: apex, without deciding
        return APEX
    tokens = x.numel() // x.shape[-1]
    bucket = 1 << max(tokens - 1, 0).bit_length()
    params = [p for p in module.parameters() if p.requires_grad]
    stock_forward = super(_ApexNormMixin, module).forward
    forwards = {A: module._apex_forward, T: stock_forward}
    # Timing must not move the training RNG (dropout), and must work when the caller runs under no_grad
    # (e.g. the first pass of activation checkpointing).
    with torch.random.fork_rng(devices=[x.device] if x.is_cuda else []), torch.enable_grad():
        probe = x.detach().clone().requires_grad_(True)
        grad_out = torch.randn_like(x, dtype=amp or x.dtype)

        def fwd_bwd(name):
            y = forwards[name](probe)
            # autograd.grad returns gradients without accumulating into .grad: training state is untouched.
            return y, torch.autograd.grad(y, [probe, *params], grad_out.to(y.dtype))

        def parity(name):
            (y, grads), (ref_y, ref_grads) = fwd_bwd(name), fwd_bwd(T)
            tol = tolerance(amp or x.dtype)
            return all(rel_err(a, b) < tol for a, b in zip([y, *grads], [ref_y, *ref_grads]))

        decision = tuner.choose(
            module._component,
            {"norm": base[0], "hidden": base[1], "tokens": bucket, "dtype": str(x.dtype), "autocast": str(amp)},
            {name: (lambda name=name: fwd_bwd(name)) for name in forwards},
            parity,
        )
    backend = TORCH_CHOSEN if decision.backend == T else APEX
    tuner.memo[base] = backend
    return backend


def rms_norm_eps(module: nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    raise AttributeError(f"{type(module).__name__} has no epsilon attribute")


def swapped_class(stock_cls: type) -> type:
    """The apex subclass of ``stock_cls`` (created once per stock class)."""
    if stock_cls is nn.LayerNorm:
        return ApexFusedLayerNorm
    if stock_cls not in _SWAPPED_CLASSES:
        name = f"ApexFused{stock_cls.__name__}"
        cls = type(name, (_ApexRMSNormMixin, stock_cls), {"__module__": __name__})
        globals().setdefault(name, cls)  # importable by name, so pickle/torch.save of a rewired model works
        _SWAPPED_CLASSES[stock_cls] = cls
    return _SWAPPED_CLASSES[stock_cls]


def stock_class(module: nn.Module) -> type | None:
    """The original class of a swapped module, or None when ``module`` is not swapped."""
    cls = type(module)
    if not issubclass(cls, _ApexNormMixin):
        return None
    return next(base for base in cls.__mro__[1:] if not issubclass(base, _ApexNormMixin))


def is_swapped(module: nn.Module) -> bool:
    return isinstance(module, _ApexNormMixin)
