import pytest
import torch

from hf_apex.counters import KERNEL_COUNTER


@pytest.fixture(autouse=True)
def _fresh_counter():
    KERNEL_COUNTER.reset()
    yield


@pytest.fixture
def seed():
    torch.manual_seed(0)
    return 0
