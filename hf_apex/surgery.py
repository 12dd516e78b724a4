"""Model surgery: swap a model's norms for apex-backed subclasses, in place, and undo it.

``rewire(model)`` walks the module tree once. Each ``torch.nn.LayerNorm`` and each RMSNorm of the common HF
families becomes an apex-backed subclass of its own class (see :mod:`hf_apex.norms`); anything else that looks
like a norm is left alone and listed in the report with the reason. ``unrewire(model)`` restores the stock
classes. Both work on the instance; no class or module of transformers is patched.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from .norms import is_swapped, rms_norm_eps, stock_class, swapped_class

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
# Norms that look like RMSNorm but are not FusedRMSNorm drop-ins.
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


def _is_norm_like(module: nn.Module) -> bool:
    name = type(module).__name__
    return "Norm" in name and isinstance(getattr(module, "weight", None), nn.Parameter)


def _rms_norm_matches(module: nn.Module) -> bool:
    """For an RMSNorm class we do not know: does it compute weight * x * rsqrt(mean(x^2)+eps)?"""
    weight = module.weight
    own = dict(module.named_parameters(recurse=False))
    # Only a weight (no bias, no children) can be a FusedRMSNorm drop-in; meta tensors cannot be probed.
    if set(own) != {"weight"} or list(module.children()) or weight.ndim != 1 or weight.device.type == "meta":
        return False
    try:
        eps = rms_norm_eps(module)
        x = torch.randn(2, weight.shape[0], device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            got = module(x).float()
            xf = x.float()
            want = weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
        return torch.allclose(got, want, rtol=1e-3, atol=1e-3)
    except Exception:
        return False


def _why_not(module: nn.Module, layer_norm: bool, rms_norm: bool) -> str | None:
    """None when ``module`` can be swapped; else the reason it is skipped."""
    cls = type(module)
    name = cls.__name__
    if isinstance(module, nn.LayerNorm):
        if not layer_norm:
            return "LayerNorm swap disabled"
        if cls is not nn.LayerNorm:
            return f"{name} subclasses nn.LayerNorm with its own forward"
        if module.weight is not None and module.bias is None:
            return "bias-free LayerNorm (apex FusedLayerNorm has no bias=False)"
        return None
    if name in UNSUPPORTED_NORMS:
        return UNSUPPORTED_NORMS[name]
    if name in RMS_NORM_CLASSES or (name.endswith("RMSNorm") and _rms_norm_matches(module)):
        return None if rms_norm else "RMSNorm swap disabled"
    return f"{name}: no apex equivalent known"


def rewire(
    model: nn.Module,
    *,
    layer_norm: bool = True,
    rms_norm: bool = True,
    strict_kernels: bool = False,
    autotune: bool = False,
) -> RewireReport:
    """Swap the norms of ``model`` for apex-backed subclasses, in place.

    Args:
        model (`nn.Module`): any model; HF models are handled module by module, whatever the family.
        layer_norm (`bool`, *optional*, defaults to `True`): swap `torch.nn.LayerNorm` for apex FusedLayerNorm.
        rms_norm (`bool`, *optional*, defaults to `True`): swap HF RMSNorms for apex FusedRMSNorm.
        strict_kernels (`bool`, *optional*, defaults to `False`): a swapped module raises instead of falling
            back to the torch op when the apex kernel cannot run.
        autotune (`bool`, *optional*, defaults to `False`): on its first CUDA call per shape, each norm type times
            apex against its stock op and keeps the faster (see `hf_apex.autotune`).

    Returns:
        `RewireReport`: the swapped and skipped modules. Calling ``rewire`` twice is harmless.
    """
    report = RewireReport()
    for path, module in model.named_modules():
        if is_swapped(module):
            module.hf_apex_strict, module.hf_apex_autotune = strict_kernels, autotune
            report.swapped[path] = f"{stock_class(module).__name__} -> {type(module).__name__}"
            continue
        if not (isinstance(module, nn.LayerNorm) or _is_norm_like(module)):
            continue
        reason = _why_not(module, layer_norm, rms_norm)
        if reason is not None:
            report.skipped[path] = reason
            continue
        old = type(module).__name__
        module.__class__ = swapped_class(type(module))
        module.hf_apex_strict, module.hf_apex_autotune = strict_kernels, autotune
        report.swapped[path] = f"{old} -> {type(module).__name__}"
    logger.info("%s", report)
    return report


def unrewire(model: nn.Module) -> int:
    """Restore the stock classes of every module :func:`rewire` swapped; returns how many were restored."""
    restored = 0
    for module in model.modules():
        cls = stock_class(module)
        if cls is not None:
            module.__class__ = cls
            module.__dict__.pop("hf_apex_strict", None)
            module.__dict__.pop("hf_apex_autotune", None)
            restored += 1
    return restored
