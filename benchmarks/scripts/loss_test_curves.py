"""How far apart the runs of the fastest rung's loss test are, read back from its pytest log.

    python benchmarks/scripts/loss_test_curves.py LOG [--model bert] [--names fastest,torch_fused,compiled]

tests/gpu/test_fast_stage_gpu.py logs every step (`--logging_steps 1`) of each run it makes for a model, one run
after another (`fastest`, `torch_fused`, then, in the design before 281d9db, BERT's `compiled`). This splits that
model's part of the log into its runs and prints, for each pair of runs, the largest relative gap between their
10-step and 20-step means (tests/testing_utils.py's loss_curve_agreement) over the first 40, 50, 60 and all steps,
then each run's last-20 mean and evaluation. pytest prints a test's output only when it fails, so only a failed
test's log holds the curves.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.testing_utils import loss_curve_agreement  # noqa: E402

STEPS = 200  # per run, as the test trains


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--model", default="bert")
    parser.add_argument("--names", default="fastest,torch_fused,compiled")
    opts = parser.parse_args()
    text = Path(opts.log).read_text()
    start = text.find(f"test_fastest_trains_like_torch_fused_on_real_data[{opts.model}]")
    if start < 0:
        sys.exit(f"no section for {opts.model} in {opts.log}")
    part = text[start:]
    logged = [ast.literal_eval(m) for m in re.findall(r"\{'loss': [^}]*\}", part)]
    names = opts.names.split(",")
    runs = {name: [float(r["loss"]) for r in logged[i * STEPS : (i + 1) * STEPS]] for i, name in enumerate(names)}
    runs = {name: losses for name, losses in runs.items() if len(losses) == STEPS}
    evals = [ast.literal_eval(m) for m in re.findall(r"\{'eval_loss'[^}]*\}", part)]
    for a, b in itertools.combinations(runs, 2):
        for n in (40, 50, 60, STEPS):
            gaps = [loss_curve_agreement(runs[a][:n], runs[b][:n], window=w)["max_rel_gap_smoothed"] for w in (10, 20)]
            print(f"{a} vs {b}, first {n:3d} steps: max gap of 10-step means {gaps[0]:.2%}, of 20-step {gaps[1]:.2%}")
    for (name, losses), ev in zip(runs.items(), evals):
        print(f"{name}: last-20 mean {sum(losses[-20:]) / 20:.4f}, eval {ev}")


if __name__ == "__main__":
    main()
