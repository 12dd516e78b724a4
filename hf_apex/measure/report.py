"""The run summary written to ``<output_dir>/hf_apex_metrics.json``, its provenance, and the file itself."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from ..kernels.apex.availability import environment, portable_path
from .flops import MFU_FORMULA, flops_per_token
from .steps import StepRecord

METRICS_FILENAME = "hf_apex_metrics.json"
GIB = 2**30


def percentiles(values: list[float], qs=(50, 20, 80)) -> dict[str, float]:
    if not values:
        return {}
    t = torch.tensor(values, dtype=torch.float64)
    return {f"p{q}": float(torch.quantile(t, q / 100.0)) for q in qs} | {"mean": float(t.mean())}


def _portable_arg(arg: str) -> str:
    flag, eq, value = arg.rpartition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
    return f"{flag}{eq}{portable_path(value)}" if value.startswith("/") else arg


def command_line() -> str:
    """This process's command line, with paths made repository-relative (no machine layout in the record)."""
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *map(_portable_arg, sys.argv)])


def provenance() -> dict:
    """Date, command line, GPU, versions and the apex build of this process."""
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"date": when, "command": command_line(), **environment()}


def rates(records: list[StepRecord], shape: dict, peak_tflops: float | None, world: int) -> dict:
    """Tokens/s and samples/s over ``records``, the share of padding, and MFU when the FLOPs and the peak are known.
    tokens/s counts real tokens only; ``mfu`` counts the positions the GPUs computed, padding included, each step at
    its own sequence length, and ``mfu_real_tokens`` the real tokens alone (the useful share of the same work)."""
    secs = sum(r.ms for r in records) / 1e3
    tokens, positions = sum(r.tokens for r in records), sum(r.positions for r in records)
    out = {
        "tokens_per_s": tokens / secs if secs else None,
        "samples_per_s": sum(r.samples for r in records) / secs if secs else None,
        "padding_share": 1 - tokens / positions if positions else None,
        "mfu": None,
        "mfu_real_tokens": None,
    }
    flops = [flops_per_token(shape, r.seq_len) if shape else None for r in records]
    if peak_tflops and secs and flops and all(f is not None for f in flops):
        total = sum(f * (r.positions or r.tokens) for f, r in zip(flops, records))
        useful = sum(f * r.tokens for f, r in zip(flops, records))
        out["mfu"] = total / secs / (peak_tflops * 1e12 * world)
        out["mfu_real_tokens"] = useful / secs / (peak_tflops * 1e12 * world)
    return out


def process_age_s() -> float | None:
    """Seconds since this process started (a forked process: since the fork), on Linux; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: ticks after boot
        # (the kernel's clock since boot, not /proc/uptime, which a container may report from its own start)
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return round(age, 2) if age >= 0 else None


def compile_mode(args) -> str | None:
    """The ``torch.compile`` mode a run compiles with: None when it does not compile or takes torch's default."""
    return getattr(args, "torch_compile_mode", None) if getattr(args, "torch_compile", False) else None


def fp32_matmul_precision() -> str:
    """torch's FP32 matmul precision: the legacy name ("highest", "high"), or, where the process has also set it
    through the per-backend API (the legacy getter then raises), that API's ("ieee", "tf32") for CUDA's matmuls."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return torch.backends.cuda.matmul.fp32_precision


def run_summary(
    *,
    stage: str | None,
    args,
    state,
    records: list[StepRecord],
    timed: list[StepRecord],
    shape: dict,
    peak_tflops: float | None,
    peak_memory: list[float] | None,
    calls: dict,
    profiled: dict | None,
    optimizer: str | None,
    started: float | None,
    sections: dict,
    startup_s: float | None = None,
    before_first_step_s: float | None = None,
) -> dict:
    """The run summary: timing after warm-up, throughput, MFU, memory, losses, kernels, provenance."""
    world = max(getattr(args, "world_size", 1), 1)
    losses = [{"step": h["step"], "loss": h["loss"]} for h in state.log_history if "loss" in h]
    model = sections.pop("model", {})
    kernels = sections.pop("kernels", {})
    return {
        "stage": stage,
        "model": {**model, **shape},
        "run": {
            # the batch that ran (auto_find_batch_size may have lowered the requested one)
            "per_device_train_batch_size": getattr(state, "train_batch_size", None)
            or args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "world_size": world,
            "seq_len": max((r.seq_len for r in records), default=None),
            "steps": len(records),
            "timed_steps": len(timed),
            "warmup_steps": len(records) - len(timed),
            "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
            "tf32": args.tf32,
            "fp32_matmul_precision": fp32_matmul_precision(),  # what ran, whatever was asked
            "optimizer": optimizer,
            "torch_compile": bool(getattr(args, "torch_compile", False)),
            "torch_compile_mode": compile_mode(args),
            "torch_compile_backend": getattr(args, "torch_compile_backend", None)
            if getattr(args, "torch_compile", False)
            else None,
            # The first step carries one-off costs: torch.compile, autotune, cuBLAS/allocator warm-up.
            "first_step_ms": records[0].ms if records else None,
            # From the start of training to the end of step 10 (of the last step, if fewer; to_step_10_of says which):
            # the host's time to the first step's start, then the steps' own times (CUDA events on a GPU: the first
            # holds compilation, autotune and CUDA graph recording). What a run's warm-up costs a user.
            "to_step_10_s": before_first_step_s + sum(r.ms for r in records[:10]) / 1e3
            if records and before_first_step_s is not None
            else None,
            "to_step_10_of": min(len(records), 10),
            "seed": args.seed,
            "wall_time_s": time.time() - started if started else None,
            # from the process's start to train(): imports, data, model, CUDA set-up (None where it is not known)
            "startup_s": startup_s,
        },
        "step_time_ms": percentiles([r.ms for r in timed]),
        **rates(timed, shape, peak_tflops, world),
        "peak_tflops": peak_tflops,
        "mfu_formula": MFU_FORMULA,
        "peak_memory_allocated_gib": peak_memory[0] / GIB if peak_memory else None,
        "peak_memory_reserved_gib": peak_memory[1] / GIB if peak_memory else None,
        "skipped_steps": sum(r.skipped for r in records),
        "loss": {"first": losses[0]["loss"] if losses else None, "last": losses[-1]["loss"] if losses else None},
        "loss_history": losses,
        "kernels": {"calls": calls, "profiled": profiled, **kernels},
        **sections,
        "steps_ms": [round(r.ms, 4) for r in records],
        "provenance": provenance(),
    }


def summary_lines(data: dict) -> list[str]:
    """What a run bought, in two lines for the console, from its :func:`run_summary`: timing after warm-up,
    throughput, MFU, peak memory, and per component the calls that reached apex and those that fell back (with why),
    or where the norms ran inside compiled graphs, then the apex kernels the profiler saw run."""
    run, t = data["run"], data["step_time_ms"]
    if t:
        timing = f"{t['p50']:,.1f} ms/step p50 (p20-p80 {t['p20']:,.1f}-{t['p80']:,.1f})"
    else:
        timing = "no step timed"
    mfu = f"{data['mfu']:.1%} MFU" if data.get("mfu") else "MFU n/a (no known GPU peak)"
    memory = data.get("peak_memory_allocated_gib")
    figures = [
        timing,
        f"{data['tokens_per_s']:,.0f} tokens/s" if data.get("tokens_per_s") else None,
        mfu,
        f"peak {memory:.2f} GiB" if memory is not None else "peak memory n/a (no CUDA)",
    ]
    head = (
        f"hf_apex: stage {data['stage'] or '(none)'}, {run['timed_steps']} timed steps after {run['warmup_steps']} "
        f"warm-up ({run['precision']}): " + ", ".join(f for f in figures if f)
    )
    calls = []
    for component, c in data["kernels"]["calls"].items():
        part = f"{component} {c['apex']} apex / {c['fallback']} fallback"
        if "torch" in c:
            part += f" / {c['torch']} torch (autotune)"
        reasons = "; ".join(c.get("fallback_reasons") or {})
        calls.append(part + (f" ({reasons})" if reasons else ""))
    in_graphs = data["kernels"].get("norms_under_torch_compile")
    if in_graphs and not any(component.endswith("norm") for component in data["kernels"]["calls"]):
        calls.append(f"norms: {in_graphs}, not counted per call")  # a replayed graph runs no Python
    profiled = data["kernels"].get("profiled") or {}
    ran = ", ".join(profiled.get("apex") or {}) or "none"
    seen = f"; apex kernels seen running: {ran}" if profiled else ""
    return [head, "hf_apex: calls: " + ("; ".join(calls) or "no apex component in this run") + seen]


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
