"""Re-render a committed bench folder's results.{md,csv,json,png} from its runs/ with the current report.

    python benchmarks/scripts/rerender_results.py benchmarks/h200-2026-12-02-whole [OUT_DIR]

For a fix to recipes/bench_report.py that changes what the table or the chart says, not what ran: the rows are
rebuilt from each run's metrics JSON and plain-loop JSON as `make bench` builds them, with the banner and the
configuration of the folder's results.json. The bench's own print stays in the folder's logs. OUT_DIR defaults to
the folder itself.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import bench_report  # noqa: E402
from bench import run_name  # noqa: E402

from hf_apex.measure.report import METRICS_FILENAME  # noqa: E402


def main(folder: Path, out: Path) -> None:
    document = json.loads((folder / "results.json").read_text())
    rows = []
    for row in document["rows"]:
        names = [run_name(row["model"], row["stage"], row["world_size"], i) for i in range(row["runs"])]
        runs = [json.loads((folder / "runs" / n / METRICS_FILENAME).read_text()) for n in names]
        plains = [folder / "runs" / f"{n}-plain.json" for n in names]
        plains = [json.loads(p.read_text()) for p in plains] if all(p.exists() for p in plains) else None
        rows.append(bench_report.row_from_runs(row["model"], runs, plains))
    bench_report.add_ratios(rows)
    paths = bench_report.write_outputs(rows, out, document["banner"], document["config"])
    print("written: " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    folder = Path(sys.argv[1])
    main(folder, Path(sys.argv[2]) if len(sys.argv) == 3 else folder)
