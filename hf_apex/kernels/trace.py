"""Which implementation ran: per-module call tallies, and the profiler's proof that apex kernels executed.

A swapped norm keeps one :class:`KernelRoute` per input kind (device, dtype, autocast, train/eval) and an
optimizer built by hf_apex keeps one: each says which backend runs (``"apex"``; ``"torch"`` when autotune
measured torch's op faster; ``"fallback"`` when apex cannot run, with the reason) and counts the calls that
*returned*. Tallies live on the modules and optimizers themselves, so two models or two trainers in one process
never mix their counts; :func:`collect` sums them for a run. No lock, no global, no dictionary update per call.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable

import torch

logger = logging.getLogger("hf_apex")

APEX, TORCH, FALLBACK = "apex", "torch", "fallback"


class KernelRoute:
    """One decision ("which implementation runs for this kind of input") and how often it ran."""

    __slots__ = ("component", "backend", "reason", "run", "calls")

    def __init__(self, component: str, backend: str, run: Callable | None = None, reason: str | None = None):
        self.component, self.backend, self.run, self.reason, self.calls = component, backend, run, reason, 0

    def __repr__(self) -> str:
        why = f": {self.reason}" if self.reason else ""
        return f"{self.backend}{why}"


def routes(model: torch.nn.Module | None = None, optimizer=None) -> Iterable[KernelRoute]:
    """Every route of the swapped norms in ``model`` and of ``optimizer`` (an accelerate wrapper is looked through)."""
    if model is not None:
        for module in model.modules():
            yield from getattr(module, "hf_apex_routes", {}).values()
            yield from getattr(module, "hf_apex_retired", ())  # routes an autotune trial switched away from
    inner = getattr(optimizer, "optimizer", optimizer)
    route = getattr(inner, "hf_apex_route", None)
    if route is not None:
        yield route


def collect(model: torch.nn.Module | None = None, optimizer=None) -> dict[tuple, int]:
    """Call counts keyed by ``(component, backend, reason)``: a snapshot to subtract from a later one."""
    out: dict[tuple, int] = {}
    for r in routes(model, optimizer):
        key = (r.component, r.backend, r.reason)
        out[key] = out.get(key, 0) + r.calls
    return out


def calls_since(now: dict[tuple, int], before: dict[tuple, int]) -> dict[str, dict]:
    """``{component: {"apex": n, "fallback": n, "torch": n (autotune chose torch), "fallback_reasons": {...}}}``
    for the calls between two :func:`collect` snapshots; components without calls are left out."""
    out: dict[str, dict] = {}
    for (component, backend, reason), n in sorted(now.items(), key=lambda kv: str(kv[0])):
        n -= before.get((component, backend, reason), 0)
        if n <= 0:
            continue
        entry = out.setdefault(component, {APEX: 0, FALLBACK: 0, "fallback_reasons": {}})
        entry[backend] = entry.get(backend, 0) + n
        if backend == FALLBACK:
            entry["fallback_reasons"][reason or "unknown"] = entry["fallback_reasons"].get(reason or "unknown", 0) + n
    return out


# -- profiler proof ------------------------------------------------------------------------------------------
# Kernel-name patterns of apex's extensions (csrc/layer_norm_cuda_kernel.cu, csrc/multi_tensor_adam.cu,
# csrc/multi_tensor_lamb.cu). torch's own kernels live in at::native and are named differently
# (vectorized_layer_norm_kernel, FusedAdamMathFunctor, ...), so they never match. apex's LayerNorm and RMSNorm share
# their backward kernels (RMS is a runtime flag, not a template argument), so those name neither: a Llama's profile
# shows ``rms_norm`` and ``norm_backward``, never ``layer_norm``.
APEX_KERNELS: dict[str, re.Pattern] = {
    "layer_norm": re.compile(r"\bcuApplyLayerNorm\b"),
    "rms_norm": re.compile(r"\bcuApplyRMSNorm\b"),
    "norm_backward": re.compile(r"\bcu(ComputePartGradGammaBeta|ComputeGradGammaBeta|ComputeGradInput)\b"),
    "fused_adam": re.compile(r"(?<![\w:])Adam(Capturable)?(Master)?Functor<"),
    "fused_lamb": re.compile(r"\bLAMBStage[12]Functor<"),
}


# Kernel-name patterns of the SDPA backends (hf_apex.kernels.models.attention): PyTorch's FlashAttention-2 port, its
# memory-efficient (cutlass) kernels and cuDNN's generated SDPA kernels (whose names say "flash_fprop", not
# "flash_fwd"). The math backend runs plain matmuls and a softmax: nothing names it.
SDPA_KERNELS: dict[str, re.Pattern] = {
    "flash": re.compile(r"pytorch_flash::|\bflash_(fwd|bwd)_"),
    "efficient": re.compile(r"fmha_cutlass|PyTorchMemEffAttention"),
    "cudnn": re.compile(r"cudnn\w*sdpa"),
}


def sdpa_backends_seen(names) -> list[str]:
    """The SDPA backends whose kernels are among ``names``."""
    return sorted({backend for name in names for backend, pattern in SDPA_KERNELS.items() if pattern.search(name)})


def classify_kernels(names) -> dict[str, list[str]]:
    """Map component -> sorted apex kernel names found among ``names``."""
    found: dict[str, set[str]] = {}
    for name in names:
        for component, pattern in APEX_KERNELS.items():
            if pattern.search(name):
                found.setdefault(component, set()).add(name if len(name) <= 120 else name[:117] + "...")
    return {k: sorted(v) for k, v in found.items()}


# Seen on torch 2.11 (H200): a CUDA profile comes back empty where profiles that detach CUPTI and profiles that do not
# are mixed in one process: the first detaching profile after a plain CUDA profile, and CUDA profiles after a
# CPU-only profile that followed a detaching one.
EMPTY_PROFILE = (
    "hf_apex: the kernel profile recorded no CUDA kernel, so a kernel proof from it reads 'unverified'. On torch 2.11 "
    "this was seen where this process also ran torch.profiler sessions of its own (a plain CUDA profile before "
    "hf_apex's, or a CPU-only one after it): hf_apex's profiles detach CUPTI when they end (to keep later launches "
    "fast), and mixing the two kinds loses profiles. Exporting TEARDOWN_CUPTI=0 before the process's first profile "
    "kept every proof there; CUPTI then stays attached, which slows later kernel launches."
)


class KernelProfile:
    """Profile a region's CUDA kernels (see ``stop``); ``close`` once profiling is over (see ``start``)."""

    def __init__(self) -> None:
        self._prof = None
        self._set_teardown = False
        self.running = False
        self.kernel_names: list[str] = []  # the CUDA kernels of the last profile (stop)

    def start(self) -> KernelProfile:
        from torch.profiler import ProfilerActivity, profile

        # Detach CUPTI when the profile ends: left attached, it adds host time to every later kernel launch, and
        # a host-bound training step stays 10-20 % slower after one profiled step (pytorch/pytorch#144455).
        # Kineto reads TEARDOWN_CUPTI as the profile starts and stops, and again when the detach completes, at the
        # next CUDA call: unset by then, it attaches CUPTI again. So it stays set until ``close`` (a value of
        # yours is kept). Left in the environment for good it reaches every later child process: on an H200
        # (torch 2.11) a child that profiled after a Trainer run had set it hung, and passed without it.
        if "TEARDOWN_CUPTI" not in os.environ:
            os.environ["TEARDOWN_CUPTI"] = "1"
            self._set_teardown = True
        try:
            self._prof = profile(activities=[ProfilerActivity.CUDA])
            self._prof.__enter__()
        except BaseException:
            self.close()
            raise
        self.running = True
        return self

    def close(self) -> None:
        """Take back the TEARDOWN_CUPTI that ``start`` set (not one of yours, nor a value torch wrote since)."""
        if self._set_teardown and os.environ.get("TEARDOWN_CUPTI") == "1":
            del os.environ["TEARDOWN_CUPTI"]
        self._set_teardown = False

    def stop(self) -> dict:
        """{"apex": {component: [kernels]}, "sdpa": [SDPA backends whose kernels ran], "cuda_kernels": n}."""
        torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        self.running = False
        names = self.kernel_names = [
            e.name for e in self._prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
        ]
        if not names and torch.cuda.is_available():
            logger.warning(EMPTY_PROFILE)
        return {"apex": classify_kernels(names), "sdpa": sdpa_backends_seen(names), "cuda_kernels": len(names)}
