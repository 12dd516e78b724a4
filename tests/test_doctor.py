import json
import subprocess
import sys

import pytest
import torch

from hf_apex import cli, doctor
from hf_apex.import_utils import is_fused_adam_available


@pytest.mark.skipif(is_fused_adam_available() and torch.cuda.is_available(), reason="checks the no-kernel report")
def test_doctor_without_kernels_says_fallback_and_strict_fails(capsys):
    assert doctor.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert {b["backend"] for b in report["backends"].values()} == {"fallback"}
    assert report["torch"] == torch.__version__ and "transformers" in report
    assert doctor.main(["--strict"]) == 1
    text = capsys.readouterr().out
    assert "NOT OK" in text and "make apex" in text


def test_console_script_and_module_entry_points():
    out = subprocess.run(
        [sys.executable, "-m", "hf_apex", "doctor", "--json", "--no-proof"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)["backends"]) == {"fused_adam", "fused_lamb", "layer_norm", "rms_norm"}
    assert cli.main(["--help"]) == 0
    assert cli.main(["bogus"]) == 2
