"""What is installed here, and why an apex kernel cannot run: the one place that answers both.

NVIDIA Apex is detected by its *compiled extensions*, never by the package name: a Python-only apex build
imports fine but has no kernels, and the PyPI package called ``apex`` is an unrelated project. Nothing here
imports apex at module import time, and ``apex.amp`` (removed upstream) is never touched.

:func:`blocker` is what every other module asks ("can apex's kernel for this component run on this device, and
if not, why"); :func:`environment` describes the machine for provenance, the autotune cache and the doctor.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from ...internals import cpu_has_bf16_instructions

APEX_BUILD_HINT = (
    "Build NVIDIA Apex from source with its C++/CUDA extensions: `make apex` in the hf_apex checkout, or "
    "`APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install -v --no-build-isolation .` inside an apex checkout "
    "(https://github.com/NVIDIA/apex). The PyPI package named `apex` is unrelated."
)
NO_GPU_HINT = "apex's kernels run on NVIDIA GPUs only: run on a CUDA machine, or leave the apex switches off."

# component -> the compiled extension its kernels live in
EXTENSIONS = {
    "fused_adam": "amp_C",
    "fused_lamb": "amp_C",
    "layer_norm": "fused_layer_norm_cuda",
    "rms_norm": "fused_layer_norm_cuda",
}
EXTENSION_NAMES = sorted(set(EXTENSIONS.values()))  # the compiled extensions hf_apex loads
BUILD_RECORD = "_hf_apex_build.json"  # written next to the installed apex package by `make apex`
NO_GPU = "no CUDA GPU is visible"  # the blockers that a GPU removes
CPU_TENSORS = "tensors (apex kernels need CUDA tensors)"


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache
def is_apex_available() -> bool:
    """NVIDIA Apex's Python package is importable (says nothing about kernels)."""
    # NVIDIA apex ships `apex.optimizers`; the unrelated PyPI `apex` does not.
    return _has_module("apex") and _has_module("apex.optimizers")


@functools.lru_cache
def extension_error(name: str) -> str | None:
    """Import one compiled apex extension; None when it loads, else why it does not."""
    if not _has_module(name):
        return f"apex extension `{name}` is not installed"
    try:
        importlib.import_module(name)
    except Exception as exc:  # a broken .so raises OSError/ImportError with a useful message
        return f"apex extension `{name}` failed to load: {exc}"
    return None


@functools.lru_cache
def install_error(component: str) -> str | None:
    """Why apex's ``component`` is not usable on this machine whatever the device; None when it is."""
    if component not in EXTENSIONS:
        raise ValueError(f"unknown apex component {component!r}; choose one of {sorted(EXTENSIONS)}")
    if not is_apex_available():
        return "NVIDIA apex is not installed"
    error = extension_error(EXTENSIONS[component])
    if error is not None:
        return error
    try:
        if EXTENSIONS[component] == "amp_C":
            from apex.multi_tensor_apply import multi_tensor_applier

            if not getattr(multi_tensor_applier, "available", False):
                return "apex's multi_tensor_applier is unavailable (a Python-only build)"
        else:
            importlib.import_module("apex.normalization.fused_layer_norm")
    except Exception as exc:
        return f"apex's Python side failed to import: {exc}"
    return None


def blocker(component: str, device: torch.device | str | None = None) -> str | None:
    """Why apex's kernel for ``component`` cannot run for tensors on ``device``; None when it can.

    ``device=None`` asks about this machine (is there a GPU at all). The GPU is checked first: on a machine
    without one, that, not the missing build, is what stops apex.
    """
    if device is None:
        if not torch.cuda.is_available():
            return NO_GPU
    elif torch.device(device).type != "cuda":
        return f"{torch.device(device).type} {CPU_TENSORS}"
    return install_error(component)


def fix_for(reason: str) -> str:
    """The action that removes a :func:`blocker` reason ("" for reasons about the input, which have none)."""
    if NO_GPU in reason or CPU_TENSORS in reason:
        return NO_GPU_HINT
    install = ("NVIDIA apex is not installed", "apex extension", "multi_tensor_applier", "Python side", "apex kernel")
    return APEX_BUILD_HINT if any(marker in reason for marker in install) else ""


def is_fused_adam_available() -> bool:
    """apex FusedAdam/FusedLAMB are built and importable (a GPU is still needed to run them)."""
    return install_error("fused_adam") is None


def is_fused_norm_available() -> bool:
    """apex FusedLayerNorm/FusedRMSNorm kernels are built and importable."""
    return install_error("layer_norm") is None


@functools.lru_cache
def has_triton_ops() -> bool:
    """hf_apex's own Triton kernels can run: Triton compiles for this machine's GPU and torch registers Triton
    kernels as ops (`torch.library.triton_op`, torch >= 2.6)."""
    from ...internals import has_triton

    return torch.cuda.is_available() and hasattr(torch.library, "triton_op") and has_triton()


def has_mm_out_dtype() -> bool:
    """torch has matmuls of BF16/FP16 operands that write FP32 (``torch.mm(a, b, out_dtype=torch.float32)``, the
    ``aten::mm.dtype`` overload, torch >= 2.8; CUDA tensors only)."""
    return "dtype" in torch.ops.aten.mm.overloads()


def clear_caches() -> None:
    """Forget cached answers (tests, or after building apex in the same process)."""
    for fn in (is_apex_available, extension_error, install_error, has_triton_ops):
        fn.cache_clear()


# -- what this machine runs ----------------------------------------------------------------------------------
def package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def portable_path(path: str | os.PathLike) -> str:
    """``path`` without this machine's layout: relative to the working directory (the repository when run from
    it), else under ``<prefix>`` (the Python environment) or ``~``, else only its last two parts."""
    p = Path(path).resolve()
    for root, label in ((Path.cwd(), ""), (Path(sys.prefix), "<prefix>/"), (Path.home(), "~/")):
        try:
            rel = p.relative_to(root.resolve())
        except ValueError:
            continue
        return f"{label}{rel.as_posix()}" if str(rel) != "." else (label.rstrip("/") or ".")
    return "…/" + "/".join(p.parts[-2:])


def apex_build() -> dict:
    """Where apex is installed and, when ``make apex`` built it, the build record: the commit (verified or
    ``"unknown"``), how it was verified, arch list, versions."""
    if not is_apex_available():
        return {"installed": False}
    spec = importlib.util.find_spec("apex")
    location = Path(spec.origin).parent if spec and spec.origin else None
    info: dict = {"installed": True, "location": portable_path(location) if location else None}
    info["version"] = package_version("apex")
    record = location / BUILD_RECORD if location else None
    if record is not None and record.is_file():
        try:
            info.update(json.loads(record.read_text()))
        except (OSError, ValueError):
            info["build_record"] = f"unreadable {BUILD_RECORD}"
    info.setdefault("commit", "unknown")
    return info


@functools.lru_cache
def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except Exception:
        return None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes BF16 in hardware (x86's AVX512-BF16 or AMX): elsewhere BF16 autocast on the CPU is
    converted to and from FP32 around each op, often far slower than FP32 itself."""
    return cpu_has_bf16_instructions()


def environment() -> dict:
    """The GPU and the software that runs the kernels: for provenance, the doctor and the autotune cache key."""
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpu_capability": "sm_{}{}".format(*torch.cuda.get_device_capability()) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "driver": _driver_version() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": package_version("transformers"),
        "accelerate": package_version("accelerate"),
        "hf_apex": package_version("hf_apex"),
        "apex": apex_build(),
        "python": platform.python_version(),
        "host_cpu_count": os.cpu_count(),
    }
