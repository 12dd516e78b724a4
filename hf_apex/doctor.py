"""``hf-apex doctor``: which apex kernels are really available here, and proof that they execute."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from .import_utils import (
    APEX_BUILD_HINT,
    apex_extension_error,
    is_apex_available,
    is_fused_adam_available,
    is_fused_norm_available,
)
from .metrics import _version, apex_build_info

EXTENSIONS = ("amp_C", "fused_layer_norm_cuda")


def nvcc_version() -> str | None:
    candidates = []
    try:
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME:
            candidates.append(str(Path(CUDA_HOME) / "bin" / "nvcc"))
    except Exception:
        pass
    candidates.append(shutil.which("nvcc") or "")
    for nvcc in filter(None, candidates):
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        except OSError:
            continue
        match = re.search(r"release (\d+\.\d+)", out)
        if match:
            return match.group(1)
    return None


def _backends(cuda: bool) -> dict[str, dict]:
    def row(available: bool, what: str, missing: str) -> dict:
        if not available:
            return {"backend": "fallback", "why": missing}
        if not cuda:
            return {"backend": "fallback", "why": "no CUDA device: apex kernels need CUDA tensors"}
        return {"backend": "apex", "why": what}

    adam = is_fused_adam_available()
    norms = is_fused_norm_available()
    no_amp = apex_extension_error("amp_C") or "apex not installed"
    no_ln = apex_extension_error("fused_layer_norm_cuda") or "apex not installed"
    return {
        "fused_adam": row(adam, "apex FusedAdam (amp_C multi_tensor_adam)", f"torch-op FusedAdamFallback: {no_amp}"),
        "fused_lamb": row(adam, "apex FusedLAMB (amp_C multi_tensor_lamb)", f"unavailable (no fallback): {no_amp}"),
        "layer_norm": row(norms, "apex fused_layer_norm_cuda", f"torch F.layer_norm: {no_ln}"),
        "rms_norm": row(norms, "apex fused_layer_norm_cuda (RMS)", f"stock HF RMSNorm forward: {no_ln}"),
    }


def runtime_proof() -> dict:
    """Run one fused LayerNorm and RMSNorm forward+backward and one FusedAdam step under torch.profiler.

    Goes through hf_apex's own swapped modules and optimizer class, so it proves the path training takes.
    Returns {"kernels": {component: [apex kernel names]}, "max_abs_diff": {component: vs torch}}.
    """
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from .optim import _apex_classes
    from .profiling import KernelProfile
    from .surgery import rewire

    torch.manual_seed(0)
    hidden = 1024
    model = torch.nn.ModuleDict({"ln": torch.nn.LayerNorm(hidden), "rms": LlamaRMSNorm(hidden)}).cuda()
    reference = {k: type(m) for k, m in model.items()}
    x = torch.randn(4096, hidden, device="cuda", requires_grad=True)
    with torch.no_grad():
        want = {k: reference[k].forward(m, x) for k, m in model.items()}
    rewire(model, strict_kernels=True)
    optimizer = _apex_classes()["fused_adam"](model.parameters(), lr=1e-3)
    profile = KernelProfile().start()
    outs = {k: m(x) for k, m in model.items()}
    sum(o.float().pow(2).mean() for o in outs.values()).backward()
    optimizer.step()
    result = profile.stop()
    diffs = {k: float((outs[k].detach() - want[k]).abs().max()) for k in outs}
    return {"kernels": result["apex"], "cuda_kernels": result["cuda_kernels"], "max_abs_diff_vs_torch": diffs}


def collect(proof: bool = True) -> dict:
    cuda = torch.cuda.is_available()
    report: dict = {
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "capability": "sm_{}{}".format(*torch.cuda.get_device_capability()) if cuda else None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvcc": nvcc_version(),
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
        "hf_apex": _version("hf_apex"),
        "apex": apex_build_info(),
        "extensions": {name: apex_extension_error(name) or "ok" for name in EXTENSIONS} if is_apex_available() else {},
        "backends": _backends(cuda),
    }
    problems = [f"{c}: {b['why']}" for c, b in report["backends"].items() if b["backend"] != "apex"]
    if proof and cuda and is_fused_adam_available() and is_fused_norm_available():
        try:
            report["runtime_proof"] = runtime_proof()
            expected = {"layer_norm", "rms_norm", "fused_adam"}
            missing = expected - set(report["runtime_proof"]["kernels"])
            problems += [f"{c}: no apex kernel executed under the profiler" for c in sorted(missing)]
        except Exception as exc:  # report, don't crash: the doctor is for broken setups
            report["runtime_proof"] = {"error": f"{type(exc).__name__}: {exc}"}
            problems.append(f"runtime proof failed: {exc}")
    elif proof:
        report["runtime_proof"] = {"skipped": "needs CUDA and both apex extensions"}
    report["problems"] = problems
    report["ok"] = not problems
    return report


def format_report(report: dict) -> str:
    apex = report["apex"]
    lines = [
        "hf-apex doctor",
        f"  GPU            {report['gpu'] or 'none (CPU only)'}"
        + (f" ({report['capability']})" if report["capability"] else ""),
        f"  torch          {report['torch']} (CUDA {report['torch_cuda']}), nvcc {report['nvcc']}",
        f"  transformers   {report['transformers']}, accelerate {report['accelerate']}, hf_apex {report['hf_apex']}",
        "  apex           "
        + (
            f"{apex.get('location')} (commit {apex.get('commit', 'unknown')})"
            if apex.get("installed")
            else "not installed"
        ),
    ]
    for name, status in report["extensions"].items():
        lines.append(f"    {name:<24}{status}")
    lines.append("  backends")
    for component, b in report["backends"].items():
        lines.append(f"    {component:<12}{b['backend']:<10}{b['why']}")
    proof = report.get("runtime_proof")
    if proof is not None:
        lines.append("  runtime proof (torch.profiler, one norm fwd+bwd and one FusedAdam step)")
        if "kernels" in proof:
            for component, names in proof["kernels"].items():
                for name in names:
                    lines.append(f"    {component:<12}{name}")
            diffs = ", ".join(f"{k} {v:.2e}" for k, v in proof["max_abs_diff_vs_torch"].items())
            lines.append(f"    max |apex - torch| forward: {diffs}")
        else:
            lines.append(f"    {proof}")
    if report["ok"]:
        lines.append("  OK: apex kernels are available and ran.")
    else:
        lines.append("  NOT OK:")
        lines += [f"    - {p}" for p in report["problems"]]
        if not apex.get("installed") or any(v != "ok" for v in report["extensions"].values()):
            lines.append(f"  {APEX_BUILD_HINT}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="hf-apex doctor", description="Which apex kernels are really available.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a kernel is missing or did not run")
    parser.add_argument("--no-proof", action="store_true", help="skip the runtime profiler proof")
    args = parser.parse_args(argv)
    report = collect(proof=not args.no_proof)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if args.strict and not report["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
