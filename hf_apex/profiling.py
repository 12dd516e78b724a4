"""Proof that apex kernels executed: CUDA kernel names seen by ``torch.profiler``, sorted by component."""

from __future__ import annotations

import re

import torch

# Kernel-name patterns of apex's extensions (csrc/layer_norm_cuda_kernel.cu, csrc/multi_tensor_adam.cu,
# csrc/multi_tensor_lamb.cu). torch's own kernels live in at::native and are named differently
# (vectorized_layer_norm_kernel, FusedAdamMathFunctor, ...), so they never match.
APEX_KERNELS: dict[str, re.Pattern] = {
    "layer_norm": re.compile(r"\bcu(ApplyLayerNorm|ComputePartGradGammaBeta|ComputeGradGammaBeta|ComputeGradInput)\b"),
    "rms_norm": re.compile(r"\bcuApplyRMSNorm\b"),
    "fused_adam": re.compile(r"(?<![\w:])Adam(Capturable)?(Master)?Functor<"),
    "fused_lamb": re.compile(r"\bLAMBStage[12]Functor<"),
}


def classify_kernels(names) -> dict[str, list[str]]:
    """Map component -> sorted apex kernel names found among ``names``."""
    found: dict[str, set[str]] = {}
    for name in names:
        for component, pattern in APEX_KERNELS.items():
            if pattern.search(name):
                found.setdefault(component, set()).add(_short(name))
    return {k: sorted(v) for k, v in found.items()}


def _short(name: str, limit: int = 120) -> str:
    return name if len(name) <= limit else name[: limit - 3] + "..."


class KernelProfile:
    """Profile a region; ``stop()`` returns {"apex": {component: [kernels]}, "cuda_kernels": n}."""

    def __init__(self) -> None:
        self._prof = None
        self.running = False

    def start(self) -> KernelProfile:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CUDA])
        self._prof.__enter__()
        self.running = True
        return self

    def stop(self) -> dict:
        torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        self.running = False
        names = [e.name for e in self._prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return {"apex": classify_kernels(names), "cuda_kernels": len(names)}
