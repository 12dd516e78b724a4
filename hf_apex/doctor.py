"""``hf-apex doctor``: which apex kernels are really available here, and proof that they execute."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from .kernels.apex.availability import (
    EXTENSION_NAMES,
    NO_GPU,
    blocker,
    environment,
    extension_error,
    fix_for,
    is_apex_available,
)
from .kernels.apex.norms import load_graph_ops
from .kernels.models import attention


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


BACKENDS = {
    "fused_adam": ("apex FusedAdam (amp_C multi_tensor_adam)", "torch-op FusedAdamFallback"),
    "fused_lamb": ("apex FusedLAMB (amp_C multi_tensor_lamb)", "unavailable (no fallback)"),
    "layer_norm": ("apex fused_layer_norm_cuda", "torch F.layer_norm"),
    "rms_norm": ("apex fused_layer_norm_cuda (RMS)", "stock HF RMSNorm forward"),
}
# the norms inside the cudagraphs backend's CUDA graphs (auto's): apex's torch.library ops, which need its Python side
GRAPH_NORMS = ("apex.normalization's torch.library ops (auto's CUDA graphs)", "the stock op inside the graphs")


def _backends() -> dict[str, dict]:
    """Which backend each component will use on this machine, and why."""
    out = {}
    for component, (apex, fallback) in BACKENDS.items():
        reason = blocker(component)
        out[component] = (
            {"backend": "apex", "why": apex}
            if reason is None
            else {"backend": "fallback", "why": f"{fallback}: {reason}"}
        )
    reason = blocker("layer_norm") or load_graph_ops()
    apex, fallback = GRAPH_NORMS
    out["graph_norms"] = (
        {"backend": "apex", "why": apex} if reason is None else {"backend": "fallback", "why": f"{fallback}: {reason}"}
    )
    return out


def runtime_proof() -> dict:
    """Run one fused LayerNorm and RMSNorm forward+backward and one FusedAdam step under torch.profiler.

    Goes through hf_apex's own swapped modules and optimizer class, so it proves the path training takes.
    Returns {"kernels": {component: [apex kernel names]}, "max_abs_diff": {component: vs torch}}.
    """
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from .kernels.apex.optim import apex_optimizer_class
    from .kernels.models.surgery import rewire
    from .kernels.trace import KernelProfile

    torch.manual_seed(0)
    hidden = 1024
    model = torch.nn.ModuleDict({"ln": torch.nn.LayerNorm(hidden), "rms": LlamaRMSNorm(hidden)}).cuda()
    reference = {k: type(m) for k, m in model.items()}
    x = torch.randn(4096, hidden, device="cuda", requires_grad=True)
    with torch.no_grad():
        want = {k: reference[k].forward(m, x) for k, m in model.items()}
    rewire(model, strict_kernels=True)
    optimizer = apex_optimizer_class("fused_adam")(model.parameters(), lr=1e-3)
    profile = KernelProfile().start()
    outs = {k: m(x) for k, m in model.items()}
    sum(o.float().pow(2).mean() for o in outs.values()).backward()
    optimizer.step()
    result = profile.stop()
    profile.close()
    diffs = {k: float((outs[k].detach() - want[k]).abs().max()) for k in outs}
    return {"kernels": result["apex"], "cuda_kernels": result["cuda_kernels"], "max_abs_diff_vs_torch": diffs}


def collect(proof: bool = True) -> dict:
    env = environment()
    report: dict = {
        **env,
        "nvcc": nvcc_version(),
        "extensions": {name: extension_error(name) or "ok" for name in EXTENSION_NAMES} if is_apex_available() else {},
        "backends": _backends(),
    }
    if proof:  # informational: what --attention_backend can put first here (not an apex problem either way)
        try:
            report["attention_backends"] = attention.runnable("cuda" if torch.cuda.is_available() else "cpu")
        except Exception as exc:  # report, don't crash: the doctor is for broken setups
            report["attention_backends"] = {"error": f"{type(exc).__name__}: {exc}"}
    problems = [f"{c}: {b['why']}" for c, b in report["backends"].items() if b["backend"] != "apex"]
    if proof and all(report["backends"][c]["backend"] == "apex" for c in BACKENDS):  # (the kernels to prove)
        try:
            report["runtime_proof"] = runtime_proof()
            missing = {"layer_norm", "rms_norm", "fused_adam"} - set(report["runtime_proof"]["kernels"])
            problems += [f"{c}: no apex kernel executed under the profiler" for c in sorted(missing)]
        except Exception as exc:  # report, don't crash: the doctor is for broken setups
            report["runtime_proof"] = {"error": f"{type(exc).__name__}: {exc}"}
            problems.append(f"runtime proof failed: {exc}")
    elif proof:
        report["runtime_proof"] = {"skipped": "needs a CUDA GPU and both apex extensions"}
    report["problems"] = problems
    report["ok"] = not problems
    return report


def format_report(report: dict) -> str:
    apex = report["apex"]
    gpu = report["gpu"]
    lines = [
        "hf-apex doctor",
        f"  GPU            {gpu} ({report['gpu_capability']})"
        if gpu
        else "  GPU            none: no CUDA GPU is visible, so no apex kernel can run here",
        f"  torch          {report['torch']} (CUDA {report['cuda']}), nvcc {report['nvcc']}",
        f"  transformers   {report['transformers']}, accelerate {report['accelerate']}, hf_apex {report['hf_apex']}",
    ]
    if apex.get("installed"):
        source = apex.get("commit_source") or "no build record: not built by `make apex`"
        lines.append(f"  apex           {apex.get('location')} (commit {apex['commit']}; {source})")
    else:
        lines.append("  apex           not installed")
    for name, status in report["extensions"].items():
        lines.append(f"    {name:<24}{status}")
    lines.append("  backends")
    for component, b in report["backends"].items():
        lines.append(f"    {component:<12}{b['backend']:<10}{b['why']}")
    if "attention_backends" in report:
        lines.append("  SDPA backends (--attention_backend; a causal forward + backward ran, or why not)")
        for name, status in report["attention_backends"].items():
            lines.append(f"    {name:<12}{status}")
    proof = report.get("runtime_proof")
    if proof is not None:
        lines.append("  runtime proof (torch.profiler, one norm fwd+bwd and one FusedAdam step)")
        if "kernels" in proof:
            width = max(map(len, proof["kernels"]), default=0) + 2  # "norm_backward" is longer than the others
            for component, names in proof["kernels"].items():
                for name in names:
                    lines.append(f"    {component:<{width}}{name}")
            diffs = ", ".join(f"{k} {v:.2e}" for k, v in proof["max_abs_diff_vs_torch"].items())
            lines.append(f"    max |apex - torch| forward: {diffs}")
        else:  # {"skipped": why} or {"error": what}
            lines += [f"    {key}: {value}" for key, value in proof.items()]
    if report["ok"]:
        lines.append("  OK: apex kernels are available and ran.")
    else:
        lines.append("  NOT OK:")
        lines += [f"    - {p}" for p in report["problems"]]
        lines += [f"  {hint}" for hint in dict.fromkeys(fix_for(p) for p in report["problems"])]
        if any(NO_GPU in p for p in report["problems"]):
            lines.append(
                "  Or keep them on: without a GPU they train on the labelled torch fallbacks above (FusedLAMB has "
                "none), and an FP32 stage such as fused_adam_ln is the quick one on a CPU."
            )
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
