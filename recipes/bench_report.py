"""Benchmark rows, the stage table, CSV/JSON output and the chart: what `make bench` (recipes/bench.py) prints
and saves. A script beside the recipes, not part of the installed package."""

from __future__ import annotations

import csv
import dataclasses
import json
import textwrap
from pathlib import Path

LOSS_TAIL = 5  # losses averaged at the end of a run for the loss comparison


@dataclasses.dataclass
class BenchRow:
    """One model x stage. Units are in the names; ratios are against the same model's ``baseline``."""

    model: str
    stage: str
    backend: str  # "apex" when apex kernels ran, "fallback" when torch fallbacks stood in
    step_time_ms_p50: float | None
    step_time_ms_p20: float | None
    step_time_ms_p80: float | None
    tokens_per_s: float | None
    peak_memory_allocated_gib: float | None
    peak_memory_reserved_gib: float | None
    mfu: float | None
    loss_final: float | None
    kernels_verified: str
    plain_loop_ms_p50: float | None = None
    plain_loop_peak_memory_gib: float | None = None
    eval_metric: str | None = None
    eval_value: float | None = None
    speedup_vs_baseline: float | None = None
    memory_vs_baseline: float | None = None
    loss_delta_vs_baseline: float | None = None
    trainer_overhead: float | None = None  # Trainer p50 / plain-loop p50 - 1
    world_size: int = 1  # processes (GPUs) in the run; tokens/s is their sum, step time the slowest
    provenance: dict | None = None


def _backend(calls: dict, fallback: bool) -> str:
    """fallback (torch stood in for a missing apex kernel), apex, apex+torch (autotune mixed), or torch."""
    if fallback:
        return "fallback"
    apex = any(c.get("apex", 0) for c in calls.values())
    torch_chosen = any(c.get("torch", 0) for c in calls.values())
    return "apex+torch" if apex and torch_chosen else "apex" if apex else "torch"


def row_from_metrics(model: str, metrics: dict, plain: dict | None = None) -> BenchRow:
    """Build a row from a run's ``hf_apex_metrics.json`` (and the plain-loop reference, if run)."""
    calls = metrics["kernels"]["calls"]
    profiled = (metrics["kernels"].get("profiled") or {}).get("apex") or {}
    fallback = any(c.get("fallback", 0) for c in calls.values())
    if metrics["kernels"].get("profiled") is None:
        verified = "not profiled (no CUDA)" if not (metrics.get("provenance") or {}).get("gpu") else "not profiled"
    else:
        verified = ", ".join(sorted(profiled)) or "none (torch only)"
    losses = [h["loss"] for h in metrics.get("loss_history", [])]
    eval_metrics = metrics.get("eval") or {}
    eval_key = next((k for k in ("eval_accuracy", "eval_perplexity") if k in eval_metrics), None)
    step = metrics.get("step_time_ms") or {}
    return BenchRow(
        model=model,
        stage=metrics["stage"],
        backend=_backend(calls, fallback),
        step_time_ms_p50=step.get("p50"),
        step_time_ms_p20=step.get("p20"),
        step_time_ms_p80=step.get("p80"),
        tokens_per_s=metrics.get("tokens_per_s"),
        peak_memory_allocated_gib=metrics.get("peak_memory_allocated_gib"),
        peak_memory_reserved_gib=metrics.get("peak_memory_reserved_gib"),
        mfu=metrics.get("mfu"),
        loss_final=sum(losses[-LOSS_TAIL:]) / len(losses[-LOSS_TAIL:]) if losses else None,
        kernels_verified=verified,
        plain_loop_ms_p50=(plain or {}).get("step_time_ms", {}).get("p50"),
        plain_loop_peak_memory_gib=(plain or {}).get("peak_memory_allocated_gib"),
        eval_metric=eval_key,
        eval_value=eval_metrics.get(eval_key) if eval_key else None,
        world_size=metrics.get("run", {}).get("world_size", 1),
        provenance=metrics.get("provenance"),
    )


def _ratio(a, b):
    return a / b if a is not None and b else None


def add_ratios(rows: list[BenchRow]) -> list[BenchRow]:
    """Fill the columns that compare each row with its model's baseline row, and the Trainer overhead."""
    base = {r.model: r for r in rows if r.stage == "baseline"}
    for r in rows:
        b = base.get(r.model)
        if b is not None:
            r.speedup_vs_baseline = _ratio(b.step_time_ms_p50, r.step_time_ms_p50)
            r.memory_vs_baseline = _ratio(r.peak_memory_allocated_gib, b.peak_memory_allocated_gib)
            if r.loss_final is not None and b.loss_final is not None:
                r.loss_delta_vs_baseline = r.loss_final - b.loss_final
        if r.plain_loop_ms_p50:
            r.trainer_overhead = r.step_time_ms_p50 / r.plain_loop_ms_p50 - 1
    return rows


def _f(value, fmt: str, none: str = "–") -> str:
    return none if value is None else format(value, fmt)


def format_table(rows: list[BenchRow], banner: str = "") -> str:
    head = (
        "| model | stage | step ms p50 (p20–p80) | tokens/s | speedup | peak VRAM GiB (× base) | MFU | "
        "loss Δ vs base | plain loop ms | Trainer overhead | kernels verified (profiler) |"
    )
    lines = [banner, "", head, "|" + "---|" * 11] if banner else [head, "|" + "---|" * 11]
    for r in rows:
        fb = " (fallback)" if r.backend == "fallback" else ""
        lines.append(
            f"| {r.model} | {r.stage}{fb} | {_f(r.step_time_ms_p50, '.1f')} "
            f"({_f(r.step_time_ms_p20, '.1f')}–{_f(r.step_time_ms_p80, '.1f')}) | {_f(r.tokens_per_s, ',.0f')} | "
            f"{_f(r.speedup_vs_baseline, '.2f')}× | {_f(r.peak_memory_allocated_gib, '.2f')} "
            f"({_f(r.memory_vs_baseline, '.2f')}×) | {_f(r.mfu, '.1%')} | {_f(r.loss_delta_vs_baseline, '+.4f')} | "
            f"{_f(r.plain_loop_ms_p50, '.1f')} | {_f(r.trainer_overhead, '+.1%')} | {r.kernels_verified} |"
        )
    return "\n".join(lines)


def write_outputs(rows: list[BenchRow], out_dir: Path, banner: str, config: dict) -> dict[str, Path]:
    """results.md (table), results.csv, results.json ({"rows": [...]}) and, with matplotlib, results.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: out_dir / f"results.{k}" for k in ("md", "csv", "json")}
    paths["md"].write_text(format_table(rows, banner) + "\n")
    records = [dataclasses.asdict(r) for r in rows]
    with paths["csv"].open("w", newline="") as f:
        fields = [k for k in records[0] if k != "provenance"] if records else []
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    paths["json"].write_text(json.dumps({"banner": banner, "config": config, "rows": records}, indent=2) + "\n")
    png = plot(rows, out_dir / "results.png", banner)
    if png is not None:
        paths["png"] = png
    return paths


# Bar colours by what ran: torch only, apex kernels (alone or with torch where autotune chose it), torch fallbacks.
COLOURS = {"torch": "#888888", "apex": "#76b900", "apex+torch": "#4f8a10", "fallback": "#e69f00"}


def plot(rows: list[BenchRow], path: Path, title: str) -> Path | None:
    """Step time (p50, whiskers p20-p80) and peak VRAM per stage, one pair of panels per model, bars coloured by
    what ran (fallback bars hatched and named in the legend). Needs the `plot` extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return None
    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.4 * len(models)), squeeze=False)
    for ax_row, model in zip(axes, models):
        mine = [r for r in rows if r.model == model]
        stages = [r.stage for r in mine]
        colours = [COLOURS.get(r.backend, "#888888") for r in mine]
        hatches = ["//" if r.backend == "fallback" else "" for r in mine]
        step = [r.step_time_ms_p50 for r in mine]
        whiskers = [
            [(r.step_time_ms_p50 or 0) - (r.step_time_ms_p20 or r.step_time_ms_p50 or 0) for r in mine],
            [(r.step_time_ms_p80 or r.step_time_ms_p50 or 0) - (r.step_time_ms_p50 or 0) for r in mine],
        ]
        memory = [r.peak_memory_allocated_gib for r in mine]
        for ax, values, errors, label in (
            (ax_row[0], step, whiskers, "step time ms, p50 (p20-p80)"),
            (ax_row[1], memory, None, "peak VRAM allocated, GiB"),
        ):
            ax.set_title(f"{model}: {label}", fontsize=10)
            ax.tick_params(axis="x", labelsize=8, rotation=15)
            if all(v is None for v in values):  # a CPU run has no VRAM: say so instead of drawing zeros
                ax.set_xticks(range(len(stages)), stages)
                ax.set_xlim(-0.5, len(stages) - 0.5)
                ax.set_yticks([])
                ax.text(0.5, 0.5, "not measured (no CUDA)", ha="center", va="center", transform=ax.transAxes)
                continue
            bars = ax.bar(stages, [v or 0 for v in values], color=colours, hatch=hatches, yerr=errors, capsize=3)
            box = {"facecolor": "white", "edgecolor": "none", "pad": 1}
            ax.bar_label(bars, labels=[_f(v, ".1f") for v in values], fontsize=8, label_type="center", bbox=box)
    present = dict.fromkeys(r.backend for r in rows)
    names = {
        "torch": "torch only",
        "apex": "apex kernels",
        "apex+torch": "apex + torch (autotune)",
        "fallback": "torch fallback (no apex kernel ran)",
    }
    handles = [Patch(color=COLOURS[b], hatch="//" if b == "fallback" else "", label=names[b]) for b in present]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle("\n".join(textwrap.wrap(title, 110)) if title else "hf_apex stages", fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
