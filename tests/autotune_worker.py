"""Run by tests/test_autotune.py under torchrun (2 processes, gloo): rank 0 fails while deciding for all ranks;
every rank must stop with an error instead of rank 1 waiting for a decision that never comes.

torchrun --nproc_per_node 2 tests/autotune_worker.py
"""

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_apex.autotune import Autotuner, DecisionCache  # noqa: E402
from tests.testing_utils import leave_worker  # noqa: E402


def failing_prepare():
    raise ValueError("no candidate can run")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    tuner = Autotuner(DecisionCache(Path(sys.argv[1]) / f"cache-{dist.get_rank()}.json"))
    try:
        tuner.choose("norms", {"k": 1}, failing_prepare, same_on_all_ranks=True)
    except Exception as exc:
        sys.stdout.write(f"rank {dist.get_rank()} raised {type(exc).__name__}: {exc}\n")
        sys.stdout.flush()
        dist.barrier()
        dist.destroy_process_group()
        leave_worker(3)
    dist.destroy_process_group()
    leave_worker()
