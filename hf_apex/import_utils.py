"""Optional-dependency checks, all in one place.

NVIDIA Apex is detected by its *compiled extensions*, never by the package name: a Python-only apex build
imports fine but has no kernels, and the PyPI package called ``apex`` is an unrelated project. Nothing here
imports apex at module import time, and ``apex.amp`` (removed upstream) is never touched.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

APEX_BUILD_HINT = (
    "Build NVIDIA Apex from source with its C++/CUDA extensions: `make apex` in the hf_apex checkout, or "
    "`APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install -v --no-build-isolation .` inside an apex checkout "
    "(https://github.com/NVIDIA/apex). The PyPI package named `apex` is unrelated."
)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache
def is_apex_available() -> bool:
    """NVIDIA Apex's Python package is importable (says nothing about kernels)."""
    if not _has_module("apex"):
        return False
    try:
        # NVIDIA apex ships `apex.optimizers`; the unrelated PyPI `apex` does not.
        return _has_module("apex.optimizers")
    except Exception:
        return False


@functools.lru_cache
def apex_extension_error(name: str) -> str | None:
    """Import one compiled apex extension; return None when it loads, else the reason it does not."""
    if not _has_module(name):
        return f"extension `{name}` is not installed"
    try:
        importlib.import_module(name)
    except Exception as exc:  # a broken .so raises OSError/ImportError with a useful message
        return f"extension `{name}` failed to load: {exc}"
    return None


@functools.lru_cache
def is_fused_adam_available() -> bool:
    """apex FusedAdam/FusedLAMB can run: `amp_C` loads and apex's multi-tensor applier is live."""
    if not is_apex_available() or apex_extension_error("amp_C") is not None:
        return False
    try:
        from apex.multi_tensor_apply import multi_tensor_applier
    except Exception:
        return False
    return bool(getattr(multi_tensor_applier, "available", False))


@functools.lru_cache
def is_fused_norm_available() -> bool:
    """apex FusedLayerNorm/FusedRMSNorm kernels can run: `fused_layer_norm_cuda` loads."""
    if not is_apex_available() or apex_extension_error("fused_layer_norm_cuda") is not None:
        return False
    try:
        importlib.import_module("apex.normalization.fused_layer_norm")
    except Exception:
        return False
    return True


def clear_caches() -> None:
    """Forget cached answers (tests, or after building apex in the same process)."""
    for fn in (is_apex_available, apex_extension_error, is_fused_adam_available, is_fused_norm_available):
        fn.cache_clear()
