"""FSDP2 on CPU (gloo, 2 processes via torchrun) with apex FusedAdam's code path (its torch fallback on CPU): the
update runs on each rank's local shards, the state stays sharded like the parameters, the result matches
unsharded training at the same global batch, and a save/resume through torch.distributed.checkpoint's state dicts
continues exactly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

WORKER = Path(__file__).with_name("fsdp_worker.py")
REPO = WORKER.parents[1]


def run_worker(worker: Path, args: list[str], nproc: int, cuda: bool, timeout: int) -> subprocess.CompletedProcess:
    """``worker`` with ``args``: alone for one process, under torchrun for more; CPU (gloo) unless ``cuda``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    env |= {"HF_APEX_TEST_CUDA": "1", "NCCL_NVLS_ENABLE": "0"} if cuda else {"CUDA_VISIBLE_DEVICES": ""}
    if cuda and nproc == 1:
        env["CUDA_VISIBLE_DEVICES"] = "0"  # one process seeing two GPUs would train under nn.DataParallel
    launcher = cmd if nproc > 1 else [sys.executable]
    proc = subprocess.run(
        [*launcher, str(worker), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def launch(out: Path, nproc: int, cuda: bool = False) -> dict:
    run_worker(WORKER, [str(out)], nproc, cuda, timeout=300)
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


SHARDED_WORKER = Path(__file__).with_name("sharded_worker.py")


def launch_trainer(out: Path, mode: str, stage: str, *extra: str, cuda: bool = False) -> dict:
    """tests/sharded_worker.py: ApexTrainer for 4 steps at a global batch of 4, a checkpoint every 2 steps; its
    summary (and the parameters it dumped, rank 0's unless DDP)."""
    nproc = 1 if mode == "single" else 2
    proc = run_worker(SHARDED_WORKER, [str(out), mode, stage, *extra], nproc, cuda, timeout=600)
    suffix = "-resumed" if extra else ""
    (out / f"log{suffix}.txt").write_text(proc.stdout + proc.stderr)
    summary = json.loads((out / f"summary{suffix}.json").read_text())
    ranks = range(nproc) if mode == "ddp" else [0]
    return summary | {"params": [torch.load(out / f"params{suffix}-rank{r}.pt") for r in ranks]}


def assert_params_close(got: dict, ref: dict, rtol: float, atol: float) -> None:
    assert got.keys() == ref.keys() and len(ref) > 10
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=name)


def test_trainer_checkpoint_resumes_a_two_process_run_where_it_left_off(tmp_path):
    """DDP through ApexTrainer with apex FusedAdam's path: ranks identical, the same parameters as one process at the
    same global batch, and a run resumed from the Trainer's step-2 checkpoint ends where the uninterrupted one did.
    (FSDP2 through the Trainer: tests/gpu/test_fsdp_gpu.py; accelerate shards only on accelerators.)"""
    ddp = launch_trainer(tmp_path / "ddp", "ddp", "fused_adam_ln")
    single = launch_trainer(tmp_path / "single", "single", "fused_adam_ln")
    assert ddp["optimizer"] == single["optimizer"] == "FusedAdamFallback"  # apex's class on a GPU
    assert ddp["route"] == ["fallback", 4] and ddp["global_step"] == 4 and not ddp["sharded_params"]
    assert_params_close(ddp["params"][1], ddp["params"][0], rtol=0, atol=0)
    assert_params_close(ddp["params"][0], single["params"][0], rtol=1e-5, atol=1e-6)
    # FSDP asked for on the CPU: accelerate runs DDP instead, and ApexTrainer says so
    fsdp = launch_trainer(tmp_path / "fsdp", "fsdp2", "fused_adam_ln")
    assert not fsdp["sharded_params"] and "accelerate did not enable it" in (tmp_path / "fsdp" / "log.txt").read_text()
    assert "accelerate did not enable it" not in (tmp_path / "ddp" / "log.txt").read_text()
    assert_params_close(fsdp["params"][0], ddp["params"][0], rtol=0, atol=0)
    if Version(transformers.__version__) < Version("5.18"):
        pytest.skip("transformers < 5.18 loads a multi-process CPU run's optimizer state to 'cpu:0': torch cannot")
    resumed = launch_trainer(tmp_path / "ddp", "ddp", "fused_adam_ln", str(tmp_path / "ddp" / "checkpoint-2"))
    assert resumed["global_step"] == 4 and resumed["route"] == ["fallback", 2]  # steps 3 and 4 only
    assert resumed["losses"] == ddp["losses"]  # steps 1-2 from the checkpoint's log, 3-4 computed again
    for got, ref in zip(resumed["params"], ddp["params"]):
        assert_params_close(got, ref, rtol=0, atol=0)
