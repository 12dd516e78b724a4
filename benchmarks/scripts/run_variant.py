"""One bench-shaped run through recipes/finetune.py with extra flags; prints a one-line summary and appends it, with
the per-step times, to $OUT/variants.jsonl (the run's log: $OUT/variant_logs/NAME.log).
usage: OUT=<dir> [MODEL=bert|gpt2|llama] python benchmarks/scripts/run_variant.py NAME NPROC STAGE STEPS [flags...]
MODEL (default gpt2) picks `make bench`'s model and shape, on the data in .deps/data; 10 warm-up steps, then STEPS.
Flags after STEPS override the bench's (the last wins; for Llama, a --config_overrides replaces the bench's), e.g.
`--torch_compile_mode reduce-overhead` or `--attention_backend flash`. Environment variables pass through;
WRAPPER=<script> runs finetune.py through it (`python WRAPPER recipes/finetune.py ...`, e.g.
benchmarks/scripts/with_config.py)."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "recipes")
import bench  # noqa: E402

name, nproc, stage, steps, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5:]
opts = bench.parse_args(["--data_dir", ".deps/data", "--nproc", str(nproc), "--steps", str(steps)])
opts.warmup, opts.tiny = 10, False
out = Path(tempfile.gettempdir()) / "variants" / name
flags = bench.finetune_args(os.environ.get("MODEL", "gpt2"), stage, opts, out) + extra
launcher = [sys.executable] + (
    ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else []
)
log = Path(os.environ["OUT"]) / "variant_logs" / f"{name}.log"
log.parent.mkdir(parents=True, exist_ok=True)
t0 = time.time()
with log.open("w") as f:
    wrapper = [os.environ["WRAPPER"]] if os.environ.get("WRAPPER") else []
    cmd = launcher + [*wrapper, "recipes/finetune.py", *flags]
    rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
wall = time.time() - t0
m = out / "hf_apex_metrics.json"
# when the process started and ended (UTC seconds since the epoch; it ends after its evaluation and metrics, 1-2 s
# after its last step): roughly where samples of the GPU taken meanwhile (device_session.sh smi) fall among its steps
row = {"name": name, "nproc": nproc, "stage": stage, "rc": rc, "wall_s": round(wall), "wrapper": wrapper or None}
row.update(started=round(t0, 2), ended=round(t0 + wall, 2))
row.update(flags=extra, torch_config=os.environ.get("TORCH_CONFIG"))  # (benchmarks/scripts/with_config.py)
if m.is_file():
    d = json.loads(m.read_text())
    row.update(
        p50=round(d["step_time_ms"]["p50"], 2),
        p20=round(d["step_time_ms"]["p20"], 2),
        p80=round(d["step_time_ms"]["p80"], 2),
        tok_s=round(d["tokens_per_s"]),  # real (non-padding) tokens
        padding=d.get("padding_share"),
        batches=d.get("batches"),
        mfu=d["mfu"],
        mem=round(d["peak_memory_allocated_gib"], 2),
        first_ms=round(d["run"]["first_step_ms"]),
        compile_mode=d["run"].get("torch_compile_mode"),
        ddp=d.get("ddp"),
        world=d["run"]["world_size"],
        loss=d["loss"],
        steps_ms=d["steps_ms"],
        loss_history=d.get("loss_history"),
        mem_reserved=d.get("peak_memory_reserved_gib"),
    )
with open(Path(os.environ["OUT"]) / "variants.jsonl", "a") as f:
    f.write(json.dumps(row) + "\n")
print({k: v for k, v in row.items() if k not in ("steps_ms", "loss_history")}, flush=True)
