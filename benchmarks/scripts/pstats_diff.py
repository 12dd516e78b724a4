"""Where one profiled loop spends host time that another does not: two cProfile dumps, function by function.

    python benchmarks/scripts/pstats_diff.py TRAINER.pstats PLAIN.pstats --steps 60 [--top 40]

Reads two `pstats` files (`host_profile.py --pstats`, one run with the Trainer, one with `--plain`) that cover as
many optimizer steps, and prints the functions whose own time (tottime) per step is larger in the first, with their
calls per step in each. Paths are shown from `site-packages/` on, or from the repository's root.
"""

from __future__ import annotations

import argparse
import pstats
import re
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2]) + "/"


def own_times(path: str) -> dict[tuple, tuple[float, int]]:
    """(file, line, function) -> (own seconds, calls)."""
    out = {}
    for (file, line, func), (_, calls, tottime, _, _) in pstats.Stats(path).stats.items():
        file = file.split("site-packages/")[-1].replace(REPO, "")
        func = re.sub(r" at 0x[0-9a-f]+", "", func)  # (a function's address differs between the two processes)
        out[(file, line, func)] = tuple(map(sum, zip(out.get((file, line, func), (0.0, 0)), (tottime, calls))))
    return out


def main(argv=None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps each profile covers")
    parser.add_argument("--top", type=int, default=40)
    opts = parser.parse_args(argv)
    a, b = own_times(opts.first), own_times(opts.second)
    n = opts.steps
    total = [sum(t for t, _ in d.values()) * 1e3 / n for d in (a, b)]
    print(f"own time per step: {total[0]:.2f} ms against {total[1]:.2f} ms ({total[0] - total[1]:+.2f})")
    rows = []
    for where, (t, calls) in a.items():
        t0, calls0 = b.get(where, (0.0, 0))
        rows.append(((t - t0) * 1e3 / n, calls / n, calls0 / n, where))
    rows.sort(key=lambda r: -r[0])
    print(f"{'ms/step more':>12s}  {'calls/step':>19s}  function")
    for more, calls, calls0, (file, line, func) in rows[: opts.top]:
        print(f"{more:12.3f}  {calls:8.1f} vs {calls0:8.1f}  {file}:{line}({func})")
    return rows


if __name__ == "__main__":
    main()
