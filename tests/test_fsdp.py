"""FSDP2 on CPU (gloo, 2 processes via torchrun) with apex FusedAdam's code path (its torch fallback on CPU): the
update runs on each rank's local shards, the state stays sharded like the parameters, the result matches
unsharded training at the same global batch, and a save/resume through torch.distributed.checkpoint's state dicts
continues exactly."""

import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("fsdp_worker.py")
REPO = WORKER.parents[1]


def launch(out: Path, nproc: int, cuda: bool = False) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    env |= {"HF_APEX_TEST_CUDA": "1", "NCCL_NVLS_ENABLE": "0"} if cuda else {"CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [*(cmd if nproc > 1 else [sys.executable]), str(WORKER), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out / "result.pt", map_location="cpu")


def assert_same(got: dict, ref: dict, rtol=1e-5, atol=1e-6) -> None:
    assert got["params"].keys() == ref["params"].keys() and got["state"].keys() == ref["state"].keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=rtol, atol=atol, msg=name)
    for name, value in ref["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["state"][name][key], value[key], rtol=rtol, atol=1e-8, msg=name)


def test_fsdp2_fused_adam_steps_local_shards_and_matches_one_process(tmp_path):
    sharded = launch(tmp_path / "fsdp", nproc=2)
    single = launch(tmp_path / "single", nproc=1)
    assert sharded["seen"] == ["Tensor"]  # the update saw local shards, never a DTensor
    assert sharded["route"] == ("fallback", 3)  # (the fallback stands in for apex's kernel on CPU)
    assert sharded["sharded_state"] and single["steps"] == sharded["steps"] == [3, 3]
    assert_same(sharded, single)
    timed = sharded["autotune"]  # auto's optimizer timing on rank 0's local shards: decided, no hang
    assert timed["backend"] in ("apex", "torch") and timed["parity_ok"] == {"apex": True, "torch": True}
    assert timed["key"]["numel"] < single["autotune"]["key"]["numel"]  # a shard, not the whole model
    # saved after 2 steps through torch.distributed.checkpoint's state dicts (what accelerate uses for FSDP2)
    # and resumed into fresh objects, step 3 lands where the uninterrupted run did
    resumed = sharded["resumed"]
    assert resumed["sharded_state"] and resumed["steps"] == [3, 3]
    assert_same(resumed, sharded, rtol=1e-6)
