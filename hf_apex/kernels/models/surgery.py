"""Model surgery: swap a model's norms for apex-backed subclasses, in place, and undo it.

``rewire(model)`` walks the module tree once. Each ``torch.nn.LayerNorm``, each RMSNorm of the common HF
families and OLMo's weightless LayerNorm becomes an apex-backed subclass of its own class (see
:mod:`hf_apex.kernels.apex.norms`); every other module whose class is a norm is listed in the report with the reason
it was left alone, so the report accounts for every norm. ``unrewire(model)`` restores the stock classes. Both
work on the instance; no class or module of transformers is patched.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..apex.availability import blocker
from ..apex.norms import (
    KINDS,
    SWAP_ATTRIBUTES,
    WEIGHTLESS_LAYER_NORMS,
    is_swapped,
    load_graph_ops,
    rms_norm_eps,
    stock_class,
)
from ..swap import restore, swap
from ..trace import APEX, TORCH

logger = logging.getLogger("hf_apex")

# RMSNorms computing weight * x * rsqrt(mean(x^2) + eps) (in fp32), i.e. what apex FusedRMSNorm computes.
RMS_NORM_CLASSES = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "MixtralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3RMSNorm",
        "Qwen3MoeRMSNorm",
        "Phi3RMSNorm",
        "Olmo2RMSNorm",
        "GraniteRMSNorm",
        "SmolLM3RMSNorm",
        "DeepseekV3RMSNorm",
        "T5LayerNorm",
        "MT5LayerNorm",
        "UMT5LayerNorm",
    }
)
# Norms that look like candidates but are not drop-ins for an apex kernel.
UNSUPPORTED_NORMS = {
    "GemmaRMSNorm": "Gemma-style norm scales by (1 + weight); apex FusedRMSNorm scales by weight",
    "Gemma2RMSNorm": "Gemma-style norm scales by (1 + weight); apex FusedRMSNorm scales by weight",
    "Gemma3RMSNorm": "Gemma-style norm scales by (1 + weight); apex FusedRMSNorm scales by weight",
    "Gemma3nRMSNorm": "Gemma-style norm; not a FusedRMSNorm drop-in",
    "CohereLayerNorm": "mean-centred norm without bias; no apex equivalent",
}


@dataclasses.dataclass
class RewireReport:
    """What :func:`rewire` did: module path -> class swap, and module path -> reason for skipping."""

    swapped: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def counts(self) -> dict[str, int]:
        """Number of swapped modules per new class name."""
        out: dict[str, int] = {}
        for new in self.swapped.values():
            name = new.split(" -> ")[-1]
            out[name] = out.get(name, 0) + 1
        return out

    def to_dict(self) -> dict:
        return {"swapped": self.counts(), "num_swapped": self.num_swapped, "skipped": dict(self.skipped)}

    def __str__(self) -> str:
        lines = [f"hf_apex rewire: {self.num_swapped} module(s) swapped"]
        lines += [f"  {name} x{n}" for name, n in sorted(self.counts().items())]
        if self.skipped:
            lines.append(f"  {len(self.skipped)} skipped:")
            lines += [f"    {path}: {why}" for path, why in sorted(self.skipped.items())]
        return "\n".join(lines)


_NORM_NAME = re.compile(r"Norm(\d+d|Gated)?$")


def _is_norm(module: nn.Module) -> bool:
    """Everything the report must account for: torch's norm layers and any class named like a norm."""
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or bool(_NORM_NAME.search(type(module).__name__))


def _probe(module: nn.Module, reference: Callable[[torch.Tensor], torch.Tensor], hidden: int, device, dtype) -> bool:
    """Does ``module`` compute ``reference`` on a random input? (False for meta tensors or any error.)"""
    if torch.device(device).type == "meta":
        return False
    try:
        x = torch.randn(2, hidden, device=device, dtype=dtype)
        with torch.no_grad():
            return torch.allclose(module(x).float(), reference(x.float()), rtol=1e-3, atol=1e-3)
    except Exception:
        return False


def _rms_norm_matches(module: nn.Module) -> bool:
    """For an RMSNorm class we do not know: does it compute weight * x * rsqrt(mean(x^2)+eps)?"""
    weight = getattr(module, "weight", None)
    own = dict(module.named_parameters(recurse=False))
    # Only a weight (no bias, no children) can be a FusedRMSNorm drop-in.
    if not isinstance(weight, nn.Parameter) or set(own) != {"weight"} or list(module.children()) or weight.ndim != 1:
        return False
    try:
        eps = rms_norm_eps(module)
    except AttributeError:
        return False
    return _probe(
        module,
        lambda x: weight.float() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps),
        weight.shape[0],
        weight.device,
        weight.dtype,
    )


def _weightless_matches(module: nn.Module, eps: float) -> bool:
    shape = getattr(module, "normalized_shape", None)
    if list(module.parameters()) or not shape or len(shape) != 1:
        return False
    return _probe(module, lambda x: F.layer_norm(x, tuple(shape), eps=eps), shape[0], "cpu", torch.float32)


def _kind_or_reason(module: nn.Module, layer_norm: bool, rms_norm: bool) -> tuple[str | None, str | None]:
    """``(kind, None)`` when ``module`` can be swapped, else ``(None, reason)``."""
    cls = type(module)
    name = cls.__name__
    if isinstance(module, nn.LayerNorm):
        if cls is not nn.LayerNorm:
            return None, f"{name} subclasses nn.LayerNorm with its own forward"
        if module.weight is not None and module.bias is None:
            return None, "bias-free LayerNorm (apex FusedLayerNorm has no bias=False)"
        return ("layer_norm", None) if layer_norm else (None, "LayerNorm swap disabled")
    if name in UNSUPPORTED_NORMS:
        return None, UNSUPPORTED_NORMS[name]
    if name in WEIGHTLESS_LAYER_NORMS:
        if not _weightless_matches(module, WEIGHTLESS_LAYER_NORMS[name]):
            return None, f"{name} no longer computes a weightless LayerNorm with eps={WEIGHTLESS_LAYER_NORMS[name]}"
        return ("weightless_layer_norm", None) if layer_norm else (None, "LayerNorm swap disabled")
    if name in RMS_NORM_CLASSES or (name.endswith("RMSNorm") and _rms_norm_matches(module)):
        return ("rms_norm", None) if rms_norm else (None, "RMSNorm swap disabled")
    return None, f"{name}: no apex equivalent known"


def rewire(
    model: nn.Module,
    *,
    layer_norm: bool = True,
    rms_norm: bool = True,
    strict_kernels: bool = False,
    chooser: Callable | None = None,
    compiled: bool = False,
    graph_kernel: str = TORCH,
) -> RewireReport:
    """Swap the norms of ``model`` for apex-backed subclasses, in place.

    Args:
        model (`nn.Module`): any model; HF models are handled module by module, whatever the family.
        layer_norm (`bool`, *optional*, defaults to `True`): swap `torch.nn.LayerNorm` (and OLMo's weightless
            LayerNorm) for apex's fused LayerNorm.
        rms_norm (`bool`, *optional*, defaults to `True`): swap HF RMSNorms for apex's fused RMSNorm.
        strict_kernels (`bool`, *optional*, defaults to `False`): a swapped module raises instead of falling
            back to the torch op when the apex kernel cannot run.
        chooser (`callable`, *optional*): ``chooser(module, x, amp) -> "apex" | "torch"``, asked once per module
            and input kind where apex can run (``ApexTrainer`` passes its autotuner here).
        compiled (`bool`, *optional*, defaults to `False`): the model will run under `torch.compile`, where the
            stock op runs unless ``graph_kernel`` says otherwise; only changes what `print(model)` says.
        graph_kernel (`str`, *optional*, defaults to `"torch"`): what a swapped norm runs inside a `torch.compile`
            graph: `"torch"`, the stock op (Inductor fuses it with its neighbours), or `"apex"`, apex's kernel
            through its `torch.library` op, for graphs replayed without code generation (the `cudagraphs`
            backend). Where apex's kernel cannot run on the module's device, the stock op.

    Returns:
        `RewireReport`: the swapped and skipped modules. Calling ``rewire`` again updates the options and
        forgets earlier routes (and their counts).
    """
    if graph_kernel not in (TORCH, APEX):
        raise ValueError(f"graph_kernel must be {TORCH!r} or {APEX!r}, got {graph_kernel!r}")
    report, options = RewireReport(), (strict_kernels, chooser, compiled, graph_kernel)
    for path, module in model.named_modules():
        if is_swapped(module):
            old = stock_class(module).__name__
        elif _is_norm(module):
            kind, reason = _kind_or_reason(module, layer_norm, rms_norm)
            if reason is not None:
                report.skipped[path] = reason
                continue
            old = type(module).__name__
            swap(module, KINDS[kind])
        else:
            continue
        module.hf_apex_strict, module.hf_apex_chooser, module.hf_apex_compiled = options[:3]
        module.hf_apex_graph_kernel = graph_kernel if _graph_kernel_runs(module, graph_kernel) else TORCH
        module.hf_apex_reset()
        report.swapped[path] = f"{old} -> {type(module).__name__}"
    # Said once per model and options: ApexTrainer applies its switches again when training starts.
    logger.log(logging.DEBUG if getattr(model, "_hf_apex_rewired", None) == options else logging.INFO, "%s", report)
    model._hf_apex_rewired = options
    return report


def _graph_kernel_runs(module: nn.Module, graph_kernel: str) -> bool:
    """Whether ``graph_kernel`` can run inside ``module``'s graphs (apex's: its kernel runs on the module's device;
    then its ops are imported here, before any tracing)."""
    if graph_kernel != APEX:
        return True
    weight = next(module.parameters(), None)
    device = weight.device if weight is not None else None
    if device is not None and device.type == "cpu" and torch.cuda.is_available():
        device = None  # a model the trainer moves to the GPU after rewiring: ask about this machine
    if blocker(module.hf_apex_component, device) is not None:
        return False
    reason = load_graph_ops()
    if reason is not None:
        _warn_no_graph_ops(reason)
    return reason is None


@functools.cache
def _warn_no_graph_ops(reason: str) -> None:  # once per process and reason: a log, not state
    logger.warning("hf_apex: the swapped norms run the stock op inside CUDA graphs, not apex's: %s.", reason)


def unrewire(model: nn.Module) -> int:
    """Restore the stock classes of every module :func:`rewire` swapped; returns how many were restored."""
    restored = 0
    model.__dict__.pop("_hf_apex_rewired", None)
    for module in model.modules():
        if stock_class(module) is not None and restore(module):
            for name in SWAP_ATTRIBUTES:
                module.__dict__.pop(name, None)
            restored += 1
    return restored
