import json
import subprocess
import sys

import pytest

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
