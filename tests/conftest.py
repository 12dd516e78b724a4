import os
import tempfile

import pytest
import torch

# Tests never read or write the user's hf_apex cache (autotune's decisions, the compiled work of compile_cache): the
# session gets its own, unless HF_APEX_CACHE names one.
os.environ.setdefault("HF_APEX_CACHE", os.path.join(tempfile.mkdtemp(prefix="hf_apex-tests-"), "autotune.json"))

# Without a GPU, Triton kernels (hf_apex's row kernel for the loss) can only run in Triton's CPU interpreter, which
# must be chosen before Triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.testing_utils import REQUIRE_KERNELS, missing_kernels


@pytest.fixture
def own_hf_apex_cache(tmp_path_factory, monkeypatch):
    """This test's own hf_apex cache file (``$HF_APEX_CACHE``), apart from the session's: what autotune decided and
    which runs were measured in another test cannot change what this one runs. Its path."""
    path = tmp_path_factory.mktemp("hf_apex_cache") / "autotune.json"
    monkeypatch.setenv("HF_APEX_CACHE", str(path))
    return path


def pytest_runtest_setup(item):
    if REQUIRE_KERNELS and item.get_closest_marker("gpu") and (why := missing_kernels()):
        pytest.fail(f"HF_APEX_REQUIRE_KERNELS=1 but apex's kernels cannot run here: {why}", pytrace=False)


def _fp32_flags():
    flags = {"precision": torch.get_float32_matmul_precision(), "dtype": torch.get_default_dtype()}
    if hasattr(torch.backends, "fp32_precision"):
        flags["backends"] = torch.backends.fp32_precision
        flags["matmul"] = torch.backends.cuda.matmul.fp32_precision
        flags["conv"] = torch.backends.cudnn.conv.fp32_precision
    return flags


@pytest.fixture(autouse=True)
def _no_leaked_global_state():
    """A test must not leave TF32, matmul precision or the default dtype changed for the next one (the Trainer
    and accelerate set them process-wide): restore them after each test."""
    before = _fp32_flags()
    yield
    torch.set_default_dtype(before["dtype"])
    if "backends" in before:
        torch.backends.fp32_precision = before["backends"]
        torch.backends.cuda.matmul.fp32_precision = before["matmul"]
        torch.backends.cudnn.conv.fp32_precision = before["conv"]
    torch.set_float32_matmul_precision(before["precision"])


@pytest.fixture
def seed():
    torch.manual_seed(0)
    return 0
