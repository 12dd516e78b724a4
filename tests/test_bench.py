"""make bench's machinery: rows, ratios, table and outputs; and the whole ladder end to end on CPU (tiny)."""

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_apex import STAGES
from hf_apex.internals import loss_items_counter
from hf_apex.measure.report import METRICS_FILENAME
from tests.test_recipe import generated_data, word_tokenizer  # noqa: F401  (fixtures)
from tests.testing_utils import loss_curve_agreement

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))
import bench_report  # noqa: E402
from bench_report import (  # noqa: E402
    add_ratios,
    auto_comparisons,
    bar_label,
    format_table,
    median_interval,
    relative_difference,
    row_from_metrics,
    row_from_runs,
    typical_step,
    write_outputs,
)


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_recipe", REPO / "recipes" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def run_bench(data_dir, tokenizer, out_dir, flags: str) -> subprocess.CompletedProcess:
    """recipes/bench.py on CPU (CUDA hidden) over generated data, the word tokenizer standing in for both."""
    tokenizers = data_dir / "tokenizers"
    tokenizers.mkdir(exist_ok=True)
    for name in ("bert-base-uncased", "gpt2"):
        if not (tokenizers / name).exists():
            (tokenizers / name).symlink_to(tokenizer)
    cmd = [sys.executable, "recipes/bench.py", "--tiny", "--data_dir", str(data_dir), "--out_dir", str(out_dir)]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run([*cmd, *flags.split()], cwd=REPO, capture_output=True, text=True, timeout=1800, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _metrics(stage, p50, mem, losses, calls, profiled):
    return {
        "stage": stage,
        "step_time_ms": {"p50": p50, "p20": p50 * 0.9, "p80": p50 * 1.1},
        "tokens_per_s": 1e5 / p50,
        "peak_memory_allocated_gib": mem,
        "peak_memory_reserved_gib": mem,
        "mfu": 0.3,
        "loss_history": [{"step": i, "loss": v} for i, v in enumerate(losses)],
        "kernels": {"calls": calls, "profiled": profiled},
        "eval": {"eval_accuracy": 0.8},
        "provenance": {"gpu": "X"},
    }


def test_rows_ratios_and_table():
    apex_calls = {"optimizer": {"apex": 10, "fallback": 0}}
    rows = [
        row_from_metrics("bert", _metrics("baseline", 200.0, 10.0, [2.0] * 5, {}, {"apex": {}})),
        row_from_metrics(
            "bert",
            _metrics("fused_full", 50.0, 5.0, [2.1] * 5, apex_calls, {"apex": {"fused_adam": ["k"]}}),
            plain={"step_time_ms": {"p50": 40.0}},
        ),
        row_from_metrics(
            "bert", _metrics("fused_adam", 210.0, 10.0, [2.0] * 5, {"optimizer": {"apex": 0, "fallback": 10}}, None)
        ),
    ]
    add_ratios(rows)
    base, full, fb = rows
    assert (base.backend, full.backend, fb.backend) == ("torch", "apex", "fallback")
    assert full.speedup_vs_baseline == pytest.approx(4.0) and full.memory_vs_baseline == pytest.approx(0.5)
    assert full.loss_delta_vs_baseline == pytest.approx(0.1)
    assert full.trainer_overhead == pytest.approx(0.25)
    assert fb.speedup_vs_baseline < 1 and fb.kernels_verified == "not profiled"  # a GPU run with profiling off
    table = format_table(rows, "banner")
    # no per-step times: no interval, and the ratio says that nothing tells it from noise
    assert "| bert | fused_full | 50.0 | 2,000 | 4.00× (noise?) |" in table
    assert "| bert | baseline | 200.0 | 500 | 1.00× |" in table  # (the baseline against itself: no mark)
    assert "fused_adam (fallback)" in table and base.kernels_verified == "none (torch only)"
    fastest = _metrics("fastest", 30.0, 4.0, [2.0] * 5, {}, {"apex": {}})
    fastest["kernels"]["attention_backend"] = "flash"  # the SDPA backend the run timed fastest
    assert row_from_metrics("bert", fastest).kernels_verified == "none (torch only); SDPA flash (chosen, not profiled)"
    fastest["kernels"]["profiled"]["sdpa"] = ["cudnn"]  # what the profiled step ran says more than the choice
    assert row_from_metrics("bert", fastest).kernels_verified == "none (torch only); SDPA cudnn"
    empty = _metrics("fused_full", 50.0, 5.0, [2.1] * 5, apex_calls, {"apex": {}, "sdpa": [], "cuda_kernels": 0})
    assert row_from_metrics("bert", empty).kernels_verified == "unverified (the profiler recorded no CUDA kernel)"


def _steps(median: float, n: int, seed: int) -> list[float]:
    """Step times like BERT's host-bound ones on the H200 (46ca0e8:benchmarks/h200-2026-11-30): ±2 % jitter and, in
    one step out of six, bursts of 8 steps 25 % slower."""
    rng = np.random.default_rng(seed)
    x = median * (1 + 0.02 * rng.standard_normal(n))
    for start in rng.choice(n - 8, size=n // 48, replace=False):
        x[start : start + 8] *= 1.25
    return x.tolist()


def test_intervals_resolve_three_percent_and_not_noise():
    steps = _steps(40.0, 200, seed=1)
    lo, hi = median_interval(steps)
    assert lo < float(np.median(steps)) < hi and hi - lo < 0.03 * 40
    assert median_interval([40.0] * 20) == (40.0, 40.0) and median_interval([40.0] * 19) is None  # < 2 blocks
    resolved = [relative_difference(_steps(41.2, 200, 100 + s), _steps(40.0, 200, 200 + s)) for s in range(10)]
    assert all(0 < d["lo"] < d["value"] < d["hi"] for d in resolved)  # 3 % slower: seen, every time
    same = [relative_difference(_steps(40.0, 200, 300 + s), _steps(40.0, 200, 400 + s)) for s in range(10)]
    assert sum(d["lo"] < 0 < d["hi"] for d in same) >= 9  # no difference: the interval holds 0 (95 %)


def test_trainer_overhead_and_auto_verdict_carry_intervals():
    def metrics(stage, steps):
        m = _metrics(stage, float(np.median(steps)), 5.0, [2.0] * 5, {}, {"apex": {}})
        return {**m, "steps_ms": [999.0] * 3 + steps, "run": {"warmup_steps": 3}}  # warm-up steps left out

    trainer, plain = _steps(42.0, 200, seed=6), _steps(40.0, 200, seed=7)
    plain_json = {"steps_ms": [999.0] + plain, "warmup_steps": 1, "step_time_ms": {"p50": float(np.median(plain))}}
    rows = [
        row_from_metrics("bert", metrics("baseline", _steps(200.0, 200, seed=8))),
        row_from_metrics("bert", metrics("fused_full", trainer), plain=plain_json),
        row_from_metrics("bert", metrics("torch_fused", _steps(45.0, 200, seed=9))),
        row_from_metrics("bert", metrics("auto", list(trainer))),  # the same times as fused_full
    ]
    add_ratios(rows)
    full = rows[1]
    assert full.timed_steps_ms == [trainer] and full.plain_loop_timed_steps_ms == [plain] and full.runs == 1
    lo, hi = full.trainer_overhead_ci
    assert 0 < lo < full.trainer_overhead < hi and full.trainer_overhead == pytest.approx(0.05, abs=0.01)
    (verdict,) = auto_comparisons(rows)
    assert verdict["auto_vs"] == "fused_full" and verdict["lo"] < 0 < verdict["hi"]
    # ...and whether the bench told the two rivals apart (45 against 42 ms: it did)
    rivals = verdict["rivals"]
    assert rivals["slower"] == "torch_fused" and 0 < rivals["lo"] < rivals["value"] < rivals["hi"]
    assert rivals["value"] == pytest.approx(45 / 42 - 1, abs=0.02)
    table = format_table(rows)
    assert re.search(r"\| fused_full \| 4\d\.\d \[4\d\.\d, 4\d\.\d\] \|", table)
    assert re.search(r"\| \+\d\.\d% \[\+\d\.\d%, \+\d\.\d%\] \|", table)
    assert re.search(
        r"bert: auto vs fused_full \(the faster of fused_full, torch_fused\): [+-]\d\.\d% \[[^]]+\] in median step "
        r"time; torch_fused against fused_full: \+\d\.\d% \[\+\d\.\d%, \+\d\.\d%\]",
        table,
    )
    assert table.endswith(
        "95 % intervals: one run per row, its steps resampled in blocks of 10: such an interval leaves out how much a "
        "second run of the same row could differ (--repeats N runs each row N times, interleaved)."
    )


def test_rows_too_short_for_an_interval_say_so_under_the_table():
    """The CPU bench's tiny runs time 6 steps: no interval, and the note says why instead of leaving a blank."""
    six = [40.0, 40.4, 39.8, 41.0, 40.1, 39.9]
    short = [row_from_metrics("bert", _ddp_metrics(stage, six, 1)) for stage in STAGES]
    add_ratios(short)
    assert all(r.step_time_ms_ci is None for r in short)
    note = bench_report.interval_note(short)
    assert note == (
        "No row has an interval: each is one run of fewer than 20 timed steps, too few to say how far its times "
        "spread, so differences between rows may be noise."
    )
    assert note in format_table(short)
    long = row_from_metrics("gpt2", _ddp_metrics("baseline", _steps(40.0, 60, seed=9), 1))
    missing = (
        "No interval for bert baseline: one run of fewer than 20 timed steps, too few to say how far its times spread."
    )
    assert bench_report.interval_note(add_ratios([short[0], long])).endswith(missing)
    pooled = row_from_runs("gpt2", [_ddp_metrics("auto", _steps(40.0, 60, seed=s), 1) for s in (1, 2, 3)])
    note = bench_report.interval_note(add_ratios([short[0], pooled]))
    assert note.startswith("95 % intervals. Rows of several runs (3 runs: gpt2 auto)") and note.endswith(missing)
    untimed = dataclasses.replace(short[0], step_time_ms_p50=None)  # nothing timed: nothing to say
    assert bench_report.interval_note([untimed]) == "" and "intervals" not in format_table([untimed])


def test_a_ratio_whose_spread_swamps_it_says_so_in_its_row():
    """The row itself, not only the note under the table: on a loaded 2-core CPU `make bench` printed
    `bert | fused_full (fallback) | ... | 9.56× | ... | -89.8%` from 6 steps a run, with "may be noise" below."""
    six = [40.0, 40.4, 39.8, 41.0, 40.1, 39.9]
    fast = [t / 9.56 for t in six]
    plain = {"steps_ms": [t / (1 - 0.898) for t in fast], "warmup_steps": 0}
    plain["step_time_ms"] = {"p50": float(np.median(plain["steps_ms"]))}
    fallback = {"optimizer": {"apex": 0, "fallback": 6}}
    cpu = [
        row_from_metrics("bert", _ddp_metrics("baseline", six, 1)),
        row_from_metrics("bert", {**_ddp_metrics("fused_full", fast, 1), "kernels": {"calls": fallback}}, plain),
    ]
    table = format_table(add_ratios(cpu)).splitlines()
    row = next(line for line in table if line.startswith("| bert | fused_full (fallback) |"))
    assert "| 9.56× (noise?) |" in row and "| -89.8% (noise?) |" in row
    assert "| 1.00× |" in table[2]  # the baseline's own ratio: no mark
    # With intervals: a speedup whose interval holds 1 is noise; one that excludes 1 is not marked.
    rows = add_ratios(
        [
            row_from_metrics("gpt2", _ddp_metrics("baseline", _steps(40.0, 200, seed=1), 1)),
            row_from_metrics("gpt2", _ddp_metrics("fused_adam", _steps(40.0, 200, seed=2), 1)),
            row_from_metrics("gpt2", _ddp_metrics("fused_full", _steps(20.0, 200, seed=3), 1)),
        ]
    )
    same, fast = rows[1], rows[2]
    assert same.speedup_ci[0] < 1 < same.speedup_ci[1] and 1.9 < fast.speedup_ci[0] < 2 < fast.speedup_ci[1] < 2.1
    table = format_table(rows)
    assert re.search(r"^\| gpt2 \| fused_adam \| [^|]+ \| [^|]+ \| 1\.\d\d× \(noise\) \|", table, re.M)
    assert re.search(r"^\| gpt2 \| fused_full \| [^|]+ \| [^|]+ \| 2\.\d\d× \|", table, re.M)
    assert bench_report.NOISE_LEGEND in table
    # The same marks where the results table's rows are shown (benchmarks/reports).
    shown = bench_report.format_results(
        [
            {k: bench_report._cell(k, getattr(r, k)) for k in bench_report.RESULT_COLUMNS}
            for r in bench_report.result_rows({"rows": [dataclasses.asdict(r) for r in cpu + rows]}, commit="c")
        ]
    )
    assert "| 9.56× (noise?) |" in shown and "| -89.8% (noise?) |" in shown
    assert re.search(r"\| gpt2 \| fused_adam \| .* \| 1\.\d\d× \[0\.\d\d, 1\.\d\d\] \(noise\) \|", shown)
    assert bench_report.noise_mark(None, None, 1.0) == "" and bench_report.noise_mark(2.0, (1.9, 2.1), 1.0) == ""


def _runs(median: float, offsets: list[float], seed: int, n: int = 100) -> list[list[float]]:
    """Runs of ``n`` steps (see _steps), each run slower or faster as a whole by its offset: processes differ."""
    return [[t * (1 + off) for t in _steps(median, n, seed + i)] for i, off in enumerate(offsets)]


def test_intervals_over_runs_hold_the_run_to_run_spread():
    rng = np.random.default_rng(5)
    # Rows of the same configuration whose processes differ by ±5 % (a host-bound BERT step on the H200), 3 runs each.
    trials = [
        (_runs(40.0, 0.05 * rng.standard_normal(3), 10 * s), _runs(40.0, 0.05 * rng.standard_normal(3), 500 + s))
        for s in range(20)
    ]
    one_run = [relative_difference(a[0], b[0]) for a, b in trials]
    three = [relative_difference(a, b) for a, b in trials]
    assert sum(d["lo"] < 0 < d["hi"] for d in one_run) <= 12  # one run each: "a difference" more often than not
    assert sum(d["lo"] < 0 < d["hi"] for d in three) >= 18  # over runs: the interval holds 0
    a = trials[0][0]
    lo, hi = median_interval(a)
    assert lo < typical_step(a) < hi and typical_step(a) == pytest.approx(np.exp(np.mean(np.log(np.median(a, 1)))))
    one_lo, one_hi = median_interval(a[0])
    assert hi - lo > 2 * (one_hi - one_lo)  # the spread between runs, which one run cannot show
    # Runs of one round share the machine's slow spells: compared run by run, a 3 % difference still shows...
    rounds = 0.06 * rng.standard_normal(3)
    slow, fast = _runs(41.2, rounds, 900), _runs(40.0, rounds, 950)
    d = relative_difference(slow, fast)
    assert 0 < d["lo"] < d["value"] < d["hi"] < 0.06 and d["value"] == pytest.approx(0.03, abs=0.01)
    # ...which the same runs out of their rounds do not.
    unpaired = relative_difference(slow, fast[::-1])
    assert unpaired["lo"] < 0 < unpaired["hi"] and unpaired["hi"] - unpaired["lo"] > 3 * (d["hi"] - d["lo"])
    # Rows of different numbers of runs: Welch's interval, around the ratio of their typical steps.
    welch = relative_difference(slow, fast[:2])
    assert welch["value"] == pytest.approx(typical_step(slow) / typical_step(fast[:2]) - 1)
    assert welch["lo"] < welch["value"] < welch["hi"]
    mixed = relative_difference(slow, fast[0])  # three runs against one: Welch again, the one run's spread its own
    assert mixed["value"] == pytest.approx(typical_step(slow) / float(np.median(fast[0])) - 1)
    assert mixed["lo"] < mixed["value"] < mixed["hi"] and mixed["hi"] - mixed["lo"] > d["hi"] - d["lo"]


def test_a_row_pools_its_runs():
    def metrics(steps, tokens, memory):
        m = _metrics("auto", float(np.median(steps)), memory, [2.0] * 5, {}, {"apex": {}})
        return {**m, "steps_ms": [999.0, *steps], "run": {"warmup_steps": 1}, "tokens_per_s": tokens}

    runs = _runs(40.0, [0.0, 0.1, -0.05], seed=40)
    plains = _runs(38.0, [0.0, 0.1, -0.05], seed=60)
    plain_json = [{"steps_ms": p, "warmup_steps": 0, "step_time_ms": {"p50": float(np.median(p))}} for p in plains]
    row = row_from_runs(
        "bert", [metrics(r, t, m) for r, t, m in zip(runs, (1.0, 3.0, 2.0), (5.0, 6.0, 4.0))], plain_json
    )
    assert row.runs == 3 and row.timed_steps_ms == runs and row.plain_loop_timed_steps_ms == plains
    assert row.step_time_ms_p50 == pytest.approx(typical_step(runs)) and row.step_time_ms_ci == median_interval(runs)
    assert row.step_time_ms_p80 == pytest.approx(np.quantile([t for r in runs for t in r], 0.8))
    assert row.plain_loop_ms_p50 == pytest.approx(typical_step(plains))
    assert (row.tokens_per_s, row.peak_memory_allocated_gib) == (2.0, 6.0)  # median of the runs, the highest peak
    add_ratios([row])
    assert row.trainer_overhead == pytest.approx(relative_difference(runs, plains)["value"])
    lo, hi = row.trainer_overhead_ci
    assert 0 < lo < row.trainer_overhead < hi  # the same offsets in each round: 40 against 38 ms resolved
    note = format_table([row]).splitlines()[-1]
    assert note.startswith("95 % intervals. Rows of several runs (3 runs: bert auto) give p50 as the geometric mean")
    assert "one run" not in note


def test_loss_curve_agreement():
    a = [3.0 - 0.01 * i for i in range(100)]
    same = loss_curve_agreement(a, a)
    assert same["max_rel_gap_smoothed"] == 0 and same["steps"] == 100
    off = loss_curve_agreement(a, [x * 1.05 for x in a])
    assert off["final_rel_gap"] == pytest.approx(0.05 / 1.05)
    assert len(off["gaps"]) == 81 and off["gaps"][0] == pytest.approx(0.05 / 1.05)  # one per step from step 20 on
    with pytest.raises(ValueError):
        loss_curve_agreement(a[:5], a[:5])


def test_bench_runs_the_ladder_on_cpu_and_says_fallback(generated_data, word_tokenizer, tmp_path):  # noqa: F811
    out = run_bench(generated_data, word_tokenizer, tmp_path, "--steps 2 --warmup 1 --batch bert=4 --batch gpt2=4")
    assert out.stdout.startswith("FALLBACK NUMBERS (no CUDA, no apex kernels)")
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"]
    assert [(r["model"], r["stage"]) for r in rows] == [
        (m, s) for m in ("bert", "gpt2") for s in ("baseline", "fused_adam", "fused_adam_ln", "fused_full")
    ]
    for r in rows:
        assert r["backend"] == ("torch" if r["stage"] == "baseline" else "fallback")
        assert r["step_time_ms_p50"] > 0 and r["plain_loop_ms_p50"] > 0 and r["provenance"]["gpu"] is None
        assert r["world_size"] == 1
        for key in (
            "tokens_per_s",
            "speedup_vs_baseline",
            "memory_vs_baseline",
            "mfu",
            "loss_delta_vs_baseline",
            "kernels_verified",
            "peak_memory_allocated_gib",
        ):
            assert key in r
    plain = json.loads((tmp_path / "runs" / "gpt2-fused_full-plain.json").read_text())
    assert len(plain["steps_ms"]) == 3 and len(plain["losses"]) == 3  # the plain loop ran the same 1 + 2 steps
    assert plain["torch_compile_mode"] is None  # fused_full does not compile
    # Nothing written names a path of this machine.
    for path in tmp_path.rglob("*.json"):
        assert not re.search(r'"/(tmp|home|root|work)/', path.read_text()), path
    # What a kept run is matched on includes the stage's row, its recipe too, which a flag-for-flag match would miss
    kept = json.loads((tmp_path / "runs" / "gpt2-fused_full" / "bench_settings.json").read_text())
    row = {k: v for k, v in dataclasses.asdict(STAGES["fused_full"]).items() if k != "summary"}
    assert kept["stage"] == json.loads(json.dumps(row)) and "recipe" in row and kept["nproc"] == 1
    assert kept["finetune"][kept["finetune"].index("--stage_recipe") + 1] == '{"min_steps": 0}'
    # A second call with --skip_existing reuses every run and rebuilds the same table...
    flags = "--steps 2 --warmup 1 --batch bert=4 --batch gpt2=4 --skip_existing"
    again = run_bench(generated_data, word_tokenizer, tmp_path, flags)
    assert again.stdout.count("kept from") == 8
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == rows
    table = (tmp_path / "results.md").read_text()
    assert table.startswith("FALLBACK NUMBERS") and table.count("(fallback)") == 6
    assert (tmp_path / "results.csv").read_text().count("\n") == 9
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "results.png").stat().st_size > 10_000
    else:
        assert "no chart" in out.stdout
    # ...and so does a call on those runs moved to another --out_dir (benches run side by side, merged), here named
    # relative to the repository, as device_session.sh names its bench folders
    merged = tmp_path / "merged"
    shutil.copytree(tmp_path / "runs", merged / "runs")
    moved = run_bench(generated_data, word_tokenizer, Path(os.path.relpath(merged, REPO)), flags)
    assert moved.stdout.count("kept from") == 8
    # ...but not a run made with other settings (here the default batch of 8 instead of 4).
    flags = "--models gpt2 --stages baseline --steps 2 --warmup 1 --skip_existing --no_plain_loop"
    other = run_bench(generated_data, word_tokenizer, tmp_path, flags)
    assert "kept from" not in other.stdout and "other settings: running it again" in other.stdout
    run = json.loads((tmp_path / "runs" / "gpt2-baseline" / METRICS_FILENAME).read_text())["run"]
    assert run["per_device_train_batch_size"] == 8


PROBE = """
import json, multiprocessing, os, sys
seen = {"argv": sys.argv[1:], "cwd": os.getcwd(), "start_method": multiprocessing.get_start_method(),
        "imported_before": sorted(m for m in ("torch", "datasets", "transformers.trainer") if m in sys.modules),
        "name": __name__}
print("probe ran")
json.dump(seen, open(sys.argv[1], "w"))
if sys.argv[2] == "fail":
    raise RuntimeError("the probe failed on purpose")
"""

DRIVER = """
import sys
from pathlib import Path
sys.path.insert(0, {recipes!r})
import bench
if __name__ == "__main__":
    print("fork server:", bench.use_fork_server(cuda=False))
    for i, outcome in enumerate(sys.argv[1:]):
        cmd = [sys.executable, {probe!r}, {tmp!r} + f"/seen{{i}}.json", outcome]
        bench.run(cmd, Path({tmp!r}) / f"{{i}}.log", preload=True)
"""


def test_preloaded_runs_start_like_a_new_interpreter_with_the_imports_done(tmp_path):
    """bench.run(preload=True): each run is a process forked from the fork server, which imported what the runs import
    (torch, datasets, transformers' Trainer...) once; the script sees its own argv, the repository as cwd, __main__,
    and the start method a new interpreter has (its loader workers must not start from the fork server); a failure
    stops the bench with the log's tail."""
    probe, driver = tmp_path / "probe.py", tmp_path / "driver.py"
    probe.write_text(PROBE)
    driver.write_text(DRIVER.format(recipes=str(REPO / "recipes"), probe=str(probe), tmp=str(tmp_path)))
    default = subprocess.run(
        [sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    ok = subprocess.run([sys.executable, str(driver), "ok", "ok"], cwd=tmp_path, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "fork server ready in" in ok.stdout and "fork server: True" in ok.stdout
    assert "did not import" not in ok.stderr  # every PRELOAD module arrived in the server
    for i in range(2):
        seen = json.loads((tmp_path / f"seen{i}.json").read_text())
        assert seen == {
            "argv": [str(tmp_path / f"seen{i}.json"), "ok"],
            "cwd": str(REPO),
            "start_method": default,
            # the probe imports none of them: the fork server did (transformers.trainer, datasets) or this
            # script's own re-import in the child, to find bench.run's target (torch)
            "imported_before": ["datasets", "torch", "transformers.trainer"],
            "name": "__main__",
        }
        assert (tmp_path / f"{i}.log").read_text() == "probe ran\n"
    failed = subprocess.run([sys.executable, str(driver), "fail"], cwd=tmp_path, capture_output=True, text=True)
    assert failed.returncode != 0
    assert "failed (exit 1)" in failed.stderr and "the probe failed on purpose" in failed.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine whose forked processes cannot use CUDA")
def test_runs_start_as_new_interpreters_where_a_forked_process_fails_its_check(tmp_path):
    # Here a forked process cannot use CUDA (there is none), as where something had initialised CUDA in the server.
    driver = tmp_path / "driver.py"
    driver.write_text(
        f"import sys\nsys.path.insert(0, {str(REPO / 'recipes')!r})\nimport bench\n"
        "if __name__ == '__main__':\n    print('fork server:', bench.use_fork_server(cuda=True))\n"
    )
    out = subprocess.run([sys.executable, str(driver)], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failed its check" in out.stdout and "fork server: False" in out.stdout


def test_bench_with_two_processes_runs_ddp(generated_data, word_tokenizer, tmp_path):  # noqa: F811
    flags = "--models gpt2 --stages baseline --steps 2 --warmup 1 --nproc 2"
    out = run_bench(generated_data, word_tokenizer, tmp_path, flags)
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["world_size"] == 2 and row["plain_loop_ms_p50"] is None
    assert "2 processes per run (DDP)" in out.stdout


def _bench_document(tmp_path, config=None) -> Path:
    """A finished bench's outputs (write_outputs) in ``tmp_path``: gpt2 baseline and fastest, one run each."""
    rows = []
    for stage, p50, date in (
        ("baseline", 300.0, "2026-12-04T10:00:00+00:00"),
        ("fastest", 30.0, "2026-12-04T10:05:00+00:00"),
    ):
        metrics = _ddp_metrics(stage, _steps(p50, 40, seed=int(p50)), 1)
        metrics["run"].update(per_device_train_batch_size=16, seq_len=1024)
        metrics["provenance"] = {"date": date, "gpu": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0",
                                 "transformers": "5.17.0", "accelerate": "1.15.0",
                                 "apex": {"installed": True, "commit": "6424da3b (declared)"}}  # fmt: skip
        rows.append(row_from_metrics("gpt2", metrics))
    config = {"command": "python recipes/bench.py --models gpt2", **(config or {})}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_report, "plot", lambda *args: None)
        return write_outputs(add_ratios(rows), tmp_path, "banner", config)["json"]


def test_the_results_table_takes_each_bench_row_once(tmp_path, capsys):
    results = _bench_document(tmp_path / "bench", {"hf_apex_commit": "abc1234"})
    table = tmp_path / "results.csv"
    added, refused = bench_report.append_bench(results, table, source="abc1234:benchmarks/x/")
    assert len(added) == 2 and not refused
    lines = table.read_text().splitlines()
    assert lines[0] == ",".join(bench_report.RESULT_COLUMNS) and len(lines) == 3
    (base, fastest) = bench_report.read_results(table)
    assert fastest["hf_apex_commit"] == "abc1234" and fastest["batch"] == "16x1024" and fastest["gpu"] == "NVIDIA H200"
    assert fastest["apex_commit"] == "6424da3b" and fastest["runs"] == "1" and fastest["timed_steps"] == "40"
    assert 9 < float(fastest["speedup_ci_lo"]) < float(fastest["speedup"]) < float(fastest["speedup_ci_hi"]) < 11
    assert base["speedup_ci_lo"] == "" and fastest["source"] == "abc1234:benchmarks/x/"
    # Appended twice, the table keeps one copy; the command says so and exits with 1.
    argv = ["append", str(results), "--to", str(table)]
    assert bench_report.main(argv) == 1 and len(table.read_text().splitlines()) == 3
    assert "2 row(s) already in the table" in capsys.readouterr().out
    # A bench that does not say which hf_apex ran: the commit must be given ('unknown' where nobody knows).
    anonymous = _bench_document(tmp_path / "old")
    with pytest.raises(ValueError, match="hf_apex commit"):
        bench_report.append_bench(anonymous, tmp_path / "other.csv")
    assert bench_report.main([*argv[:2], "--to", str(tmp_path / "other.csv"), "--hf_apex_commit", "unknown"]) == 0
    assert bench_report.read_results(tmp_path / "other.csv")[0]["hf_apex_commit"] == "unknown"
    # Another table's columns: refused rather than appended under the wrong names.
    (tmp_path / "wrong.csv").write_text("date,model\n")
    with pytest.raises(ValueError, match="columns"):
        bench_report.append_bench(results, tmp_path / "wrong.csv")
    assert bench_report.main(["show", "--table", str(table), "--stages", "fastest"]) == 0
    shown = capsys.readouterr().out
    assert "- hf_apex_commit: abc1234" in shown and "| gpt2 | fastest | 16x1024 | 1 × 40 |" in shown


def test_the_committed_results_table_has_the_columns_it_is_appended_with():
    rows = bench_report.read_results(REPO / "benchmarks" / "results.csv")
    keys = [tuple(r[k] for k in bench_report.RESULT_KEY) for r in rows]
    assert len(keys) == len(set(keys)) and all(r["hf_apex_commit"] and r["source"] for r in rows)


def test_bench_appends_its_rows_to_the_results_table(tmp_path, monkeypatch, capsys):
    def fake_run(cmd, log, preload=False, env=None):
        out = Path(cmd[cmd.index("--output_dir") + 1])
        out.mkdir(parents=True, exist_ok=True)
        stage = cmd[cmd.index("--stage") + 1]
        metrics = _ddp_metrics(stage, _steps(40.0, 30, seed=3), 1)
        metrics["provenance"] = {"date": f"2026-12-04T10:00:0{len(stage) % 10}+00:00", "gpu": None}
        (out / METRICS_FILENAME).write_text(json.dumps(metrics))

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench_report, "plot", lambda *args: None)
    table = tmp_path / "results.csv"
    flags = "--tiny --models gpt2 --stages baseline fused_full --steps 4 --warmup 1 --no_plain_loop --no_preload"
    argv = [*flags.split(), "--out_dir", str(tmp_path / "bench"), "--append_results", str(table)]
    assert bench.main(argv) == 0
    assert f"{table}: 2 row(s) appended" in capsys.readouterr().out
    rows = bench_report.read_results(table)
    assert [r["stage"] for r in rows] == ["baseline", "fused_full"] and rows[0]["gpu"] == "cpu"
    assert rows[0]["hf_apex_commit"] == bench_report.hf_apex_commit(REPO) and rows[0]["command"].startswith(
        "python recipes/bench.py --tiny"
    )
    # the commit: git's where there is a repository, else the environment's, else none
    monkeypatch.setenv("HF_APEX_COMMIT", "feed123")
    assert bench_report.hf_apex_commit(tmp_path) == "feed123"
    monkeypatch.delenv("HF_APEX_COMMIT")
    assert bench_report.hf_apex_commit(tmp_path) is None


def test_loss_delta_compares_the_same_logged_steps_of_comparable_runs():
    def metrics(stage, last_step, every=10, steps=None):
        m = _metrics(stage, 50.0, 5.0, [], {}, {"apex": {}})
        m["loss_history"] = [{"step": s, "loss": 10.0 - 0.01 * s} for s in range(every, last_step + 1, every)]
        m["run"] = {"steps": steps or last_step}
        return m

    base = row_from_metrics("bert", metrics("baseline", 210, every=10))
    same = row_from_metrics("bert", metrics("auto", 210, every=25))  # logged at other steps: compared where both did
    longer = row_from_metrics("bert", metrics("fused_full", 210, steps=70))  # another schedule: not comparable
    add_ratios([base, same, longer])
    assert same.loss_delta_vs_baseline == pytest.approx(0.0) and longer.loss_delta_vs_baseline is None
    assert same.loss_final == pytest.approx(10.0 - 0.01 * 150)  # its own last losses are still reported


HEAD_1GPU = (
    "| model | stage | step ms p50 [95% CI] | tokens/s | speedup | peak VRAM GiB (× base) | MFU | "
    "loss Δ vs base | plain loop ms | Trainer overhead [95% CI] | kernels verified (profiler) |"
)


def _ddp_metrics(stage: str, steps: list[float], world_size: int) -> dict:
    """A run on ``world_size`` processes: the same tokens per step on each, so tokens/s sums over them."""
    p50 = float(np.median(steps))
    m = _metrics(stage, p50, 5.0, [2.0] * 5, {}, {"apex": {}})
    return {**m, "tokens_per_s": world_size * 1e5 / p50, "steps_ms": steps, "run": {"world_size": world_size}}


def test_scaling_against_one_process_and_baselines_per_world_size():
    one, two = _steps(40.0, 200, seed=11), _steps(42.0, 200, seed=12)
    rows = [
        row_from_metrics("gpt2", _ddp_metrics("baseline", _steps(200.0, 200, seed=13), 1)),
        row_from_metrics("gpt2", _ddp_metrics("fused_full", one, 1)),
        row_from_metrics("gpt2", _ddp_metrics("auto", _steps(45.0, 200, seed=14), 1)),
        row_from_metrics("gpt2", _ddp_metrics("torch_fused", _steps(38.0, 200, seed=15), 1)),
        row_from_metrics("gpt2", _ddp_metrics("baseline", _steps(220.0, 200, seed=16), 2)),
        row_from_metrics("gpt2", _ddp_metrics("fused_full", two, 2)),
        row_from_metrics("gpt2", _ddp_metrics("auto", _steps(43.0, 200, seed=17), 2)),
        row_from_metrics("gpt2", _ddp_metrics("compiled", _steps(41.0, 200, seed=18), 2)),  # no 1-process run
    ]
    add_ratios(rows)
    base1, full1, _, _, base2, full2, _, compiled2 = rows
    # Scaling: the tokens/s ratio, its interval from the step times' bootstrap (2 / (1 + d), d = t_2 / t_1 - 1).
    assert full2.world_size == 2 and full2.scaling == pytest.approx(2 * np.median(one) / np.median(two))
    assert full2.scaling == pytest.approx(full2.tokens_per_s / full1.tokens_per_s)
    diff = relative_difference(two, one)
    assert full2.scaling_ci == pytest.approx((2 / (1 + diff["hi"]), 2 / (1 + diff["lo"])))
    lo, hi = full2.scaling_ci
    assert 1.85 < lo < full2.scaling < hi < 1.95  # 2 x 40 / 42 = 1.905: resolved, and short of 2
    assert full1.scaling is None and full1.scaling_ci is None and base1.scaling is None
    assert compiled2.scaling is None and compiled2.scaling_ci is None  # nothing on 1 process to compare with
    # Baselines pair by world size: the 2-process rows against the 2-process baseline.
    assert full1.speedup_vs_baseline == pytest.approx(base1.step_time_ms_p50 / full1.step_time_ms_p50)
    assert full2.speedup_vs_baseline == pytest.approx(base2.step_time_ms_p50 / full2.step_time_ms_p50)
    assert base2.speedup_vs_baseline == pytest.approx(1.0)
    # auto against its rivals of the same world size: torch_fused on 1 process, fused_full on 2.
    verdicts = {c["world_size"]: c for c in auto_comparisons(rows)}
    assert verdicts[1]["auto_vs"] == "torch_fused" and verdicts[2]["auto_vs"] == "fused_full"
    assert verdicts[2]["value"] == pytest.approx(43.0 / 42.0 - 1, abs=0.01)
    # The table: a GPUs column after the stage, the scaling last.
    table = format_table(rows, "banner").splitlines()
    assert table[2] == (
        "| model | stage | GPUs | step ms p50 [95% CI] | tokens/s | speedup | peak VRAM GiB (× base) | MFU | "
        "loss Δ vs base | plain loop ms | Trainer overhead [95% CI] | kernels verified (profiler) | "
        "scaling vs 1 GPU [95% CI] |"
    )
    assert table[3] == "|" + "---|" * 13
    assert table[5].startswith("| gpt2 | fused_full | 1 | 4") and table[5].endswith("| none (torch only) | – |")
    assert re.fullmatch(r"\| gpt2 \| fused_full \| 2 \| .* \| 1\.9\d× \[1\.\d\d, 1\.9\d\] \|", table[9])
    assert f"{full2.scaling:.2f}× [{lo:.2f}, {hi:.2f}] |" in table[9]
    assert table[11].startswith("| gpt2 | compiled | 2 |") and table[11].endswith(" | – |")
    assert all(line.count("|") == 14 for line in table[2:12])
    text = "\n".join(table)
    assert "\ngpt2: auto vs torch_fused " in text and "\ngpt2 (2 GPUs): auto vs fused_full " in text
    # One process only: no new columns, the table as before.
    single = add_ratios([row_from_metrics("gpt2", _ddp_metrics(s, _steps(40.0, 200, seed=19), 1)) for s in "ab"])
    table = format_table(single, "banner").splitlines()
    assert table[2] == HEAD_1GPU and table[3] == "|" + "---|" * 11 and "GPUs" not in "\n".join(table)
    assert all(line.count("|") == 12 for line in table[2:] if line.startswith("|"))
    # Chart bars tell the world sizes apart.
    assert [bar_label(r) for r in rows[4:6]] == ["baseline ×2", "fused_full ×2"] and bar_label(full1) == "fused_full"


def test_bench_nproc_sizes_and_run_names(capsys):
    assert bench.parse_args([]).nproc == [1]
    assert bench.parse_args(["--nproc", "1", "2"]).nproc == [1, 2]
    assert bench.parse_args(["--nproc", "2"]).nproc == [2]
    for bad, why in (("1 1", "each size once"), ("0", ">= 1"), ("two", ">= 1")):
        with pytest.raises(SystemExit):
            bench.parse_args(["--nproc", *bad.split()])
        error = capsys.readouterr().err.splitlines()[-1]
        assert "argument --nproc" in error and why in error, error
    assert bench.run_name("gpt2", "fused_full", 1) == "gpt2-fused_full"  # as before: kept runs stay valid
    assert bench.run_name("gpt2", "fused_full", 2) == "gpt2-fused_full-x2"
    opts = bench.parse_args(["--nproc", "1", "2", "--steps", "4", "--batch", "gpt2=3", "--tiny"])
    opts.warmup = 1
    for n in (1, 2):
        flags = bench.finetune_args("gpt2", "baseline", opts, Path("out"), n)
        assert flags[flags.index("--max_train_samples") + 1] == str(5 * 3 * n)


def test_bench_main_runs_every_world_size_and_reports_scaling(tmp_path, monkeypatch, capsys):
    """main() over --nproc 1 2 with the runs faked (synthetic metrics), so it takes no processes at all."""
    launched = []

    def fake_run(cmd, log, preload=False, env=None):
        launched.append((cmd, log.name))
        if cmd[1].endswith("plain_loop.py"):
            steps = _steps(38.0, 40, seed=20)
            plain = {"step_time_ms": {"p50": float(np.median(steps))}, "steps_ms": steps, "warmup_steps": 0}
            Path(cmd[2]).write_text(json.dumps(plain))
            return
        n = int(cmd[cmd.index("--nproc_per_node") + 1]) if "--nproc_per_node" in cmd else 1
        out = Path(cmd[cmd.index("--output_dir") + 1])
        out.mkdir(parents=True, exist_ok=True)
        metrics = _ddp_metrics(cmd[cmd.index("--stage") + 1], _steps(40.0 + n, 40, seed=21 + n), n)
        (out / METRICS_FILENAME).write_text(json.dumps(metrics))

    monkeypatch.setattr(bench, "run", fake_run)
    flags = "--tiny --models gpt2 --stages baseline fused_full --nproc 1 2 --steps 4 --warmup 1 --batch gpt2=3"
    monkeypatch.setattr(bench, "write_outputs", lambda rows, out_dir, banner, config: {})  # no chart: fast
    assert bench.main([*flags.split(), "--no_preload", "--out_dir", str(tmp_path)]) == 0
    assert [log for _, log in launched] == [
        "gpt2-baseline.log",
        "gpt2-baseline-plain.log",
        "gpt2-baseline-x2.log",
        "gpt2-fused_full.log",
        "gpt2-fused_full-plain.log",
        "gpt2-fused_full-x2.log",
    ]
    for name, n in (("gpt2-baseline", 1), ("gpt2-fused_full-x2", 2)):
        settings = json.loads((tmp_path / "runs" / name / "bench_settings.json").read_text())
        assert settings["nproc"] == n and settings["plain"] == (n == 1)
        assert settings["finetune"][settings["finetune"].index("--max_train_samples") + 1] == str(5 * 3 * n)
    ddp = [cmd for cmd, log in launched if log.endswith("-x2.log")]
    assert all(cmd[cmd.index("--nproc_per_node") + 1] == "2" for cmd in ddp)
    assert not any("--nproc_per_node" in cmd for cmd, log in launched if "-x2" not in log)
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].endswith(" | 1 and 2 processes per run (DDP)")
    assert re.search(r"^\| gpt2 \| fused_full \| 2 \| .* \| \d\.\d\d× \[\d\.\d\d, \d\.\d\d\] \|$", printed, re.M)
    assert re.search(r"^\| gpt2 \| fused_full \| 1 \| .* \| – \|$", printed, re.M)


def test_a_failed_run_is_reported_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    launched = []

    def fake_run(cmd, log, preload=False, env=None):
        launched.append(log.name)
        if log.name == "gpt2-fused_full.log":
            raise bench.RunFailed(f"bench: ... failed (exit 1); log {log}:\nCUDA error: out of memory")
        if cmd[1].endswith("plain_loop.py"):
            steps = _steps(38.0, 40, seed=1)
            plain = {"step_time_ms": {"p50": float(np.median(steps))}, "steps_ms": steps, "warmup_steps": 0}
            Path(cmd[2]).write_text(json.dumps(plain))
            return
        out = Path(cmd[cmd.index("--output_dir") + 1])
        out.mkdir(parents=True, exist_ok=True)
        stage = cmd[cmd.index("--stage") + 1]
        (out / METRICS_FILENAME).write_text(json.dumps(_ddp_metrics(stage, _steps(40.0, 40, 2), 1)))

    monkeypatch.setattr(bench, "run", fake_run)
    written = {}
    monkeypatch.setattr(bench, "write_outputs", lambda rows, out_dir, banner, config: written.update(config) or {})
    flags = "--tiny --models gpt2 --stages baseline fused_full auto --steps 4 --warmup 1 --batch gpt2=3"
    assert bench.main([*flags.split(), "--no_preload", "--out_dir", str(tmp_path)]) == 1
    assert "gpt2-auto.log" in launched and "gpt2-fused_full-plain.log" not in launched  # on after the failure
    printed = capsys.readouterr().out
    assert "CUDA error: out of memory" in printed  # the failed run's log tail, where it happened
    assert bench.data_source(bench.parse_args([]).data_dir) in printed.splitlines()[:3]  # said before any run
    assert bench.data_source(None).startswith("data: the Hub") and 'BENCH_ARGS="--data_dir DIR"' in bench.data_source(
        None
    )
    assert bench.data_source(str(tmp_path)) == f"data: {bench.portable_path(tmp_path)}"
    assert re.search(r"^\| gpt2 \| auto \|", printed, re.M) and not re.search(r"^\| gpt2 \| fused_full", printed, re.M)
    assert "bench: 1 run(s) failed and are left out of the table: gpt2-fused_full" in printed
    assert written["failed_runs"] == ["gpt2-fused_full"]


def test_outputs_carry_the_world_size_and_scaling(tmp_path):
    rows = [
        row_from_metrics("gpt2", _ddp_metrics(stage, _steps(p50, 40, seed=30 + i), n))
        for i, (stage, p50, n) in enumerate((("baseline", 100.0, 1), ("baseline", 104.0, 2)))
    ]
    add_ratios(rows)
    paths = write_outputs(rows, tmp_path, "banner | 1 and 2 processes per run (DDP)", {"nproc": [1, 2]})
    data = json.loads(paths["json"].read_text())
    assert [r["world_size"] for r in data["rows"]] == [1, 2]
    assert data["rows"][0]["scaling"] is None and data["rows"][1]["scaling"] == pytest.approx(rows[1].scaling)
    assert data["rows"][1]["scaling_ci"] == pytest.approx(list(rows[1].scaling_ci))
    assert "scaling_ci" in paths["csv"].read_text().splitlines()[0]
    assert "| GPUs |" in paths["md"].read_text()


def test_bench_repeats_run_in_rounds_and_rows_pool_them(tmp_path, monkeypatch, capsys):
    """--repeats 2: every stage once per round, the runs of a row in -r2 folders, one row per stage pooling both;
    the second round runs each plain-loop reference before its Trainer run."""
    launched = []

    def fake_run(cmd, log, preload=False, env=None):
        launched.append(log.name)
        seed = len(launched)
        if cmd[1].endswith("plain_loop.py"):
            steps = _steps(38.0, 40, seed=seed)
            plain = {"step_time_ms": {"p50": float(np.median(steps))}, "steps_ms": steps, "warmup_steps": 0}
            Path(cmd[2]).write_text(json.dumps(plain))
            return
        out = Path(cmd[cmd.index("--output_dir") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / METRICS_FILENAME).write_text(
            json.dumps(_ddp_metrics(cmd[cmd.index("--stage") + 1], _steps(40.0, 40, seed), 1))
        )

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench, "write_outputs", lambda rows, out_dir, banner, config: {})
    flags = "--tiny --models gpt2 --stages baseline fused_full --repeats 2 --steps 4 --warmup 1 --batch gpt2=3"
    assert bench.main([*flags.split(), "--no_preload", "--out_dir", str(tmp_path)]) == 0
    assert launched == [
        "gpt2-baseline.log",
        "gpt2-baseline-plain.log",
        "gpt2-fused_full.log",
        "gpt2-fused_full-plain.log",
        "gpt2-baseline-r2-plain.log",  # every other round, the plain loop first
        "gpt2-baseline-r2.log",
        "gpt2-fused_full-r2-plain.log",
        "gpt2-fused_full-r2.log",
    ]
    assert (tmp_path / "runs" / "gpt2-fused_full-r2" / METRICS_FILENAME).is_file()
    printed = capsys.readouterr().out
    assert "gpt2  fused_full     run 2/2 p50" in printed
    assert len(re.findall(r"^\| gpt2 \| ", printed, re.M)) == 2  # one row per stage
    assert "(2 runs: gpt2 baseline, gpt2 fused_full)" in printed
    # Defaults on CUDA: BERT's host-bound BF16 stages run 3 times (not fastest, device-bound under CUDA graphs), and
    # the causal LMs' auto and its two rivals; the rest once; --repeats wins.
    opts = bench.parse_args([])
    opts.tiny = False
    runs = {(m, s): bench.repeats(m, s, opts) for m in ("bert", "gpt2", "llama") for s in bench.STAGES}
    host_bound = {s for s in bench.STAGES if bench.STAGES[s].bf16 and s != "fastest"}
    assert {k for k, n in runs.items() if n == 3} == {("bert", s) for s in host_bound} | {
        (m, s) for m in ("gpt2", "llama") for s in ("fused_full", "torch_fused", "auto")
    }
    assert set(runs.values()) == {1, 3}
    opts.tiny = True
    assert bench.repeats("bert", "auto", opts) == 1
    assert bench.repeats("gpt2", "baseline", bench.parse_args(["--repeats", "4"])) == 4


def test_each_model_s_fastest_row_stands_next_to_published_numbers():
    rows = []
    for stage, mfu, n in (("fused_full", 0.13, 1), ("compiled", 0.30, 1), ("fastest", 0.45, 2)):
        m = _ddp_metrics(stage, _steps(40.0, 40, seed=70), n)
        rows.append(row_from_metrics("gpt2", {**m, "mfu": mfu}))
    rows.append(row_from_metrics("llama", {**_ddp_metrics("compiled", _steps(40.0, 40, seed=71), 1), "mfu": None}))
    lines = bench_report.best_against_published(add_ratios(rows))
    assert lines == [
        f"gpt2: fastest here compiled, 30.0% MFU, {rows[1].tokens_per_s:,.0f} tokens/s; published: "
        f"{bench_report.PUBLISHED['gpt2']}."
    ]  # one process only; a row without MFU says nothing
    assert "llm.c ~468K tokens/s per H100" in lines[0] and lines[0] in format_table(rows)


def test_a_row_whose_norms_replayed_inside_cuda_graphs_is_coloured_by_the_kernels_the_profiler_saw():
    """From the committed H200 bench: Llama's `auto` ran apex's RMSNorm inside CUDA graphs and torch's fused AdamW,
    so no call was counted, and its bar was drawn as "torch only" beside a kernels column naming apex's."""
    metrics = json.loads((REPO / "benchmarks/h200-2026-12-02-whole/runs/llama-auto" / METRICS_FILENAME).read_text())
    assert metrics["kernels"]["calls"] == {}
    assert row_from_metrics("llama", metrics).backend == "apex"
    metrics["kernels"]["profiled"]["apex"] = {}  # no apex kernel seen, no apex call counted: torch's
    assert row_from_metrics("llama", metrics).backend == "torch"


def test_compiled_rows_say_what_compilation_cost_and_when_it_is_repaid():
    """GPT-2's rows of an H200 ladder (46ca0e8:benchmarks/h200-2026-11-30-ladder/runs): their medians and first
    steps, in ms."""

    def run(stage, p50, first_ms, compiled):
        metrics = _ddp_metrics(stage, _steps(p50, 60, seed=int(p50)), 1)
        metrics["run"].update(first_step_ms=first_ms, torch_compile=compiled)
        return row_from_metrics("gpt2", metrics)

    rows = add_ratios([run("torch_fused", 109.43, 544.53, False), run("compiled", 46.57, 29618.47, True)])
    eager, compiled = rows
    assert compiled.compiled and not eager.compiled
    # 29.6 s, less the eager run's own first-step extra (0.4 s of cuBLAS and allocator warm-up)
    compile_ms = compiled.first_step_ms - compiled.step_time_ms_p50 - (eager.first_step_ms - eager.step_time_ms_p50)
    steps = compile_ms / (eager.step_time_ms_p50 - compiled.step_time_ms_p50)  # ~460 steps of 63 ms saved each
    (line,) = bench_report.compilation_costs(rows)
    expected = (
        f"compilation {compile_ms / 1e3:.1f} s (first step), repaid after {steps:,.0f} steps against torch_fused."
    )
    assert line == f"gpt2 compiled: {expected}"
    assert 400 < steps < 550 and line in format_table(rows)
    slower = dataclasses.replace(eager, step_time_ms_p50=compiled.step_time_ms_p50 - 1)
    assert "never repaid" in bench_report.compilation_costs([slower, compiled])[0]
    # the faster eager row is what compilation must repay: here a fused_full 10 ms under torch_fused
    ff = dataclasses.replace(eager, stage="fused_full", step_time_ms_p50=eager.step_time_ms_p50 - 10)
    ff_compile_ms = compiled.first_step_ms - compiled.step_time_ms_p50 - (ff.first_step_ms - ff.step_time_ms_p50)
    ff_steps = ff_compile_ms / (ff.step_time_ms_p50 - compiled.step_time_ms_p50)
    assert bench_report.compilation_costs([eager, ff, compiled])[0] == (
        f"gpt2 compiled: compilation {ff_compile_ms / 1e3:.1f} s (first step), repaid after {ff_steps:,.0f} steps "
        "against fused_full."
    )
    alone = bench_report.compilation_costs([compiled])[0]  # no eager row: the first step's whole extra
    whole = (compiled.first_step_ms - compiled.step_time_ms_p50) / 1e3
    assert alone == f"gpt2 compiled: compilation {whole:.1f} s (first step)."
    # The mode is named, and a multi-process row's scaling across modes is said to be one
    graphs = dataclasses.replace(compiled, compile_mode="reduce-overhead")
    ddp = dataclasses.replace(compiled, world_size=2)
    lines = bench_report.compilation_costs([graphs, ddp])
    assert lines[0] == f"gpt2 compiled: compilation {whole:.1f} s (first step, mode reduce-overhead)."
    assert lines[-1] == (
        "gpt2 compiled ×2: its scaling compares torch.compile mode default with the one process's torch.compile mode "
        "reduce-overhead."
    )
    assert len(bench_report.compilation_costs([compiled, ddp])) == 2  # the same mode: nothing to say
    # auto runs eager on several processes, its one process under CUDA graphs
    eager_ddp = dataclasses.replace(compiled, world_size=2, compiled=False)
    assert bench_report.compilation_costs([compiled, eager_ddp])[-1] == (
        "gpt2 compiled ×2: its scaling compares eager steps with the one process's torch.compile mode default."
    )


def test_the_plain_loop_trains_without_a_kv_cache_as_the_trainer_does(
    generated_data,  # noqa: F811
    word_tokenizer,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """Trainer.__init__ sets ``config.use_cache = args.use_cache`` (False): a plain loop that kept GPT-2's default
    built a KV cache in every training forward, work the Trainer run does not do (K and V of every layer copied)."""
    import finetune
    import plain_loop
    import torch

    opts = bench.parse_args(["--tiny", "--data_dir", str(generated_data), "--steps", "2", "--warmup", "1"])
    flags = bench.finetune_args("gpt2", "baseline", opts, tmp_path / "run", nproc=1)
    flags[flags.index("--tokenizer_name") + 1] = word_tokenizer
    models = []
    load_model = finetune.load_model
    monkeypatch.setattr(finetune, "load_model", lambda *a: models.append(load_model(*a)) or models[-1])
    plain_loop.main(str(tmp_path / "plain.json"), flags)
    (model,) = models
    assert model.config.use_cache is False
    ids = torch.randint(5, 20, (2, 8))
    assert model.train()(input_ids=ids.to(model.device)).past_key_values is None


def test_the_plain_loop_keeps_fp32_strict_as_the_trainer_does(
    generated_data,  # noqa: F811
    word_tokenizer,  # noqa: F811
    tmp_path,
):
    """ApexTrainer.train sets the backends' FP32 precision when tf32=False, for the run; a plain loop that did not ran
    its matmuls under another setting, and under torch.compile compiled graphs the Trainer run had cached under another
    key."""
    import plain_loop
    import torch

    opts = bench.parse_args(["--tiny", "--data_dir", str(generated_data), "--steps", "2", "--warmup", "1"])
    flags = bench.finetune_args("gpt2", "baseline", opts, tmp_path / "run", nproc=1)
    flags[flags.index("--tokenizer_name") + 1] = word_tokenizer
    matmul = torch.backends.cuda.matmul  # (its settings go through __getattr__: monkeypatch cannot put them back)
    before, matmul.fp32_precision = matmul.fp32_precision, "none"
    seen, train = [], plain_loop.train

    def noted_train(*args):
        seen.append(matmul.fp32_precision)
        return train(*args)

    try:
        plain_loop.train = noted_train
        plain_loop.main(str(tmp_path / "plain.json"), flags)
        assert seen == ["ieee"] and matmul.fp32_precision == "none"  # strict for the run, then as it was
    finally:
        plain_loop.train = train
        matmul.fp32_precision = before


@pytest.mark.parametrize("family, task", [("gpt2", "lm"), ("bert", "cls")])
def test_the_plain_loop_passes_the_loss_items_the_trainer_passes(tmp_path, family, task):
    """The Trainer hands a model that takes loss kwargs the batch's count of labels (a causal LM's shifted ones);
    the plain loop hands the same value in the same dtype (which depends on the transformers version), so that its
    loss divides by the same input and, compiled, its graphs are the Trainer run's."""

    from hf_apex import ApexTrainer
    from tests.test_trainer import train_args
    from tests.testing_utils import TokenDataset, tiny_model

    model = tiny_model(family).train()
    args = train_args(tmp_path, stage="baseline", max_steps=2)
    trainer = ApexTrainer(model=model, args=args, train_dataset=TokenDataset(task=task))
    passed, compute_loss = [], trainer.compute_loss

    def noted(model, inputs, *a, num_items_in_batch=None, **kw):
        passed.append((dict(inputs), num_items_in_batch))
        return compute_loss(model, inputs, *a, num_items_in_batch=num_items_in_batch, **kw)

    trainer.compute_loss = noted
    trainer.train()
    count = loss_items_counter(model, args)
    for inputs, items in passed:
        mine = count(inputs)
        assert torch.is_tensor(mine) and mine.dtype == items.dtype and mine.device == items.device
        assert mine == items


def test_the_plain_loop_compiles_under_the_trainers_settings(
    generated_data,  # noqa: F811
    word_tokenizer,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """Under `fastest` a causal LM's loss runs without the logits, so `compile_recompute_pointwise=auto` leaves the
    partitioner as it is (ApexTrainer asks the model). Asked of the compiled wrapper, which is not the fused model,
    the plain loop had recomputed pointwise results in its backward: another step than the Trainer's."""
    import plain_loop

    from hf_apex import policy
    from hf_apex.kernels.models.loss import is_fused

    opts = bench.parse_args(["--tiny", "--data_dir", str(generated_data), "--steps", "2", "--warmup", "1"])
    flags = bench.finetune_args("gpt2", "fastest", opts, tmp_path / "run", nproc=1)
    flags[flags.index("--tokenizer_name") + 1] = word_tokenizer
    flags += ["--torch_compile_backend", "eager"]  # (Dynamo only: the settings are decided before Inductor)
    asked, settings = [], policy.compile_settings

    def noted(args, model):
        asked.append((is_fused(model), settings(args, model)))
        return asked[-1][1]

    monkeypatch.setattr(policy, "compile_settings", noted)  # (the plan decides them once, on the converted model)
    plain_loop.main(str(tmp_path / "plain.json"), flags)
    # the fused model: no recomputation; torch's own dropout kernels, as the stage sets
    assert asked and all(fused for fused, _ in asked)
    for _, chosen in asked:
        assert "ban_recompute_materialized_backward" not in chosen.get("torch._functorch.config", {})
        assert chosen["torch._inductor.config"]["fallback_random"] is True


def test_the_stock_rows_run_transformers_trainer_with_their_flags_and_no_stage():
    opts = bench.parse_args(["--tiny", "--steps", "4"])
    opts.warmup = 1
    for row, flags in bench.REFERENCES.items():
        args = bench.finetune_args("llama", row, opts, Path("out"))
        assert ("--stage" in args) == ("--stage_recipe" in args) == (row == "trl_sft_fastest")  # (min_steps 0)
        assert args[args.index("--trainer") + 1] == ("trl_sft" if row.startswith("trl_sft") else "stock")
        assert " ".join(flags) in " ".join(args)
        compiled = row.endswith("compiled") or row == "trl_sft"
        assert ("--torch_compile" in args) == compiled
        assert bench.compiles(row) == (compiled or row == "trl_sft_fastest")
        assert ("--use_liger_kernel" in args) == row.startswith("liger")
    stage_args = bench.finetune_args("llama", "fastest", opts, Path("out"))
    assert stage_args[stage_args.index("--stage") + 1] == "fastest" and "--trainer" not in stage_args


def test_the_families_set_and_its_default_rows():
    def rows(flags: str, cuda: bool = True):
        opts = bench.parse_args(flags.split())
        bench.choose_rows(opts, cuda)
        return opts.models, opts.stages

    default_rows = [*bench.STAGES, "stock_compiled", "liger", "liger_compiled"]
    assert rows("") == (["bert", "gpt2", "llama"], default_rows)  # all eight stages, then the stock rows
    assert rows("", cuda=False) == (["bert", "gpt2"], list(bench.SEED_STAGES))
    families = ["roberta", "qwen3", "pythia", "llama1b"]
    assert rows("--models families") == (families, ["stock_compiled", "fastest", "liger", "liger_compiled"])
    assert rows("--models llama1b families") == (
        ["llama1b", "roberta", "qwen3", "pythia"],
        rows("--models families")[1],
    )
    assert rows("--models families gpt2 --stages fastest") == ([*families, "gpt2"], ["fastest"])
    assert rows("--models default families")[1] == default_rows
    natural = ["gpt2nat", "llamanat", "llama1bnat", "bertnat", "robertanat"]
    assert rows("--models natural") == (natural, ["stock", "stock_compiled", "trl_sft", "trl_sft_fastest", "fastest"])
    assert set().union(*bench.SETS.values()) == set(bench.MODELS) == set(bench.TINY)


def test_natural_rows_pad_or_pack_the_same_pool_of_examples():
    opts = bench.parse_args(["--steps", "20"])
    opts.warmup, opts.tiny = 10, False

    def flags(model, row):
        args = bench.finetune_args(model, row, opts, Path("out"))
        return {f: args[args.index(f) + 1] for f in ("--per_device_train_batch_size", "--max_train_samples")}, args

    padded, args = flags("gpt2nat", "stock_compiled")
    packed, packed_args = flags("gpt2nat", "fastest")
    assert padded["--per_device_train_batch_size"] == "16" and packed["--per_device_train_batch_size"] == "5"
    assert padded["--max_train_samples"] == packed["--max_train_samples"] == str(30 * 5 * 8)  # one pool
    assert "paragraphs" in args and "paragraphs" in packed_args and "--pad_to_max_length" not in args
    assert flags("gpt2nat", "trl_sft")[0]["--per_device_train_batch_size"] == "5"  # TRL packs rows too
    assert flags("gpt2nat", "trl_sft_fastest")[0]["--per_device_train_batch_size"] == "5"
    assert bench.why_skipped("bertnat", "trl_sft_fastest") == bench.why_skipped("bertnat", "trl_sft") is not None
    assert flags("bertnat", "fastest")[0]["--per_device_train_batch_size"] == "128"  # buckets: examples
    assert "--pad_to_max_length" not in flags("bertnat", "stock")[1]
    assert bench.why_skipped("bertnat", "trl_sft") == "TRL's SFTTrainer trains causal LMs; this model classifies"


def test_rows_of_other_real_tokens_a_step_compare_by_real_tokens_per_second():
    def natural(stage, p50, tokens_per_step, padding):
        m = _metrics(stage, p50, 5.0, [2.0] * 5, {}, {"apex": {}})
        m["step_time_ms"]["mean"] = p50
        m["tokens_per_s"], m["padding_share"] = tokens_per_step / p50 * 1e3, padding
        m["batches"] = {"compiled_graphs": 1, "cuda_graphs": 2}
        return row_from_metrics("gpt2nat", m)

    stock, packed = natural("stock_compiled", 20.0, 2400, 0.54), natural("fastest", 15.0, 5000, 0.02)
    add_ratios([stock, packed])
    # the same step-time ratio (20 / 15) would say 1.33x: the packed step also holds 5000 / 2400 of the real tokens
    assert packed.speedup_vs_stock == pytest.approx(20 / 15 * 5000 / 2400)
    table = format_table([stock, packed])
    assert "vs stock_compiled (real tokens/s)" in table and "| 2.0% | 1 / 2 |" in table


def test_a_rows_batch_is_the_largest_shape_it_trained_on():
    # TRL's padding-free collator flattens 5 packed examples into one row: the table says 1x5120, not 5x5120
    m = _metrics("trl_sft", 39.0, 3.8, [2.0] * 5, {}, {"apex": {}})
    m["run"] = {"per_device_train_batch_size": 5, "seq_len": 5120}
    m["batches"] = {"shapes_trained": [[1, 4236], [1, 5120], [1, 5084]], "compiled_graphs": 9, "cuda_graphs": 0}
    row = row_from_metrics("llamanat", m)
    assert (row.batch_size, row.seq_len) == (1, 5120)
    del m["batches"]  # metrics without the shapes: the arguments' batch size and the longest sequence
    assert (row_from_metrics("llamanat", m).batch_size, row_from_metrics("llamanat", m).seq_len) == (5, 5120)


def test_liger_rows_are_skipped_where_liger_has_no_kernels_and_their_failures_are_findings(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not installed
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)
    assert bench.why_skipped("llama", "liger") == "liger-kernel is not installed (pip install liger-kernel)"
    fake = type(sys)("liger_kernel.transformers.monkey_patch")
    fake.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None, "qwen3": None}
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", fake)
    assert bench.why_skipped("gpt2", "liger_compiled") == "Liger-Kernel has no kernels for gpt2"
    assert bench.why_skipped("llama1b", "liger") is None and bench.why_skipped("gpt2", "fastest") is None

    launched = []

    def fake_run(cmd, log, preload=False, env=None):
        launched.append(log.name)
        if "--use_liger_kernel" in cmd and "--torch_compile" in cmd:
            lines = ["Traceback ...", "torch._dynamo.exc.TorchRuntimeError: addmm out_dtype on fake tensors", "x"]
            raise bench.RunFailed("bench: ... failed (exit 1)", lines)
        out = Path(cmd[cmd.index("--output_dir") + 1])
        out.mkdir(parents=True, exist_ok=True)
        name = "stock_compiled" if "--torch_compile" in cmd else "liger" if "--trainer" in cmd else "fastest"
        p50 = {"stock_compiled": 50.0, "liger": 80.0, "fastest": 35.0}[name]
        (out / METRICS_FILENAME).write_text(json.dumps(_ddp_metrics(name, _steps(p50, 40, seed=len(launched)), 1)))

    monkeypatch.setattr(bench, "run", fake_run)
    written = {}
    monkeypatch.setattr(bench, "write_outputs", lambda rows, out_dir, banner, config: written.update(config) or {})
    flags = "--tiny --models gpt2 llama --stages stock_compiled fastest liger liger_compiled --no_plain_loop --steps 4"
    assert bench.main([*flags.split(), "--no_preload", "--out_dir", str(tmp_path)]) == 0  # findings, not failures
    assert not any(name.startswith("gpt2-liger") for name in launched)
    assert "llama-liger_compiled.log" in launched
    printed = capsys.readouterr().out
    assert written["not_run"] == {
        "gpt2 liger": "Liger-Kernel has no kernels for gpt2",
        "gpt2 liger_compiled": "Liger-Kernel has no kernels for gpt2",
        "llama liger_compiled": "failed: torch._dynamo.exc.TorchRuntimeError: addmm out_dtype on fake tensors",
    }
    assert "Not run: llama liger_compiled: failed: torch._dynamo.exc.TorchRuntimeError" in printed
    # every row's speedup against stock_compiled, with its interval, and the VRAM ratio
    assert re.search(r"^\| llama \| fastest \| .* \| 1\.\d\d× \[1\.\d\d, 1\.\d\d\], 1\.00× \|", printed, re.M)
    assert re.search(r"^\| llama \| liger \| .* \| 0\.6\d× \[0\.\d\d, 0\.\d\d\], 1\.00× \|", printed, re.M)
    assert re.search(r"^\| llama \| stock_compiled \| .* \| 1× \|", printed, re.M)


def test_cold_warm_runs_a_compiled_row_twice_from_empty_caches_then_with_hf_apex_s(tmp_path, monkeypatch, capsys):
    launched = []

    def fake_run(cmd, log, preload=False, env=None):
        inductor, hf_apex = Path(env["TORCHINDUCTOR_CACHE_DIR"]), Path(env["HF_APEX_CACHE"]).parent
        launched.append((log.name, inductor.is_dir(), hf_apex.is_dir()))
        assert env["TRITON_CACHE_DIR"].startswith(str(inductor))
        inductor.mkdir(parents=True)  # what a run leaves behind
        hf_apex.mkdir(parents=True, exist_ok=True)
        out = Path(cmd[cmd.index("--output_dir") + 1])
        out.mkdir(parents=True, exist_ok=True)
        warm = len(launched) == 2
        m = _ddp_metrics("fastest", _steps(35.0, 40, seed=len(launched)), 1)
        m["run"] |= {"to_step_10_s": 9.0 if warm else 45.0, "torch_compile": True}
        m["compile_cache"] = {"state": "warm" if warm else "cold"}
        (out / METRICS_FILENAME).write_text(json.dumps(m))

    monkeypatch.setattr(bench, "run", fake_run)
    written = {}
    monkeypatch.setattr(bench, "write_outputs", lambda rows, out_dir, banner, config: written.update(rows=rows) or {})
    flags = "--tiny --models gpt2 --stages fastest --cold_warm --no_plain_loop --steps 4 --warmup 1"
    (tmp_path / "caches" / "gpt2-fastest" / "hf_apex").mkdir(parents=True)  # an earlier bench's: emptied
    assert bench.main([*flags.split(), "--no_preload", "--out_dir", str(tmp_path)]) == 0
    # run 1: no Inductor cache, no hf_apex cache; run 2: a new empty Inductor cache, run 1's hf_apex cache
    assert launched == [("gpt2-fastest.log", False, False), ("gpt2-fastest-r2.log", False, True)]
    settings = [
        json.loads((tmp_path / "runs" / r / "bench_settings.json").read_text())
        for r in ("gpt2-fastest", "gpt2-fastest-r2")
    ]
    assert [s["caches"] for s in settings] == ["cold", "warm"]
    (row,) = written["rows"]
    assert row.to_step_10_s == [45.0, 9.0] and row.compile_cache == ["cold", "warm"] and row.cold_warm
    printed = capsys.readouterr().out
    assert (
        "gpt2 fastest: step 10 after 45.0 s (cold); the second run, with the first run's caches, compiled work warm: "
        "9.0 s (20% of the first)." in printed
    )
    (result,) = bench_report.result_rows({"config": {"hf_apex_commit": "abc"}, "rows": [dataclasses.asdict(row)]})
    assert (result.to_step_10_s, result.to_step_10_warm_s) == (45.0, 9.0)
    opts = bench.parse_args(["--cold_warm"])
    opts.tiny = False
    assert bench.repeats("gpt2", "fastest", opts) == 2 and bench.repeats("gpt2", "fused_full", opts) == 3
    assert bench.repeats("bert", "baseline", opts) == 1 and bench.repeats("llama1b", "stock_compiled", opts) == 1
