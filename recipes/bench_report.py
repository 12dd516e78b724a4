"""Benchmark rows, the stage table, CSV/JSON output and the chart: what `make bench` (recipes/bench.py) prints
and saves. A script beside the recipes, not part of the installed package."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import textwrap
from pathlib import Path

import numpy as np

LOSS_TAIL = 5  # losses averaged at the end of a run for the loss comparison
# Intervals (95 %). Processes differ: on an H200 on 2026-12-01 two plain-loop runs of BERT's fused_full
# configuration (host-bound BF16 steps) took 36.9 and 40.9 ms p50 in one bench, and within a run the eager BERT
# step shifts level for tens of steps at a time (46ca0e8:benchmarks/h200-2026-11-30-ladder/runs). So a row of
# several runs (bench --repeats) is summed up by the run medians: its p50 is their geometric mean, its interval a
# t-interval of their logarithms, and two rows with as many runs are compared run by run (run i of each ran in the
# same round of the bench), else by Welch's interval. A row of one run can only show its own spread: a moving-block
# bootstrap of the median over its steps, in blocks of BLOCK steps (slow steps come in bursts); the table says so.
BLOCK, RESAMPLES, LEVEL = 10, 4000, 0.95
# Rows compared with auto: it should be no slower than the faster of these.
AUTO_RIVALS = ("fused_full", "torch_fused")
# What others reach on the bench models, on the H100/H200 class (989 dense BF16 TFLOP/s each), with their sources:
# ../shared/reference/apex-and-peers.md (modded-nanogpt's README for llm.c on 8 x H100; nanoGPT-style runs).
PUBLISHED = {
    "gpt2": "llm.c ~468K tokens/s per H100 (38-41 % MFU, 8 x H100); a nanoGPT-style PyTorch + torch.compile loop "
    "~473K (~41 %)",
    "llama": "none for this 124M Llama-architecture model; GPT-2 124M, of the same width and depth: ~40 % MFU "
    "(llm.c, nanoGPT-style torch.compile, H100)",
    "bert": "no published HF BERT-base BF16 training throughput on H100/H200",
}

Runs = list[list[float]]  # one list of timed step times per run (process), in order


def as_runs(steps: list[float] | Runs | None) -> Runs | None:
    """``steps`` as a list of runs: one run's step times (a flat list) become a list of one run."""
    if not steps:
        return None
    return [list(steps)] if isinstance(steps[0], (int, float)) else [list(r) for r in steps]


def _t95(dof: float) -> float:
    """Student's t, two-sided 95 %: exact to 10 degrees of freedom, then 1.96 + 2.5 / dof (within 1 %)."""
    table = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
    return table[max(int(dof), 1) - 1] if dof < 11 else 1.96 + 2.5 / dof


def _log_medians(runs: Runs) -> np.ndarray:
    return np.log([np.median(r) for r in runs])


def _resampled_medians(steps: list[float], rng: np.random.Generator) -> np.ndarray:
    x = np.asarray(steps, dtype=np.float64)
    n, block = len(x), min(BLOCK, len(x))
    starts = rng.integers(0, n - block + 1, size=(RESAMPLES, -(-n // block)))
    index = (starts[..., None] + np.arange(block)).reshape(RESAMPLES, -1)[:, :n]
    return np.median(x[index], axis=1)


def _interval(samples: np.ndarray) -> tuple[float, float]:
    lo, hi = np.quantile(samples, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(lo), float(hi)


def typical_step(steps: list[float] | Runs | None) -> float | None:
    """The median step time of one run; over several runs, the geometric mean of their medians."""
    runs = as_runs(steps)
    if not runs:
        return None
    return float(np.median(runs[0])) if len(runs) == 1 else float(np.exp(_log_medians(runs).mean()))


def median_interval(steps: list[float] | Runs | None) -> tuple[float, float] | None:
    """95 % interval of :func:`typical_step` of ``steps`` (one run's step times in order, or a list of runs), or
    None for one run of fewer than two blocks of steps (too few to say anything about the spread)."""
    runs = as_runs(steps)
    if not runs:
        return None
    if len(runs) > 1:
        logs = _log_medians(runs)
        half = _t95(len(runs) - 1) * logs.std(ddof=1) / np.sqrt(len(runs))
        return float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))
    if len(runs[0]) < 2 * BLOCK:
        return None
    return _interval(_resampled_medians(runs[0], np.random.default_rng(0)))


def _log_spread(runs: Runs) -> tuple[float, float, float] | None:
    """log(typical_step), its standard error and degrees of freedom: over the runs when there are several, else
    from the block bootstrap of the one run (its within-run spread only; infinite degrees of freedom)."""
    if len(runs) > 1:
        logs = _log_medians(runs)
        return float(logs.mean()), float(logs.std(ddof=1) / np.sqrt(len(runs))), float(len(runs) - 1)
    if len(runs[0]) < 2 * BLOCK:
        return None
    medians = _resampled_medians(runs[0], np.random.default_rng(0))
    return float(np.log(np.median(runs[0]))), float(np.log(medians).std()), float("inf")


def relative_difference(a: list[float] | Runs | None, b: list[float] | Runs | None) -> dict | None:
    """typical_step(a) / typical_step(b) - 1, with its 95 % interval: run by run when both have as many runs (more
    than one: run i of each ran in the same round), by the bootstrap of one run against the other when both have
    one (the interval then leaves out run-to-run variation), else by Welch's interval on the logarithms."""
    a, b = as_runs(a), as_runs(b)
    if not a or not b:
        return None
    if len(a) == len(b) > 1:
        d = _log_medians(a) - _log_medians(b)
        mean, se, dof = d.mean(), d.std(ddof=1) / np.sqrt(len(d)), len(d) - 1
    elif len(a) == len(b) == 1:
        if min(len(a[0]), len(b[0])) < 2 * BLOCK:
            return None
        rng = np.random.default_rng(0)
        lo, hi = _interval(_resampled_medians(a[0], rng) / _resampled_medians(b[0], rng) - 1)
        return {"value": float(np.median(a[0]) / np.median(b[0]) - 1), "lo": lo, "hi": hi}
    else:
        sa, sb = _log_spread(a), _log_spread(b)
        if sa is None or sb is None:
            return None
        (ma, ea, fa), (mb, eb, fb) = sa, sb
        mean, se = ma - mb, np.hypot(ea, eb)
        dof = se**4 / (ea**4 / fa + eb**4 / fb) if se else fa + fb  # Welch-Satterthwaite
    half = _t95(dof) * se
    return {"value": float(np.expm1(mean)), "lo": float(np.expm1(mean - half)), "hi": float(np.expm1(mean + half))}


@dataclasses.dataclass
class BenchRow:
    """One model x stage x world size. Units are in the names; ratios are against the ``baseline`` of the same
    model and world size, scaling against the same model and stage on one process."""

    model: str
    stage: str
    backend: str  # "apex" when apex kernels ran, "fallback" when torch fallbacks stood in
    step_time_ms_p50: float | None
    step_time_ms_p20: float | None
    step_time_ms_p80: float | None
    step_time_ms_ci: tuple[float, float] | None  # 95 % interval of the p50 over the row's runs (see BLOCK)
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
    speedup_ci: tuple[float, float] | None = None  # its 95 % interval, from both rows' step times
    memory_vs_baseline: float | None = None
    loss_delta_vs_baseline: float | None = None
    trainer_overhead: float | None = None  # Trainer p50 / plain-loop p50 - 1
    trainer_overhead_ci: tuple[float, float] | None = None
    world_size: int = 1  # processes (GPUs) in the run; tokens/s is their sum, step time the slowest
    scaling: float | None = None  # world_size > 1: tokens/s / tokens/s of the same model and stage on 1 process
    scaling_ci: tuple[float, float] | None = None  # its 95 % interval, from the step times (see add_ratios)
    provenance: dict | None = None
    loss_history: list[tuple[int, float]] | None = None  # (step, loss) as logged
    steps: int | None = None  # optimizer steps of the run (its LR schedule spans them)
    compiled: bool = False  # torch.compile: the first step holds the compilation
    compile_mode: str | None = None  # its mode (None: torch's default; "reduce-overhead" records CUDA graphs)
    first_step_ms: float | None = None
    runs: int = 1  # processes run one after another for this row (bench --repeats); the figures pool them
    timed_steps_ms: Runs | None = None  # per run, the steps after warm-up in order (the intervals come from them)
    plain_loop_timed_steps_ms: Runs | None = None
    batch_size: int | None = None  # per device
    seq_len: int | None = None  # the longest sequence of a step (BERT pads to it; causal LMs' blocks)
    speedup_vs_stock: float | None = None  # the same model's stock_compiled step time over this row's (REFERENCE)
    speedup_vs_stock_ci: tuple[float, float] | None = None
    memory_vs_stock: float | None = None
    to_step_10_s: list[float | None] | None = None  # per run: seconds from the start of training to step 10's end
    compile_cache: list[str | None] | None = None  # per run: ApexTrainer's compiled work, "cold", "warm" or "off"
    cold_warm: bool = False  # bench --cold_warm: run 1 started with empty compile caches, run 2 with run 1's
    padding_share: float | None = None  # of the positions computed (natural lengths); None: not recorded
    real_tokens_per_step: float | None = None  # real tokens a step on average (tokens/s x the mean step)
    graphs: tuple[int, int] | None = None  # graphs compiled and CUDA graphs recorded in the run (packing's metrics)


def _backend(calls: dict, fallback: bool, profiled_apex: bool) -> str:
    """fallback (torch stood in for a missing apex kernel), apex, apex+torch (autotune mixed), or torch. apex kernels
    the profiler saw count as apex where no call was counted: norms replayed inside CUDA graphs run no Python."""
    if fallback:
        return "fallback"
    apex = profiled_apex or any(c.get("apex", 0) for c in calls.values())
    torch_chosen = any(c.get("torch", 0) for c in calls.values())
    return "apex+torch" if apex and torch_chosen else "apex" if apex else "torch"


def row_from_runs(model: str, runs: list[dict], plains: list[dict] | None = None) -> BenchRow:
    """One row from several runs of the same model, stage and settings (their ``hf_apex_metrics.json``, and the
    plain-loop reference of each, if run): p50 the geometric mean of the runs' medians (see ``typical_step``), p20
    and p80 of their steps pooled, tokens/s and MFU the runs' medians, peak memory their maximum, losses and kernels
    from the first run (the same seed), fallback if any run fell back."""
    every = [row_from_metrics(model, m, p) for m, p in zip(runs, plains or [None] * len(runs))]
    row = every[0]
    if len(every) == 1:
        return row
    timed = [r.timed_steps_ms[0] for r in every if r.timed_steps_ms]
    plain_timed = [r.plain_loop_timed_steps_ms[0] for r in every if r.plain_loop_timed_steps_ms]
    if len(timed) < len(every):  # runs without per-step times (older metrics files): the first run stands alone
        return row
    row.step_time_ms_p20, row.step_time_ms_p80 = map(float, np.quantile([t for r in timed for t in r], [0.2, 0.8]))
    row.step_time_ms_p50, row.step_time_ms_ci = typical_step(timed), median_interval(timed)
    row.timed_steps_ms = timed
    if plain_timed and len(plain_timed) == len(every):
        row.plain_loop_timed_steps_ms, row.plain_loop_ms_p50 = plain_timed, typical_step(plain_timed)

    def median(values):
        values = [v for v in values if v is not None]
        return float(np.median(values)) if values else None

    row.tokens_per_s, row.mfu = median(r.tokens_per_s for r in every), median(r.mfu for r in every)
    for field in ("peak_memory_allocated_gib", "peak_memory_reserved_gib", "plain_loop_peak_memory_gib"):
        setattr(row, field, max((getattr(r, field) for r in every if getattr(r, field) is not None), default=None))
    if any(r.backend == "fallback" for r in every):
        row.backend = "fallback"
    row.runs = len(every)
    row.to_step_10_s = [r.to_step_10_s[0] if r.to_step_10_s else None for r in every]
    row.compile_cache = [r.compile_cache[0] if r.compile_cache else None for r in every]
    return row


def row_from_metrics(model: str, metrics: dict, plain: dict | None = None) -> BenchRow:
    """Build a row from a run's ``hf_apex_metrics.json`` (and the plain-loop reference, if run)."""
    calls = metrics["kernels"]["calls"]
    profiled = (metrics["kernels"].get("profiled") or {}).get("apex") or {}
    fallback = any(c.get("fallback", 0) for c in calls.values())
    if metrics["kernels"].get("profiled") is None:
        verified = "not profiled (no CUDA)" if not (metrics.get("provenance") or {}).get("gpu") else "not profiled"
    elif metrics["kernels"]["profiled"].get("cuda_kernels") == 0:  # an empty profile proves nothing either way
        verified = "unverified (the profiler recorded no CUDA kernel)"
    else:
        verified = ", ".join(sorted(profiled)) or "none (torch only)"
    sdpa = (metrics["kernels"].get("profiled") or {}).get("sdpa")
    if sdpa:  # the attention kernels the profiled step ran
        verified += f"; SDPA {', '.join(sdpa)}"
    elif metrics["kernels"].get("attention_backend"):  # what attention_backend resolved to (fastest: timed)
        verified += f"; SDPA {metrics['kernels']['attention_backend']} (chosen, not profiled)"
    history = [(h["step"], h["loss"]) for h in metrics.get("loss_history", [])]
    losses = [loss for _, loss in history]
    eval_metrics = metrics.get("eval") or {}
    eval_key = next((k for k in ("eval_accuracy", "eval_perplexity") if k in eval_metrics), None)
    step = metrics.get("step_time_ms") or {}
    warmup = metrics.get("run", {}).get("warmup_steps", 0)
    timed = metrics.get("steps_ms", [])[warmup:] or None
    plain_timed = (plain or {}).get("steps_ms", [])[(plain or {}).get("warmup_steps", warmup) :] or None
    return BenchRow(
        model=model,
        stage=metrics["stage"],
        backend=_backend(calls, fallback, bool(profiled)),
        step_time_ms_p50=step.get("p50"),
        step_time_ms_p20=step.get("p20"),
        step_time_ms_p80=step.get("p80"),
        step_time_ms_ci=median_interval(timed),
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
        compiled=bool(metrics.get("run", {}).get("torch_compile")),
        compile_mode=metrics.get("run", {}).get("torch_compile_mode"),
        first_step_ms=metrics.get("run", {}).get("first_step_ms"),
        provenance=metrics.get("provenance"),
        loss_history=history or None,
        steps=metrics.get("run", {}).get("steps"),
        timed_steps_ms=as_runs(timed),
        plain_loop_timed_steps_ms=as_runs(plain_timed),
        **_largest_batch(metrics),
        to_step_10_s=[metrics.get("run", {}).get("to_step_10_s")],
        compile_cache=[(metrics.get("compile_cache") or {}).get("state")],
        padding_share=metrics.get("padding_share"),
        real_tokens_per_step=metrics["tokens_per_s"] * step["mean"] / 1e3
        if metrics.get("tokens_per_s") and step.get("mean")
        else None,
        graphs=(batches["compiled_graphs"], batches["cuda_graphs"])
        if "compiled_graphs" in (batches := metrics.get("batches") or {})
        else None,
    )


def _largest_batch(metrics: dict) -> dict:
    """``batch_size`` and ``seq_len`` of the largest batch a run trained on: its shapes where the metrics list them
    (a padding-free collator flattens a batch into one row: 5 examples in 1 x 5,120), else the arguments' batch
    size and the longest sequence."""
    shapes = (metrics.get("batches") or {}).get("shapes_trained")
    if shapes and all(len(s) == 2 for s in shapes):
        rows, length = max(shapes, key=lambda s: s[0] * s[1])
        return {"batch_size": rows, "seq_len": length}
    run = metrics.get("run") or {}
    return {"batch_size": run.get("per_device_train_batch_size"), "seq_len": run.get("seq_len")}


def _ratio(a, b):
    return a / b if a is not None and b else None


# What a user would run instead of hf_apex: transformers' Trainer with torch_compile, fused AdamW and BF16
# (recipes/bench.py REFERENCES). Every row of a bench that has it gets its speedup against it.
REFERENCE = "stock_compiled"
SAME_TOKENS = 0.005  # rows whose real tokens a step differ by less than this compare by step time alone


def add_ratios(rows: list[BenchRow]) -> list[BenchRow]:
    """Fill the columns that compare each row with the baseline row of its model and world size, the Trainer
    overhead, and for multi-process rows the scaling against the same model and stage on one process."""
    base = {(r.model, r.world_size): r for r in rows if r.stage == "baseline"}
    stock = {(r.model, r.world_size): r for r in rows if r.stage == REFERENCE}
    single = {(r.model, r.stage): r for r in rows if r.world_size == 1}
    for r in rows:
        b = base.get((r.model, r.world_size))
        if b is not None:
            r.speedup_vs_baseline = _ratio(b.step_time_ms_p50, r.step_time_ms_p50)
            diff = relative_difference(b.timed_steps_ms, r.timed_steps_ms) if r is not b else None
            r.speedup_ci = (1 + diff["lo"], 1 + diff["hi"]) if diff else None  # speedup = 1 + (t_base / t - 1)
            r.memory_vs_baseline = _ratio(r.peak_memory_allocated_gib, b.peak_memory_allocated_gib)
            r.loss_delta_vs_baseline = _loss_delta(r, b)
        s = stock.get((r.model, r.world_size))
        if s is not None:
            # Steps of other real tokens (natural lengths: packed rows against padded batches) compare by real
            # tokens/s: the median step-time ratio times the ratio of real tokens a step, its interval likewise.
            per_step = _ratio(r.real_tokens_per_step, s.real_tokens_per_step) or 1.0
            per_step = per_step if abs(per_step - 1) > SAME_TOKENS else 1.0
            r.speedup_vs_stock = (_ratio(s.step_time_ms_p50, r.step_time_ms_p50) or 0) * per_step or None
            diff = relative_difference(s.timed_steps_ms, r.timed_steps_ms) if r is not s else None
            r.speedup_vs_stock_ci = ((1 + diff["lo"]) * per_step, (1 + diff["hi"]) * per_step) if diff else None
            r.memory_vs_stock = _ratio(r.peak_memory_allocated_gib, s.peak_memory_allocated_gib)
        if r.plain_loop_ms_p50:
            r.trainer_overhead = r.step_time_ms_p50 / r.plain_loop_ms_p50 - 1
            diff = relative_difference(r.timed_steps_ms, r.plain_loop_timed_steps_ms)
            r.trainer_overhead_ci = (diff["lo"], diff["hi"]) if diff else None
        one = single.get((r.model, r.stage)) if r.world_size > 1 else None
        if one is not None:
            r.scaling, r.scaling_ci = _scaling(r, one)
    return rows


def _scaling(row: BenchRow, one: BenchRow) -> tuple[float | None, tuple[float, float] | None]:
    """``row``'s tokens/s over ``one``'s (the same model and stage on 1 process), and its 95 % interval.

    The value is the ratio of the runs' tokens/s (summed over processes). The interval comes from the bootstrap
    of their median step times: with the same tokens per step on each process, scaling = n * t_1 / t_n =
    n / (1 + d), d = t_n / t_1 - 1 as relative_difference gives it, so d's interval [lo, hi] maps to
    [n / (1 + hi), n / (1 + lo)]."""
    n = row.world_size
    diff = relative_difference(row.timed_steps_ms, one.timed_steps_ms)  # median(t_n) / median(t_1) - 1
    interval = (n / (1 + diff["hi"]), n / (1 + diff["lo"])) if diff else None
    return _ratio(row.tokens_per_s, one.tokens_per_s), interval


def _loss_delta(row: BenchRow, base: BenchRow) -> float | None:
    """Mean of the last ``LOSS_TAIL`` losses both runs logged at the same steps, ``row`` minus the baseline; None
    when the runs are not comparable (another number of steps stretches the LR schedule and the data differently)."""
    if not row.loss_history or not base.loss_history:
        return None if row.loss_final is None or base.loss_final is None else row.loss_final - base.loss_final
    if row.steps != base.steps:
        return None
    theirs = dict(base.loss_history)
    common = [(loss, theirs[step]) for step, loss in row.loss_history if step in theirs][-LOSS_TAIL:]
    if not common:
        return None
    return sum(mine - other for mine, other in common) / len(common)


def _against(row: BenchRow, other: BenchRow) -> dict:
    """``row``'s median step time relative to ``other``'s, with its 95 % interval where the steps give one."""
    diff = relative_difference(row.timed_steps_ms, other.timed_steps_ms)
    return diff or {"value": row.step_time_ms_p50 / other.step_time_ms_p50 - 1, "lo": None, "hi": None}


def auto_comparisons(rows: list[BenchRow]) -> list[dict]:
    """Per model and world size: auto's median step time against the faster of ``AUTO_RIVALS`` run on as many
    processes, with its 95 % interval; and the slower rival against the faster (``rivals``), which says whether the
    bench told the two apart at all. Where it did not, which of them is "the faster" is the bench's chance, and so
    is part of auto's verdict."""
    out = []
    for model, size in dict.fromkeys((r.model, r.world_size) for r in rows):
        same = [r for r in rows if r.model == model and r.world_size == size]
        mine = {r.stage: r for r in same if r.step_time_ms_p50 is not None}
        rivals = sorted((mine[s] for s in AUTO_RIVALS if s in mine), key=lambda r: r.step_time_ms_p50)
        if "auto" not in mine or not rivals:
            continue
        best, *others = rivals
        verdict = {"model": model, "world_size": size, "auto_vs": best.stage, **_against(mine["auto"], best)}
        if others:
            verdict["rivals"] = {"slower": others[0].stage, **_against(others[0], best)}
        out.append(verdict)
    return out


def _interval_text(lo, hi, fmt: str) -> str:
    return f" [{format(lo, fmt)}, {format(hi, fmt)}]" if lo is not None and hi is not None else ""


def _f(value, fmt: str, none: str = "–") -> str:
    return none if value is None else format(value, fmt)


# A ratio whose spread swamps it says so in its own cell, not only in the note under the table.
NOISE, NO_INTERVAL = "(noise)", "(noise?)"
NOISE_LEGEND = (
    f"{NOISE}: the ratio's 95 % interval holds no difference (a 1× speedup, a 0 % overhead); {NO_INTERVAL}: the row "
    "has no interval (too few timed steps), so nothing tells the ratio from noise."
)


def noise_mark(value: float | None, interval: tuple | None, none: float) -> str:
    """What a ratio's cell adds after its value: ``" (noise)"`` where its 95 % ``interval`` holds ``none`` (the value
    of no difference: 1 for a speedup, 0 for a relative difference), ``" (noise?)"`` where there is no interval,
    nothing where the interval excludes ``none`` or there is no value."""
    if value is None:
        return ""
    if not interval or None in interval:
        return f" {NO_INTERVAL}"
    lo, hi = interval
    return f" {NOISE}" if lo <= none <= hi else ""


def _speedup_text(row: BenchRow) -> str:
    if row.speedup_vs_baseline is None:
        return "–"
    mark = "" if row.stage == "baseline" else noise_mark(row.speedup_vs_baseline, row.speedup_ci, 1.0)
    return f"{_f(row.speedup_vs_baseline, '.2f')}×{mark}"


def _vs_stock_text(row: BenchRow) -> str:
    if row.speedup_vs_stock is None:
        return "–"
    if row.stage == REFERENCE:
        return "1×"
    ci = row.speedup_vs_stock_ci or (None, None)
    mark = noise_mark(row.speedup_vs_stock, row.speedup_vs_stock_ci, 1.0)
    return f"{row.speedup_vs_stock:.2f}×{_interval_text(*ci, '.2f')}{mark}, {_f(row.memory_vs_stock, '.2f')}×"


def _overhead_text(row: BenchRow) -> str:
    over = row.trainer_overhead_ci or (None, None)
    mark = noise_mark(row.trainer_overhead, row.trainer_overhead_ci, 0.0)
    return f"{_f(row.trainer_overhead, '+.1%')}{_interval_text(*over, '+.1%')}{mark}"


def _scaling_text(row: BenchRow) -> str:
    if row.scaling is None:
        return "–"
    return f"{row.scaling:.2f}×{_interval_text(*(row.scaling_ci or (None, None)), '.2f')}"


def format_table(rows: list[BenchRow], banner: str = "") -> str:
    """The markdown table; intervals in brackets are 95 % intervals of the median (see ``BLOCK``), and below
    the table, auto against the faster of ``AUTO_RIVALS`` per model (and world size). With any multi-process
    row, a GPUs column follows the stage and a last column gives the scaling against 1 process."""
    multi = any(r.world_size > 1 for r in rows)
    stock = any(r.stage == REFERENCE for r in rows)
    natural = any(r.padding_share for r in rows)  # padding recorded somewhere: its share and the graphs it cost
    head = (
        "| model | stage | "
        + ("GPUs | " if multi else "")
        + ("step ms p50 [95% CI] | real tokens/s | padding | graphs compiled / CUDA | " if natural else "")
        + ("" if natural else "step ms p50 [95% CI] | tokens/s | ")
        + "speedup | "
        + (f"vs {REFERENCE}{' (real tokens/s)' if natural else ''} [95% CI], VRAM × | " if stock else "")
        + "peak VRAM GiB (× base) | MFU | loss Δ vs base | plain loop ms | Trainer overhead [95% CI] | "
        "kernels verified (profiler) |" + (" scaling vs 1 GPU [95% CI] |" if multi else "")
    )
    rule = "|" + "---|" * (11 + multi * 2 + stock + natural * 2)
    lines = [banner, "", head, rule] if banner else [head, rule]
    for r in rows:
        fb = " (fallback)" if r.backend == "fallback" else ""
        ci = r.step_time_ms_ci or (None, None)
        gpus = f" {r.world_size} |" if multi else ""
        scaling = f" {_scaling_text(r)} |" if multi else ""
        vs_stock = f" {_vs_stock_text(r)} |" if stock else ""
        graphs = f"{r.graphs[0]} / {r.graphs[1]}" if r.graphs else "–"
        padding = f" {_f(r.padding_share, '.1%')} | {graphs} |" if natural else ""
        lines.append(
            f"| {r.model} | {r.stage}{fb} |{gpus} {_f(r.step_time_ms_p50, '.1f')}{_interval_text(*ci, '.1f')} | "
            f"{_f(r.tokens_per_s, ',.0f')} |{padding} {_speedup_text(r)} |{vs_stock} "
            f"{_f(r.peak_memory_allocated_gib, '.2f')} ({_f(r.memory_vs_baseline, '.2f')}×) | {_f(r.mfu, '.1%')} | "
            f"{_f(r.loss_delta_vs_baseline, '+.4f')} | {_f(r.plain_loop_ms_p50, '.1f')} | "
            f"{_overhead_text(r)} | {r.kernels_verified} |{scaling}"
        )
    for c in auto_comparisons(rows):
        gpus = f" ({c['world_size']} GPUs)" if c["world_size"] > 1 else ""
        rivals = c.get("rivals")
        told = (
            f"; {rivals['slower']} against {c['auto_vs']}: "
            f"{rivals['value']:+.1%}{_interval_text(rivals['lo'], rivals['hi'], '+.1%')}"
            if rivals
            else ""
        )
        lines.append(
            f"\n{c['model']}{gpus}: auto vs {c['auto_vs']} (the faster of {', '.join(AUTO_RIVALS)}): "
            f"{c['value']:+.1%}{_interval_text(c['lo'], c['hi'], '+.1%')} in median step time{told}"
        )
    lines += [f"\n{line}" for line in compilation_costs(rows) + warm_ups(rows) + best_against_published(rows)]
    marks = " ".join(f"{_speedup_text(r)} {_overhead_text(r)} {_vs_stock_text(r) if stock else ''}" for r in rows)
    if any(mark in marks for mark in (NOISE, NO_INTERVAL)):
        lines.append("\n" + NOISE_LEGEND)
    note = interval_note(rows)
    if note:
        lines.append("\n" + note)
    return "\n".join(lines)


def compilation_costs(rows: list[BenchRow]) -> list[str]:
    """Per compiled row: its compilation, the first step's time beyond a typical step (less the eager BF16 row's
    own first-step extra, cuBLAS and allocator warm-up), and how many steps repay it against that row: the faster
    of ``AUTO_RIVALS`` on as many processes, the eager steps a user would otherwise run. Per multi-process row that
    compiles otherwise than its one-process row (a mode without CUDA graphs; ``auto`` eager), that its scaling
    compares the two."""
    out = []
    for r in rows:
        gpus = f" ×{r.world_size}" if r.world_size > 1 else ""
        if r.compiled and r.first_step_ms is not None and r.step_time_ms_p50 is not None:
            out.append(f"{r.model} {r.stage}{gpus}: {_compilation(r, rows)}.")
        one = next((o for o in rows if (o.model, o.stage, o.world_size) == (r.model, r.stage, 1)), None)
        if r.world_size > 1 and one is not None and _compiling(one) != _compiling(r):
            out.append(
                f"{r.model} {r.stage}{gpus}: its scaling compares {_compiling(r)} with the one process's "
                f"{_compiling(one)}."
            )
    return out


def _compilation(r: BenchRow, rows: list[BenchRow]) -> str:
    rivals = [
        e
        for e in rows
        if (e.model, e.world_size) == (r.model, r.world_size) and e.stage in AUTO_RIVALS
        if e.first_step_ms is not None and e.step_time_ms_p50 is not None
    ]
    eager = min(rivals, key=lambda e: e.step_time_ms_p50, default=None)
    compile_ms = r.first_step_ms - r.step_time_ms_p50
    if eager is not None:
        compile_ms -= eager.first_step_ms - eager.step_time_ms_p50
    saved = eager.step_time_ms_p50 - r.step_time_ms_p50 if eager is not None else None
    if saved is None:
        repaid = ""
    elif saved > 0:
        repaid = f", repaid after {compile_ms / saved:,.0f} steps against {eager.stage}"
    else:
        repaid = f", never repaid against {eager.stage} (no faster per step)"
    mode = f", mode {r.compile_mode}" if r.compile_mode else ""
    return f"compilation {compile_ms / 1e3:.1f} s (first step{mode}){repaid}"


def warm_ups(rows: list[BenchRow]) -> list[str]:
    """Per compiled row: how long its first run took from the start of training to step 10's end and, in a
    ``--cold_warm`` bench, its second run, which started with the first run's compile caches."""
    out = []
    for r in rows:
        times = r.to_step_10_s or []
        if not r.compiled or not times or times[0] is None:
            continue
        states = r.compile_cache or [None] * len(times)
        first = f"{times[0]:.1f} s" + (f" ({states[0]})" if states[0] else "")
        line = f"{r.model} {bar_label(r)}: step 10 after {first}"
        if r.cold_warm and len(times) > 1 and times[1] is not None:
            state = f", compiled work {states[1]}" if states[1] else ""
            line += (
                f"; the second run, with the first run's caches{state}: {times[1]:.1f} s "
                f"({times[1] / times[0]:.0%} of the first)"
            )
        out.append(line + ".")
    return out


def _compiling(row: BenchRow) -> str:
    return f"torch.compile mode {row.compile_mode or 'default'}" if row.compiled else "eager steps"


def best_against_published(rows: list[BenchRow]) -> list[str]:
    """Per model, its row of highest MFU (one process) next to what others publish for that model (``PUBLISHED``)."""
    out = []
    for model in dict.fromkeys(r.model for r in rows):
        measured = [r for r in rows if r.model == model and r.world_size == 1 and r.mfu is not None]
        if not measured or model not in PUBLISHED:
            continue
        best = max(measured, key=lambda r: r.mfu)
        out.append(
            f"{model}: fastest here {best.stage}, {best.mfu:.1%} MFU, {_f(best.tokens_per_s, ',.0f')} tokens/s; "
            f"published: {PUBLISHED[model]}."
        )
    return out


def interval_note(rows: list[BenchRow]) -> str:
    """What the intervals are made of: how many runs each row has, and a warning for rows of one run."""
    single = (
        f"its steps resampled in blocks of {BLOCK}: such an interval leaves out how much a second run of the same row "
        "could differ (--repeats N runs each row N times, interleaved)"
    )
    timed = [r for r in rows if r.step_time_ms_p50 is not None]
    if not timed:
        return ""
    bare = [f"{r.model} {bar_label(r)}" for r in timed if r.step_time_ms_ci is None]
    short = f"one run of fewer than {2 * BLOCK} timed steps, too few to say how far its times spread"
    if len(bare) == len(timed):  # a tiny bench (CPU), or --steps below two blocks
        return f"No row has an interval: each is {short}, so differences between rows may be noise."
    none = f" No interval for {', '.join(bare)}: {short}." if bare else ""
    if all(r.runs == 1 for r in rows):
        return f"95 % intervals: one run per row, {single}.{none}"
    groups = {n: [f"{r.model} {bar_label(r)}" for r in rows if r.runs == n] for n in sorted({r.runs for r in rows})}
    several = "; ".join(f"{n} runs: {', '.join(names)}" for n, names in groups.items() if n > 1)
    return (
        f"95 % intervals. Rows of several runs ({several}) give p50 as the geometric mean of their runs' medians, "
        "with a t-interval over the runs (run by run against a row of as many runs, which ran in the same rounds)"
        + (f"; the other rows are one run, {single}." if 1 in groups else ".")
        + none
    )


def write_outputs(rows: list[BenchRow], out_dir: Path, banner: str, config: dict) -> dict[str, Path]:
    """results.md (table), results.csv, results.json ({"rows": [...]}) and, with matplotlib, results.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: out_dir / f"results.{k}" for k in ("md", "csv", "json")}
    not_run = "".join(f"\nNot run: {row}: {why}." for row, why in (config.get("not_run") or {}).items())
    paths["md"].write_text(format_table(rows, banner) + not_run + "\n")
    records = [dataclasses.asdict(r) for r in rows]
    with paths["csv"].open("w", newline="") as f:
        skip = ("provenance", "loss_history")
        fields = [k for k in records[0] if k not in skip and not k.endswith("steps_ms")] if records else []
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    document = {"banner": banner, "config": config, "rows": records, "auto_comparisons": auto_comparisons(rows)}
    paths["json"].write_text(json.dumps(document, indent=2) + "\n")
    png = plot(rows, out_dir / "results.png", banner)
    if png is not None:
        paths["png"] = png
    return paths


# The results table: benchmarks/results.csv, one line per bench row, appended to and never rewritten.
UNKNOWN = "unknown"


@dataclasses.dataclass
class ResultRow:
    """One bench row in the results table. Its fields are the table's columns, in order. An empty cell is something
    the bench did not measure (no VRAM on a CPU, no interval from too few steps); ``unknown``, something its records
    do not say. Fractions, not percentages: ``mfu``, ``trainer_overhead``."""

    date: str  # UTC start of the row's first run (ISO 8601)
    gpu: str  # "cpu" without CUDA
    gpus: int  # processes (GPUs) per run
    torch: str
    cuda: str
    transformers: str
    accelerate: str
    apex_commit: str  # the commit of the apex build that ran ("none" without apex)
    hf_apex_commit: str  # the hf_apex tree that ran ("<commit>-dirty": uncommitted changes in hf_apex/ or recipes/)
    model: str
    stage: str
    backend: str  # apex, apex+torch, torch, or fallback (torch stood in for a missing apex kernel)
    batch: str  # per-device batch x sequence length, e.g. 128x128
    runs: int | None  # processes run for the row (bench --repeats); its figures pool them
    timed_steps: int | None  # per run, after the warm-up
    step_ms_p50: float | None  # over several runs, the geometric mean of their medians
    step_ms_ci_lo: float | None  # its 95 % interval
    step_ms_ci_hi: float | None
    tokens_per_s: float | None
    mfu: float | None  # model FLOPs utilisation (the run's mfu_formula)
    peak_vram_gib: float | None  # peak memory allocated
    speedup: float | None  # the same bench's baseline row's step time over this row's
    speedup_ci_lo: float | None
    speedup_ci_hi: float | None
    trainer_overhead: float | None  # Trainer step / plain-loop step - 1
    trainer_overhead_ci_lo: float | None
    trainer_overhead_ci_hi: float | None
    vs_stock_compiled: float | None  # the same bench's stock_compiled row's step time over this row's
    vs_stock_compiled_ci_lo: float | None
    vs_stock_compiled_ci_hi: float | None
    to_step_10_s: float | None  # the row's first run: seconds from the start of training to the end of step 10
    to_step_10_warm_s: float | None  # bench --cold_warm: the second run, which started with the first's compile caches
    command: str  # the bench's command line, repository-relative
    source: str  # where the row's raw runs are, e.g. `git show <commit>:benchmarks/<folder>/`
    note: str = ""


RESULT_COLUMNS = tuple(f.name for f in dataclasses.fields(ResultRow))
RESULT_KEY = ("date", "gpu", "gpus", "model", "stage")  # one row of one bench: it is appended once
_DIGITS = {
    "step_ms": 4,
    "tokens_per_s": 0,
    "mfu": 6,
    "peak_vram_gib": 3,
    "speedup": 6,
    "trainer_overhead": 6,
    "vs_stock": 6,
    "to_step": 2,
}


def _cell(name: str, value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        digits = next((d for prefix, d in _DIGITS.items() if name.startswith(prefix)), 4)
        return f"{value:.{digits}f}"
    return str(value)


def hf_apex_commit(repo: Path) -> str | None:
    """The commit of the hf_apex checkout at ``repo``, "-dirty" when hf_apex/ or recipes/ differ from it; else the
    environment's HF_APEX_COMMIT (a machine without the repository's history); else None."""

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "--short=7", "HEAD").strip()
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "hf_apex", "recipes").strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("HF_APEX_COMMIT") or None
    return f"{commit}-dirty" if dirty else commit


def _apex_commit(provenance: dict) -> str:
    apex = provenance.get("apex") or {}
    if not apex.get("installed"):
        return "none"
    return (apex.get("commit") or UNKNOWN).split()[0]


def _run_shape(folder: Path | None, model: str, stage: str) -> str | None:
    """``batch x seq`` from the first run of a row kept beside its results.json (``runs/``), if any."""
    if folder is None:
        return None
    runs = folder / "runs"
    for path in (runs / f"{model}-{stage}" / "hf_apex_metrics.json", runs / f"{model}-{stage}.json"):
        if path.is_file():
            run = json.loads(path.read_text()).get("run") or {}
            if run.get("per_device_train_batch_size") and run.get("seq_len"):
                return f"{run['per_device_train_batch_size']}x{run['seq_len']}"
    return None


def _bench_row(record: dict) -> BenchRow:
    """A row of a results.json back as a :class:`BenchRow` (fields it lacks, from older benches, at their defaults)."""
    fields = {f.name: f for f in dataclasses.fields(BenchRow)}
    missing = {n: None for n, f in fields.items() if f.default is dataclasses.MISSING and n not in record}
    return BenchRow(
        **missing, **{k: tuple(v) if k.endswith("_ci") and v else v for k, v in record.items() if k in fields}
    )


def result_rows(
    document: dict,
    *,
    commit: str | None = None,
    source: str = "",
    note: str = "",
    folder: Path | None = None,
    batch: dict[str, str] | None = None,
) -> list[ResultRow]:
    """The results table's rows for a bench's results.json ``document``. ``commit``: the hf_apex commit that ran,
    where the document does not say it (its ``config.hf_apex_commit``, recorded since the table began); ``folder``:
    where the document lies, whose ``runs/`` give a row's batch shape where the row does not; ``batch``: per model,
    ``BxS`` where neither does."""
    config = document.get("config") or {}
    commit = commit or config.get("hf_apex_commit")
    if not commit:
        raise ValueError("the bench does not say which hf_apex commit ran: give it (or 'unknown')")
    rows = add_ratios([_bench_row(r) for r in document["rows"]])
    out = []
    for row in rows:
        prov = row.provenance or {}
        timed = as_runs(row.timed_steps_ms)
        if row.batch_size and row.seq_len:
            shape = f"{row.batch_size}x{row.seq_len}"
        else:
            shape = _run_shape(folder, row.model, row.stage) or (batch or {}).get(row.model) or UNKNOWN
        steps = config.get("steps") if isinstance(config.get("steps"), int) else None
        ci = row.step_time_ms_ci or (None, None)
        speedup_ci = (row.speedup_ci or (None, None)) if row.stage != "baseline" else (None, None)
        over = row.trainer_overhead_ci or (None, None)
        vs_stock_ci = (row.speedup_vs_stock_ci or (None, None)) if row.stage != REFERENCE else (None, None)
        to_step_10 = row.to_step_10_s or [None]
        warm = to_step_10[1] if row.cold_warm and len(to_step_10) > 1 else None
        out.append(
            ResultRow(
                date=prov.get("date") or UNKNOWN,
                gpu=prov.get("gpu") or "cpu",
                gpus=row.world_size,
                torch=prov.get("torch") or UNKNOWN,
                cuda=prov.get("cuda") or ("" if not prov.get("gpu") else UNKNOWN),
                transformers=prov.get("transformers") or UNKNOWN,
                accelerate=prov.get("accelerate") or UNKNOWN,
                apex_commit=_apex_commit(prov),
                hf_apex_commit=commit,
                model=row.model,
                stage=row.stage,
                backend=row.backend,
                batch=shape,
                runs=len(timed) if timed else None,
                timed_steps=len(timed[0]) if timed else steps,
                step_ms_p50=row.step_time_ms_p50,
                step_ms_ci_lo=ci[0],
                step_ms_ci_hi=ci[1],
                tokens_per_s=row.tokens_per_s,
                mfu=row.mfu,
                peak_vram_gib=row.peak_memory_allocated_gib,
                speedup=row.speedup_vs_baseline,
                speedup_ci_lo=speedup_ci[0],
                speedup_ci_hi=speedup_ci[1],
                trainer_overhead=row.trainer_overhead,
                trainer_overhead_ci_lo=over[0],
                trainer_overhead_ci_hi=over[1],
                vs_stock_compiled=row.speedup_vs_stock,
                vs_stock_compiled_ci_lo=vs_stock_ci[0],
                vs_stock_compiled_ci_hi=vs_stock_ci[1],
                to_step_10_s=to_step_10[0],
                to_step_10_warm_s=warm,
                command=config.get("command") or UNKNOWN,
                source=source,
                note=note,
            )
        )
    return out


def read_results(path: Path) -> list[dict]:
    """The results table's rows (as strings), after checking that its columns are :data:`RESULT_COLUMNS`."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != RESULT_COLUMNS:
            raise ValueError(f"{path}: its columns are not the results table's ({', '.join(RESULT_COLUMNS)})")
        return list(reader)


def append_results(path: Path, rows: list[ResultRow]) -> tuple[list[ResultRow], list[ResultRow]]:
    """Append ``rows`` to the results table at ``path`` (made, with its header, if missing), except rows it holds
    already: the same ``RESULT_KEY`` (one bench row appended twice, or carried into another bench by
    ``--skip_existing``). Returns (appended, refused)."""
    existing = read_results(path) if path.is_file() else []
    seen = {tuple(r[k] for k in RESULT_KEY) for r in existing}
    added, refused = [], []
    for row in rows:
        key = tuple(_cell(k, getattr(row, k)) for k in RESULT_KEY)
        (refused if key in seen else added).append(row)
        seen.add(key)
    if added:
        new = not path.is_file()
        with path.open("a", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            if new:
                writer.writerow(RESULT_COLUMNS)
            writer.writerows([_cell(k, getattr(r, k)) for k in RESULT_COLUMNS] for r in added)
    return added, refused


def append_bench(
    results_json: Path, table: Path, *, commit=None, source=None, note="", batch=None, models=None, stages=None
) -> tuple[list[ResultRow], list[ResultRow]]:
    """:func:`append_results` of a finished bench's results.json (e.g. a GPU machine's ``.bench``, unpacked here)."""
    from hf_apex.kernels.apex.availability import portable_path

    document = json.loads(results_json.read_text())
    folder = results_json.parent
    rows = result_rows(
        document, commit=commit, source=source or portable_path(str(folder)), note=note, folder=folder, batch=batch
    )
    rows = [r for r in rows if (not models or r.model in models) and (not stages or r.stage in stages)]
    return append_results(table, rows)


def appended_message(table: Path, added: list[ResultRow], refused: list[ResultRow]) -> str:
    lines = [f"{table}: {len(added)} row(s) appended"]
    if refused:
        names = ", ".join(f"{r.model} {r.stage} ({r.date})" for r in refused)
        key = ", ".join(RESULT_KEY)
        lines.append(f"{len(refused)} row(s) already in the table (the same {key}), not appended: {names}")
    return "\n".join(lines)


def format_results(rows: list[dict]) -> str:
    """Rows of the results table (as :func:`read_results` gives them) as a markdown table, the provenance they share
    above it, with the same marks as the bench's own table where a ratio's spread swamps it."""

    def num(row, name):
        return float(row[name]) if row.get(name) not in (None, "") else None

    def interval(row, name, fmt):
        lo, hi = num(row, f"{name}_ci_lo"), num(row, f"{name}_ci_hi")
        return _interval_text(lo, hi, fmt), (lo, hi) if lo is not None and hi is not None else None

    shared = [c for c in ("gpu", "torch", "transformers", "accelerate", "apex_commit", "hf_apex_commit", "command")]
    head = []
    for column in shared:
        values = list(dict.fromkeys(r[column] for r in rows))
        head.append(f"- {column}: " + "; ".join(f"`{v}`" if column == "command" else v for v in values))
    dates = sorted(r["date"] for r in rows)
    head.insert(0, f"- date (UTC): {dates[0]} to {dates[-1]}" if len(dates) > 1 else f"- date (UTC): {dates[0]}")
    stock = any(r.get("vs_stock_compiled") for r in rows)
    warm = any(r.get("to_step_10_s") for r in rows)
    lines = [
        "| model | stage | batch | runs × steps | step ms p50 [95% CI] | tokens/s | speedup [95% CI] | "
        + (f"vs {REFERENCE} [95% CI] | " if stock else "")
        + "peak VRAM GiB | MFU | Trainer overhead [95% CI] |"
        + (" to step 10 s (warm) |" if warm else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + "---|" * (stock + warm),
    ]
    marked = False
    for r in rows:
        vs_stock, vs_stock_text = num(r, "vs_stock_compiled"), ""
        if stock:
            vs_ci_text, vs_ci = interval(r, "vs_stock_compiled", ".2f")
            vs_mark = "" if r["stage"] == REFERENCE else noise_mark(vs_stock, vs_ci, 1.0)
            marked = marked or bool(vs_mark)
            vs_stock_text = f" {_f(vs_stock, '.2f')}×{vs_ci_text}{vs_mark} |" if vs_stock is not None else " – |"
        to_step_text = ""
        if warm:
            cold_s, warm_s = num(r, "to_step_10_s"), num(r, "to_step_10_warm_s")
            to_step_text = f" {_f(cold_s, '.1f')}" + (f" ({warm_s:.1f})" if warm_s is not None else "") + " |"
        step_ci, _ = interval(r, "step_ms", ".1f")
        speedup = num(r, "speedup")
        speedup_ci_text, speedup_ci = interval(r, "speedup", ".2f")
        mark = "" if r["stage"] == "baseline" else noise_mark(speedup, speedup_ci, 1.0)
        over = num(r, "trainer_overhead")
        over_ci_text, over_ci = interval(r, "trainer_overhead", "+.1%")
        over_mark = noise_mark(over, over_ci, 0.0)
        marked = marked or bool(mark or over_mark)
        speedup_text = f"{_f(speedup, '.2f')}×{speedup_ci_text}{mark}" if speedup is not None else "–"
        fb = " (fallback)" if r["backend"] == "fallback" else ""
        lines.append(
            f"| {r['model']} | {r['stage']}{fb} | {r['batch']} | {r['runs'] or '?'} × {r['timed_steps'] or '?'} | "
            f"{_f(num(r, 'step_ms_p50'), '.1f')}{step_ci} | {_f(num(r, 'tokens_per_s'), ',.0f')} | {speedup_text} |"
            f"{vs_stock_text} {_f(num(r, 'peak_vram_gib'), '.2f')} | {_f(num(r, 'mfu'), '.1%')} | "
            f"{_f(over, '+.1%')}{over_ci_text}{over_mark} |{to_step_text}"
        )
    notes = list(dict.fromkeys(r["note"] for r in rows if r["note"]))
    tail = ([NOISE_LEGEND] if marked else []) + [f"Note: {n}" for n in notes]
    return "\n".join(head + [""] + lines + ([""] + tail if tail else []))


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description="The results table (benchmarks/results.csv): append a finished bench's rows, or show some.",
        epilog="e.g. python recipes/bench_report.py append .bench/results.json --to benchmarks/results.csv "
        "--hf_apex_commit $(git rev-parse --short=7 HEAD)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("append", help="append a results.json's rows to the table (each row once)")
    add.add_argument("results_json", type=Path)
    add.add_argument("--to", type=Path, default=Path("benchmarks/results.csv"), help="the table (%(default)s)")
    add.add_argument(
        "--hf_apex_commit",
        help="the hf_apex commit the bench ran, where its results.json does not record it, or 'unknown'",
    )
    add.add_argument("--source", help="where the raw runs are kept (default: the results.json's folder)")
    add.add_argument("--note", default="", help="a caveat for these rows")
    add.add_argument("--models", nargs="+", help="only these models' rows")
    add.add_argument("--stages", nargs="+", help="only these stages' rows")
    add.add_argument(
        "--batch", action="append", default=[], metavar="MODEL=BxS", help="batch shape where the records lack it"
    )
    show = sub.add_parser("show", help="print rows of the table as markdown, with what they share above them")
    show.add_argument("--table", type=Path, default=Path("benchmarks/results.csv"), help="(%(default)s)")
    show.add_argument("--source", help="rows whose source contains this, e.g. h200-2026-12-02-whole")
    show.add_argument("--date", help="rows whose date starts with this, e.g. 2026-12-03")
    show.add_argument("--models", nargs="+")
    show.add_argument("--stages", nargs="+")
    opts = parser.parse_args(argv)
    if opts.command == "show":
        rows = [
            r
            for r in read_results(opts.table)
            if (not opts.source or opts.source in r["source"])
            and (not opts.date or r["date"].startswith(opts.date))
            and (not opts.models or r["model"] in opts.models)
            and (not opts.stages or r["stage"] in opts.stages)
        ]
        if not rows:
            parser.error("no row of the table matches")
        print(format_results(rows))
        return 0
    batch = dict(b.split("=", 1) for b in opts.batch)
    try:
        added, refused = append_bench(
            opts.results_json,
            opts.to,
            commit=opts.hf_apex_commit,
            source=opts.source,
            note=opts.note,
            batch=batch,
            models=opts.models,
            stages=opts.stages,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(appended_message(opts.to, added, refused))
    return 0 if added or not refused else 1


# Bar colours by what ran: torch only, apex kernels (alone or with torch where autotune chose it), torch fallbacks.
COLOURS = {"torch": "#888888", "apex": "#76b900", "apex+torch": "#4f8a10", "fallback": "#e69f00"}


def bar_label(row: BenchRow) -> str:
    """A bar's name in the chart: the stage, and "stage ×n" for a run on n > 1 processes."""
    return row.stage if row.world_size == 1 else f"{row.stage} ×{row.world_size}"


def plot(rows: list[BenchRow], path: Path, title: str) -> Path | None:
    """Step time (p50, error bars its 95 % interval) and peak VRAM per stage, one pair of panels per model, bars
    coloured by what ran (fallback bars hatched and named in the legend; runs on n > 1 processes named
    "stage ×n"). Needs the `plot` extra."""
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
        stages = [bar_label(r) for r in mine]
        colours = [COLOURS.get(r.backend, "#888888") for r in mine]
        hatches = ["//" if r.backend == "fallback" else "" for r in mine]
        step = [r.step_time_ms_p50 for r in mine]
        cis = [r.step_time_ms_ci or (r.step_time_ms_p50 or 0,) * 2 for r in mine]
        whiskers = None  # runs too short for intervals: no bars that claim one
        if any(r.step_time_ms_ci for r in mine):  # (the p50 was computed from unrounded times: clip rounding's hairs)
            whiskers = [
                [max((r.step_time_ms_p50 or 0) - lo, 0) for r, (lo, _) in zip(mine, cis)],
                [max(hi - (r.step_time_ms_p50 or 0), 0) for r, (_, hi) in zip(mine, cis)],
            ]
        memory = [r.peak_memory_allocated_gib for r in mine]
        for ax, values, errors, label in (
            (ax_row[0], step, whiskers, "step time ms, p50" + (" [95% CI]" if whiskers else "")),
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


if __name__ == "__main__":
    raise SystemExit(main())
