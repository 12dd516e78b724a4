"""Two GPUs (NCCL) with apex's FusedAdam kernel: FSDP2 stepping each rank's local shards, directly and through
ApexTrainer, and DDP through ApexTrainer, each matching one GPU at the same global batch and resuming from a
checkpoint where the uninterrupted run ended. The same workers as tests/test_fsdp.py (CPU, gloo, the fallback)."""

import pytest
import torch

from tests.test_fsdp import assert_params_close, assert_same, launch, launch_trainer
from tests.testing_utils import require_apex, require_cuda

pytestmark = [
    pytest.mark.gpu,
    require_cuda,
    require_apex,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def test_fsdp2_apex_fused_adam_on_two_gpus_matches_one(tmp_path):
    sharded = launch(tmp_path / "fsdp", nproc=2, cuda=True)
    single = launch(tmp_path / "single", nproc=1, cuda=True)
    assert sharded["route"] == single["route"] == ("apex", 3)  # apex's kernel ran every step
    assert sharded["sharded_state"] and sharded["steps"] == [3, 3]
    # FP32 (TF32 off); reductions run in another order on 2 GPUs than on 1
    assert_same(sharded, single, rtol=1e-4, atol=1e-5)
    assert_same(sharded["resumed"], sharded, rtol=1e-5, atol=1e-6)


# Through ApexTrainer, as users run it (transformers' fsdp flags / DDP under torchrun), with the Trainer's own
# checkpoints. FP32 stage: reductions in another order on 2 GPUs. BF16 stage: an element whose gradient is within
# BF16 rounding of zero can take one of Adam's steps (about lr = 1e-3 early on) the other way, hence atol = lr.
TOLERANCE = {"fused_adam_ln": {"rtol": 1e-4, "atol": 1e-5}, "fused_full": {"rtol": 2e-2, "atol": 1e-3}}


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("stage", ["fused_adam_ln", "fused_full"])
def test_two_gpus_through_the_trainer_match_one_and_resume(mode, stage, tmp_path):
    multi = launch_trainer(tmp_path / mode, mode, stage, cuda=True)
    single = launch_trainer(tmp_path / "single", "single", stage, cuda=True)
    assert multi["optimizer"] == single["optimizer"] == "ApexFusedAdam" and multi["route"] == ["apex", 4]
    assert multi["sharded_params"] == multi["sharded_state"] == (mode == "fsdp2")
    assert_params_close(multi["params"][0], single["params"][0], **TOLERANCE[stage])
    for rank in multi["params"][1:]:  # DDP: every rank holds the same replica
        assert_params_close(rank, multi["params"][0], rtol=0, atol=0)
    resumed = launch_trainer(tmp_path / mode, mode, stage, str(tmp_path / mode / "checkpoint-2"), cuda=True)
    assert resumed["global_step"] == 4 and resumed["route"] == ["apex", 2]
    # (embedding gradients are summed with atomics on the GPU: not bitwise from run to run)
    assert_params_close(resumed["params"][0], multi["params"][0], rtol=1e-5, atol=1e-6)
