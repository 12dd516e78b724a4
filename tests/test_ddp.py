"""DDP on CPU (gloo, 2 processes via torchrun): ranks stay identical and match 1-process training at the same global
batch, for baseline and a fused stage (torch fallbacks of the apex kernels on CPU); metrics span the ranks; a log
made on rank 0 alone does not hang (Trainer.log stays local)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_apex.measure.report import METRICS_FILENAME

WORKER = Path(__file__).with_name("ddp_worker.py")
REPO = WORKER.parents[1]


def launch(out: Path, stage: str, nproc: int, batch: int, variant: str = "", check: bool = True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    if nproc == 1:
        cmd = [sys.executable]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [*cmd, str(WORKER), str(out), stage, str(batch), *([variant] if variant else [])],
        capture_output=True,
        text=True,
        timeout=300,  # a collective in Trainer.log would hang the rank-0-only log of the worker
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0 or not check, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("stage", ["baseline", "fused_adam_ln"])
def test_two_process_ddp_matches_one_process(stage, tmp_path):
    launch(tmp_path / "ddp", stage, nproc=2, batch=2)
    launch(tmp_path / "single", stage, nproc=1, batch=4)  # same global batch of 4

    rank0 = torch.load(tmp_path / "ddp" / "params-rank0.pt")
    rank1 = torch.load(tmp_path / "ddp" / "params-rank1.pt")
    single = torch.load(tmp_path / "single" / "params-rank0.pt")
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), f"ranks diverged at {name}"
        ddp, one = rank0[name], single[name]
        if name.endswith("attn.c_attn.bias"):
            # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by a query's
            # logits): what is left is rounding noise, which Adam scales up to full steps. Compare q and v only.
            hidden = ddp.numel() // 3
            ddp, one = torch.cat([ddp[:hidden], ddp[2 * hidden :]]), torch.cat([one[:hidden], one[2 * hidden :]])
        torch.testing.assert_close(ddp, one, rtol=1e-5, atol=1e-6, msg=f"DDP vs 1 process: {name}")
    assert len(rank0) > 10  # the dumps hold the model's tensors

    ddp = json.loads((tmp_path / "ddp" / METRICS_FILENAME).read_text())
    one = json.loads((tmp_path / "single" / METRICS_FILENAME).read_text())
    assert ddp["run"]["world_size"] == 2 and one["run"]["world_size"] == 1
    # the DDP wrapper's settings as used: hf_apex's defaults (no unused-parameter search, 100 MB buckets)
    assert ddp["ddp"]["find_unused_parameters"] is False and ddp["ddp"]["static_graph"] is False
    assert ddp["ddp"]["bucket_cap_mb"] == 100 and one["ddp"] is None
    # Tokens are summed over the ranks: each step of both runs covers the same 4 x 16 tokens.
    assert ddp["run"]["steps"] == one["run"]["steps"] == 5
    tokens_per_step_ddp = ddp["tokens_per_s"] * sum(ddp["steps_ms"][1:]) / 1e3 / 4
    assert tokens_per_step_ddp == pytest.approx(64, rel=1e-3)  # steps_ms is rounded to 0.1 µs in the JSON
    assert not (tmp_path / "ddp" / "hf_apex_metrics.json.tmp").exists()


def test_an_unused_parameter_names_the_flag_that_trains_it(tmp_path):
    """hf_apex's DDP default skips the unused-parameter search; a model that needs it gets the flag named, and
    trains with it."""
    proc = launch(tmp_path / "default", "baseline", nproc=2, batch=2, variant="unused", check=False)
    assert proc.returncode != 0 and "--ddp_find_unused_parameters true" in proc.stdout + proc.stderr
    launch(tmp_path / "search", "baseline", nproc=2, batch=2, variant="unused-search")
    metrics = json.loads((tmp_path / "search" / METRICS_FILENAME).read_text())
    assert metrics["ddp"]["find_unused_parameters"] is True and metrics["run"]["steps"] == 5


def test_closing_the_process_group_frees_it_before_exit(tmp_path):
    """A DDP run that ends with hf_apex.distributed.close_process_group() frees its process group there, joining
    gloo's threads, and leaves through the interpreter's normal exit. Left to that exit, a gloo worker still
    releasing the last collective's tensors aborted finished runs now and then (SIGABRT in CI's 2-process bench)."""
    launch(tmp_path, "baseline", nproc=2, batch=2, variant="close")
    for rank in (0, 1):
        result = json.loads((tmp_path / f"close-rank{rank}.json").read_text())
        assert result["freed"], f"rank {rank}: the process group outlived close_process_group()"
        assert result["threads_after"] <= result["threads_before"] - 2, result  # gloo's worker threads, joined
