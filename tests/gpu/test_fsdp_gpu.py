"""FSDP2 on 2 GPUs (NCCL) with apex's FusedAdam kernel stepping each rank's local shards: matches one GPU at the
same global batch, and a save/resume through torch.distributed.checkpoint's state dicts continues exactly. The
same worker as tests/test_fsdp.py (CPU, gloo, the fallback)."""

import pytest
import torch

from tests.test_fsdp import assert_same, launch
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
