"""Numbers behind the stage metrics: FLOPs per token, GPU peaks, percentiles and provenance."""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

METRICS_FILENAME = "hf_apex_metrics.json"

# Dense BF16 tensor-core peaks (TFLOP/s) from the vendors' datasheets; override with --peak_tflops.
# Matched in order against torch.cuda.get_device_name(), so the more specific names come first.
PEAK_TFLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756.0),
    ("H800 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
]


def lookup_peak_tflops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    for key, peak in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def matmul_params(model: nn.Module) -> int:
    """Parameter count N for MFU: every (unique) parameter except position embeddings, and except the input
    embeddings unless they are tied to the output head (a lookup does no matmul; a tied head does)."""
    skip = set()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, nn.Embedding) and ("position" in leaf or leaf in ("wpe", "embed_positions")):
            skip.update(id(p) for p in module.parameters())
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    inputs = get_in() if callable(get_in) else None
    outputs = get_out() if callable(get_out) else None
    if isinstance(inputs, nn.Embedding) and not (outputs is not None and outputs.weight is inputs.weight):
        skip.add(id(inputs.weight))
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def model_shape(model: nn.Module) -> dict:
    """N (matmul parameters), layers L and width d, for 6N + 12*L*d*T FLOPs per token."""
    config = _text_config(model)
    return {
        "n_params": matmul_params(model),
        "n_layers": getattr(config, "num_hidden_layers", None),
        "hidden_size": getattr(config, "hidden_size", None),
    }


def flops_per_token(shape: dict, seq_len: int) -> float | None:
    """Training FLOPs per token (PaLM appendix B): 6N + 12*L*d*T; None when L or d is unknown."""
    if not shape.get("n_layers") or not shape.get("hidden_size"):
        return None
    return 6.0 * shape["n_params"] + 12.0 * shape["n_layers"] * shape["hidden_size"] * seq_len


def percentiles(values: list[float], qs=(50, 20, 80)) -> dict[str, float]:
    if not values:
        return {}
    t = torch.tensor(values, dtype=torch.float64)
    return {f"p{q}": float(torch.quantile(t, q / 100.0)) for q in qs} | {"mean": float(t.mean())}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


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


def apex_build_info() -> dict:
    """Where apex lives and, when `make apex` built it, the commit it was built from."""
    from .import_utils import is_apex_available

    if not is_apex_available():
        return {"installed": False}
    import importlib.util

    spec = importlib.util.find_spec("apex")
    location = str(Path(spec.origin).parent) if spec and spec.origin else None
    info: dict = {"installed": True, "location": location, "version": _version("apex")}
    build_file = Path(location or "") / "_hf_apex_build.json"
    if location and build_file.is_file():
        try:
            info.update(json.loads(build_file.read_text()))
        except (OSError, ValueError):
            pass
    return info


def provenance() -> dict:
    """GPU, versions, apex build, command line and date of this process."""
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "driver": _driver_version() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
        "hf_apex": _version("hf_apex"),
        "apex": apex_build_info(),
        "python": platform.python_version(),
        "host_cpu_count": os.cpu_count(),
    }


def write_metrics_file(output_dir: str | os.PathLike, data: dict) -> Path:
    """Write ``<output_dir>/hf_apex_metrics.json`` atomically (a crash never leaves half a file)."""
    path = Path(output_dir) / METRICS_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def update_metrics_file(output_dir: str | os.PathLike, **sections) -> Path:
    """Merge ``sections`` (e.g. ``eval={...}``) into the run's metrics JSON."""
    path = Path(output_dir) / METRICS_FILENAME
    data = json.loads(path.read_text()) if path.is_file() else {}
    return write_metrics_file(output_dir, {**data, **sections})
