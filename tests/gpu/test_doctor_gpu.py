import json
import os
import subprocess
import sys

import pytest
import torch

from hf_apex.kernels import trace
from tests.testing_utils import require_apex, require_cuda

pytestmark = [pytest.mark.gpu, require_cuda, require_apex]


def test_doctor_strict_passes_with_runtime_proof():
    out = subprocess.run(
        [sys.executable, "-m", "hf_apex", "doctor", "--strict", "--json"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and {b["backend"] for b in report["backends"].values()} == {"apex"}
    assert {"layer_norm", "rms_norm", "fused_adam"} <= set(report["runtime_proof"]["kernels"])
    # The SDPA backends --attention_backend can name: on a Hopper GPU each runs a BF16 causal training call.
    assert report["attention_backends"] == {"flash": "ok", "cudnn": "ok", "efficient": "ok", "math": "ok"}
    # The apex commit is the one built, or "unknown" -- never the HEAD of a checkout the source sits in.
    repo_head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert report["apex"]["commit"] != repo_head and report["apex"].get("commit_source")


# A child that profiles (here the CPU only, around CUDA work), as a user's script or a test's subprocess may.
CHILD_PROFILE = """
import torch
x = torch.ones(256, 256, device="cuda")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
    (x @ x).sum().item()
print(len(p.events()) > 0)
"""


def test_a_kernel_profile_leaves_no_cupti_setting_behind(monkeypatch):
    # On an H200 (torch 2.11) a child process that inherited TEARDOWN_CUPTI=1 from a profiled Trainer run hung in
    # its first profile; hf_apex sets the variable while its own profiling lasts (the Trainer: one train() call).
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    profile = trace.KernelProfile().start()
    x = torch.ones(256, 256, device="cuda")
    (x @ x).sum()
    assert profile.stop()["cuda_kernels"] >= 1
    (x @ x).sum().item()  # the CUDA call at which kineto completes the detach
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    profile.close()
    assert "TEARDOWN_CUPTI" not in os.environ
    out = subprocess.run([sys.executable, "-c", CHILD_PROFILE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]
