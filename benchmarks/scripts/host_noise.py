"""Where BERT's run-to-run spread comes from: the same plain-loop run (BERT-base 128x128, one stage) several times in
a few host settings, in rounds, with the GPU's clocks sampled alongside.

usage: python benchmarks/scripts/host_noise.py OUT_DIR [--runs 3] [--stage fused_full] [--steps 100] [--data_dir DIR]

Settings, each a fresh process per run: `default` (as make bench), `cores0-7` (the process and its loader workers
on cores 0-7, `taskset`), `workers0` (no loader worker processes) and `omp1` (OMP_NUM_THREADS=1). nvidia-smi
samples SM clock, power and utilisation every 100 ms during each run. OUT_DIR/summary.json holds, per setting,
each run's median step time, the spread between runs, and the SM clock while the GPU was busy; the per-step
times and the samples stay beside it.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import bench  # noqa: E402

from hf_apex.kernels.apex.availability import portable_path  # noqa: E402

SETTINGS = {
    "default": ([], {}, []),
    "cores0-7": (["taskset", "-c", "0-7"], {}, []),
    "workers0": ([], {}, ["--dataloader_num_workers", "0"]),
    "omp1": ([], {"OMP_NUM_THREADS": "1"}, []),
}
QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu"


def _number(text: str) -> bool:
    return text.strip().replace(".", "", 1).isdigit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stage", default="fused_full")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--tiny", action="store_true", help="a tiny BERT (a smoke test of this script, e.g. on a CPU)")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    opts = bench.parse_args(["--steps", str(args.steps)] + (["--data_dir", args.data_dir] if args.data_dir else []))
    opts.warmup, opts.tiny = 10, args.tiny
    smi = shutil.which("nvidia-smi")
    results = {name: [] for name in SETTINGS}
    for run in range(args.runs):
        for name, (prefix, env, extra) in SETTINGS.items():
            tag = f"{name}-r{run + 1}"
            flags = bench.finetune_args("bert", args.stage, opts, out / "runs" / tag) + extra
            cmd = prefix + [sys.executable, "recipes/plain_loop.py", str(out / f"{tag}.json"), *flags]
            sampler = None
            if smi:
                samples = (out / f"{tag}-smi.csv").open("w")
                sampler = subprocess.Popen(
                    [smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"], stdout=samples
                )
            t0 = time.time()
            with (out / f"{tag}.log").open("w") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}).returncode
            if sampler:
                sampler.terminate()
                sampler.wait()
            row = {"run": run + 1, "rc": rc, "wall_s": round(time.time() - t0, 1)}
            if rc == 0:
                d = json.loads((out / f"{tag}.json").read_text())
                timed = d["steps_ms"][d["warmup_steps"] :]
                row |= {
                    "p50_ms": round(statistics.median(timed), 2),
                    "halves_ms": [
                        round(statistics.median(timed[: len(timed) // 2]), 2),
                        round(statistics.median(timed[len(timed) // 2 :]), 2),
                    ],
                }
            if smi:
                samples = [line.split(",") for line in (out / f"{tag}-smi.csv").read_text().splitlines()]
                # The clock while the GPU worked (utilisation above 0): start-up idles at the lowest clock.
                clocks = [
                    float(f[1])
                    for f in samples
                    if len(f) == 5 and all(_number(x) for x in (f[1], f[4])) and float(f[4]) > 0
                ]
                if clocks:
                    row |= {
                        "busy_samples": len(clocks),
                        "sm_clock_mhz": {"min": min(clocks), "median": statistics.median(clocks), "max": max(clocks)},
                    }
            results[name].append(row)
            print(name, row, flush=True)
    summary = {}
    for name, rows in results.items():
        p50 = [r["p50_ms"] for r in rows if "p50_ms" in r]
        summary[name] = {
            "runs": rows,
            "spread_between_runs": round(max(p50) / min(p50) - 1, 4) if len(p50) > 1 else None,
        }
    argv = [portable_path(a) if a.startswith("/") else a for a in sys.argv[1:]]
    summary["command"] = " ".join(["python", "benchmarks/scripts/host_noise.py", *argv])
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for name, s in summary.items():
        if name != "command":
            print(f"{name:10s} spread {s['spread_between_runs']}  p50s {[r.get('p50_ms') for r in s['runs']]}")


if __name__ == "__main__":
    main()
