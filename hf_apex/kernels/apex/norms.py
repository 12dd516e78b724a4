"""Apex-backed norm modules that are drop-in *subclasses* of the modules they replace.

A swapped module is the same instance with its class changed to a subclass of its stock class, so it keeps
its Parameters (same objects), buffers, hooks, dtype, device, ``state_dict`` keys and ``isinstance``
relations: a swapped GPT-2 ``ln_1`` is still an ``nn.LayerNorm``, so the Trainer still exempts it from weight
decay.

The path to the kernel is the cheapest eager one: an ``autograd.Function`` straight over apex's
``fused_layer_norm_cuda`` extension, with one explicit cast under autocast (apex's semantics: input, weight and
bias in the autocast dtype, output in that dtype). apex's own entry points dispatch through
``torch.library.custom_op``, which costs tens of microseconds per call. Which implementation runs is decided
once per module and input kind (device, dtype, autocast dtype, train/eval) and kept in a
:class:`~hf_apex.kernels.trace.KernelRoute` that also counts the calls that ran; apex's kernel when it can run,
else the stock ``forward`` (the exact torch op of the original model), recorded as a fallback with its reason.
Inside a ``torch.compile`` graph a swapped norm runs what ``hf_apex_graph_kernel`` says: the stock op (the default;
Inductor fuses it with its neighbours, measured faster than apex's kernel) or, for graphs replayed as traced without
code generation (torch.compile's ``cudagraphs`` backend), apex's kernel through its ``torch.library`` op after the
same cast as the eager path: its dispatch cost is paid once, when the graph is recorded. ``torch.jit`` tracing runs
the stock op.

``print(model)`` shows the new class and the route (``kernel=apex``, ``kernel=torch fallback (...)``).
A swapped module pickles as its stock class plus the swap, so ``torch.save(model)`` loads in any process that
can import hf_apex.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch
from torch import nn

from .. import swap
from ..swap import Swap
from ..trace import APEX, FALLBACK, TORCH, KernelRoute
from .availability import blocker, fix_for

logger = logging.getLogger("hf_apex")
APEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
APEX_DEVICE_TYPES = ("cuda",)  # where apex's ops run (its torch.library ops take any tensor and fail elsewhere)

_ext = None  # apex's fused_layer_norm_cuda; imported when the first apex route is built, never per call
_ops = None  # apex.normalization.fused_layer_norm (its torch.library ops, for graphs); imported by rewire, not traced


class ApexKernelError(RuntimeError):
    """An apex kernel was required (strict kernels) but cannot run."""


def _load_extension() -> None:
    global _ext
    if _ext is None:
        _ext = importlib.import_module("fused_layer_norm_cuda")


GRAPH_OPS = ("fused_layer_norm_affine_fwd", "fused_layer_norm_fwd", "fused_rms_norm_affine_fwd")


def load_graph_ops() -> str | None:
    """Import apex's ``torch.library`` norm ops (before tracing: a graph calls them, never imports them); why they
    cannot be used, or None."""
    global _ops
    if _ops is not None:
        return None
    try:
        module = importlib.import_module("apex.normalization.fused_layer_norm")
    except Exception as error:  # (apex's Python side may fail in more ways than ImportError)
        return f"apex.normalization does not import ({type(error).__name__}: {error})"
    missing = [name for name in GRAPH_OPS if not hasattr(module, name)]
    if missing:
        return f"this apex has no torch.library norm ops ({', '.join(missing)})"
    _ops = module
    return None


# Autograd functions straight over apex's extension. Under autocast (``amp``) each casts its input, weight and bias
# to the autocast dtype inside ``forward`` and casts the gradients back inside ``backward`` (apex's semantics, with
# one autograd node per norm call instead of one per cast).
class _LayerNormAffine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps, amp):
        ctx.dtypes = x.dtype, weight.dtype, bias.dtype
        if amp is not None:
            x, weight, bias = x.to(amp), weight.to(amp), bias.to(amp)
        x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
        y, mean, invvar = _ext.forward_affine(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, invvar)
        ctx.shape, ctx.eps = shape, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, invvar = ctx.saved_tensors
        dx, dw, db = _ext.backward_affine(dy.contiguous(), mean, invvar, x, ctx.shape, weight, bias, ctx.eps, False)
        tx, tw, tb = ctx.dtypes
        return dx.to(tx), dw.to(tw), db.to(tb), None, None, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shape, eps, amp):
        ctx.dtype = x.dtype
        x = (x.to(amp) if amp is not None else x).contiguous()
        y, mean, invvar = _ext.forward(x, shape, eps)
        ctx.save_for_backward(x, mean, invvar)
        ctx.shape, ctx.eps = shape, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, mean, invvar = ctx.saved_tensors
        dx = _ext.backward(dy.contiguous(), mean, invvar, x, ctx.shape, ctx.eps, False)
        return dx.to(ctx.dtype), None, None, None


class _RMSNormAffine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, shape, eps, amp):
        ctx.dtypes = x.dtype, weight.dtype
        if amp is not None:
            x, weight = x.to(amp), weight.to(amp)
        x, weight = x.contiguous(), weight.contiguous()
        y, invvar = _ext.rms_forward_affine(x, shape, weight, eps)
        ctx.save_for_backward(x, weight, invvar)
        ctx.shape, ctx.eps = shape, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, invvar = ctx.saved_tensors
        dx, dw = _ext.rms_backward_affine(dy.contiguous(), invvar, x, ctx.shape, weight, ctx.eps, False)
        tx, tw = ctx.dtypes
        return dx.to(tx), dw.to(tw), None, None, None


@functools.cache
def _warn_fallback(component: str, reason: str) -> None:  # once per process and reason: a log, not state
    logger.warning(
        "hf_apex: %s runs the torch op, not apex's kernel (%s); print(model) says so, and an ApexTrainer run's "
        "metrics count these calls.",
        component,
        reason,
    )


class _ApexNorm(Swap):
    """What every swapped norm shares: routing, counting, printing and pickling. Subclasses say which
    component they are and how to call the kernel (``hf_apex_kernel``)."""

    hf_apex_component = "norm"
    hf_apex_strict: bool = False  # raise instead of falling back
    hf_apex_compiled: bool = False  # the model will run under torch.compile (only changes what print shows)
    hf_apex_graph_kernel: str = TORCH  # inside a torch.compile graph: TORCH (the stock op) or APEX (apex's op)
    hf_apex_chooser = None  # autotune: callable(module, x, amp) -> "apex" | "torch", injected by rewire()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            return super().forward(x)
        if torch.compiler.is_compiling():
            if self.hf_apex_graph_kernel == APEX:
                return self._hf_apex_in_graph(x)
            return super().forward(x)  # the stock op: Inductor fuses it (measured faster than apex's kernel)
        amp = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        key = (x.device.type, x.dtype, amp, self.training)
        route = self.hf_apex_routes.get(key)
        if route is None:
            route = self.hf_apex_routes[key] = self._hf_apex_route(x, amp)
        out = route.run(self, x)
        route.calls += 1
        return out

    def _hf_apex_route(self, x: torch.Tensor, amp: torch.dtype | None) -> KernelRoute:
        component, stock_forward = self.hf_apex_component, stock_class(self).forward
        reason = blocker(component, x.device) or self._hf_apex_input_blocker(x, amp)
        if reason is not None:
            if self.hf_apex_strict:
                raise ApexKernelError(
                    f"{type(self).__name__}: apex_strict_kernels is on but apex's {component} kernel cannot run "
                    f"here ({reason}). {fix_for(reason)}".rstrip()
                )
            _warn_fallback(component, reason)
            return KernelRoute(component, FALLBACK, stock_forward, reason)
        _load_extension()
        backend = APEX if self.hf_apex_chooser is None else self.hf_apex_chooser(self, x, amp)
        return KernelRoute(component, backend, self.hf_apex_kernel(amp) if backend == APEX else stock_forward)

    def _hf_apex_in_graph(self, x: torch.Tensor) -> torch.Tensor:
        """apex's op inside a graph, with the eager path's semantics: under autocast, input, weight and bias cast to
        its dtype (the casts' backward casts the gradients back). The stock op where it cannot run."""
        amp = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        reason = self._hf_apex_input_blocker(x, amp)
        if reason is None and x.device.type not in APEX_DEVICE_TYPES:
            reason = f"{x.device.type} tensors"
        elif reason is None and _ops is None:
            reason = "apex's ops were not loaded"
        if reason is not None:
            if self.hf_apex_strict:
                raise ApexKernelError(
                    f"{type(self).__name__}: apex_strict_kernels is on but apex's {self.hf_apex_component} kernel "
                    f"cannot run inside the graph ({reason})."
                )
            return super().forward(x)
        with torch.autocast("cuda", enabled=False):
            return self.hf_apex_graph_call(x if amp is None else x.to(amp), amp)

    def hf_apex_graph_call(self, x: torch.Tensor, amp: torch.dtype | None) -> torch.Tensor:
        """apex's ``torch.library`` op on ``x`` (already in the autocast dtype), its parameters cast to ``amp``."""
        raise NotImplementedError

    def _hf_apex_input_blocker(self, x: torch.Tensor, amp: torch.dtype | None) -> str | None:
        dtype = amp or x.dtype
        if dtype not in APEX_DTYPES:
            return f"{dtype} inputs (apex's norms take fp32, fp16 and bf16)"
        weight = getattr(self, "weight", None)
        if amp is None and weight is not None and weight.dtype != x.dtype:
            return f"input {x.dtype} differs from weight {weight.dtype} outside autocast"
        return None

    def hf_apex_kernel(self, amp: torch.dtype | None):
        """``run(module, x)`` calling apex's kernel, casting to ``amp`` first when autocast is on."""
        raise NotImplementedError

    def hf_apex_reset(self) -> None:
        """Forget the routes (and their counts): the next call decides again."""
        self.hf_apex_routes = {}
        self.hf_apex_retired = []

    def hf_apex_reroute(self) -> None:
        """Decide the routes again at the next call, keeping the counts of the calls made so far (autotune's
        trial on whole steps switches backends during training)."""
        self.hf_apex_retired += self.hf_apex_routes.values()
        self.hf_apex_routes = {}

    def extra_repr(self) -> str:
        own = super().extra_repr()
        return f"{own}, kernel={self._hf_apex_describe()}" if own else f"kernel={self._hf_apex_describe()}"

    def _hf_apex_describe(self) -> str:
        taken = [r for r in self.hf_apex_routes.values() if r.calls]  # what runs now (a trial's routes: retired)
        if taken:  # a fallback keeps its reason, as before the first call
            return ", ".join(
                sorted({f"torch fallback ({r.reason})" if r.backend == FALLBACK else r.backend for r in taken})
            )
        weight = next(self.parameters(), None)
        reason = blocker(self.hf_apex_component, weight.device if weight is not None else None)
        if reason is not None:
            return f"torch fallback ({reason})"
        if self.hf_apex_compiled:
            if self.hf_apex_graph_kernel == APEX:
                return "apex, inside CUDA graphs (torch.compile's cudagraphs backend)"
            return "stock op inside torch.compile"
        return "apex or torch, autotuned" if self.hf_apex_chooser is not None else "apex"

    @classmethod
    def swap_members(cls, stock_cls: type) -> dict:
        name = f"ApexFused{stock_cls.__name__}"
        if name in _NAMES:  # another stock class of the same name (a fork of a model family, say)
            name = f"{name}_{stock_cls.__module__.replace('.', '_')}"
        _NAMES.add(name)
        return {"__module__": __name__, "__qualname__": name, "__name__": name}

    # What this process decided (routes, the chooser, apex's op in graphs) is not pickled: the loading process decides
    # again.
    def swap_state(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in PROCESS_ATTRIBUTES}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.hf_apex_reset()


class _LayerNormKernel(_ApexNorm):
    hf_apex_component = "layer_norm"

    def hf_apex_kernel(self, amp):
        if self.weight is None:
            return functools.partial(_run_layer_norm, amp=amp)
        return functools.partial(_run_layer_norm_affine, amp=amp)

    def hf_apex_graph_call(self, x, amp):
        shape = list(self.normalized_shape)
        if self.weight is None:
            return _ops.fused_layer_norm_fwd(x, shape, self.eps)[0]
        weight, bias = (self.weight, self.bias) if amp is None else (self.weight.to(amp), self.bias.to(amp))
        return _ops.fused_layer_norm_affine_fwd(x, weight, bias, shape, self.eps)[0]


def _run_layer_norm_affine(m, x, amp):
    return _LayerNormAffine.apply(x, m.weight, m.bias, m.normalized_shape, m.eps, amp)


def _run_layer_norm(m, x, amp):
    return _LayerNorm.apply(x, m.normalized_shape, m.eps, amp)


# LayerNorms without weight or bias, with the eps their forward hard-codes (surgery checks it numerically before
# swapping; the kernel then uses it).
WEIGHTLESS_LAYER_NORMS = {"OlmoLayerNorm": 1e-5}


class _WeightlessLayerNormKernel(_ApexNorm):
    """A LayerNorm with neither weight nor bias and a fixed eps (OLMo's), through apex's non-affine kernel."""

    hf_apex_component = "layer_norm"

    def hf_apex_kernel(self, amp):
        eps = WEIGHTLESS_LAYER_NORMS[stock_class(self).__name__]
        return functools.partial(_run_weightless, amp=amp, shape=tuple(self.normalized_shape), eps=eps)

    def hf_apex_graph_call(self, x, amp):
        eps = WEIGHTLESS_LAYER_NORMS[stock_class(self).__name__]
        return _ops.fused_layer_norm_fwd(x, list(self.normalized_shape), eps)[0]


def _run_weightless(m, x, amp, shape, eps):
    return _LayerNorm.apply(x, shape, eps, amp)


class _RMSNormKernel(_ApexNorm):
    """RMSNorm (``weight * x / sqrt(mean(x^2) + eps)``, HF's Llama/T5 family) through apex's RMS kernel."""

    hf_apex_component = "rms_norm"

    def hf_apex_kernel(self, amp):
        return functools.partial(_run_rms_norm, amp=amp, shape=tuple(self.weight.shape), eps=rms_norm_eps(self))

    def hf_apex_graph_call(self, x, amp):
        weight = self.weight if amp is None else self.weight.to(amp)
        return _ops.fused_rms_norm_affine_fwd(x, weight, list(self.weight.shape), rms_norm_eps(self))[0]


def _run_rms_norm(m, x, amp, shape, eps):
    return _RMSNormAffine.apply(x, m.weight, shape, eps, amp)


KINDS = {
    "layer_norm": _LayerNormKernel,
    "weightless_layer_norm": _WeightlessLayerNormKernel,
    "rms_norm": _RMSNormKernel,
}


def rms_norm_eps(module: nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    raise AttributeError(f"{type(module).__name__} has no epsilon attribute")


# What rewire() and a run set on a swapped module (unrewire() removes them all); the last four are this process's.
SWAP_ATTRIBUTES = (
    "hf_apex_strict",
    "hf_apex_compiled",
    "hf_apex_chooser",
    "hf_apex_graph_kernel",
    "hf_apex_routes",
    "hf_apex_retired",
)
PROCESS_ATTRIBUTES = SWAP_ATTRIBUTES[2:]

_NAMES: set[str] = set()


def swapped_class(stock_cls: type, kind: str) -> type:
    """The apex-backed subclass of ``stock_cls`` for ``kind`` (one class per pair; names are unique)."""
    return swap.swapped_class(KINDS[kind], stock_cls)


ApexFusedLayerNorm = swapped_class(nn.LayerNorm, "layer_norm")


def stock_class(module: nn.Module) -> type | None:
    """The original class of a swapped module, or None when ``module`` is not swapped."""
    return swap.stock_class(module, _ApexNorm)


def is_swapped(module: nn.Module) -> bool:
    return isinstance(module, _ApexNorm)
