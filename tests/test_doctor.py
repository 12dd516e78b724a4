import json
import subprocess
import sys

import torch

from hf_apex import cli, doctor


def test_doctor_without_a_gpu_says_so_and_strict_fails(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a laptop, whatever this machine is
    assert doctor.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["gpu"] is None
    assert {b["backend"] for b in report["backends"].values()} == {"fallback"}
    assert all("no CUDA GPU" in b["why"] for b in report["backends"].values())
    assert report["backends"]["graph_norms"]["why"].startswith("the stock op inside the graphs: ")
    assert report["torch"] == torch.__version__ and "transformers" in report
    # What --attention_backend can put first here: ran a causal forward + backward, or why not.
    cuda_only = {"cudnn": "CUDA only", "efficient": "CUDA only"}
    assert report["attention_backends"] == {"flash": "ok", **cuda_only, "math": "ok"}
    assert doctor.main(["--strict"]) == 1
    text = capsys.readouterr().out
    assert "NOT OK" in text and "GPU            none: no CUDA GPU is visible" in text and "NVIDIA GPUs only" in text
    assert text.rstrip().endswith("an FP32 stage such as fused_adam_ln is the quick one on a CPU.")  # what runs here
    assert "    skipped: needs a CUDA GPU and both apex extensions" in text  # said, not a dict printed


def test_console_script_and_module_entry_points():
    out = subprocess.run(
        [sys.executable, "-m", "hf_apex", "doctor", "--json", "--no-proof"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    backends = {"fused_adam", "fused_lamb", "layer_norm", "rms_norm", "graph_norms"}
    assert set(json.loads(out.stdout)["backends"]) == backends
    assert cli.main(["--help"]) == 0


def test_a_command_typo_says_so(capsys):
    assert cli.main(["doctr"]) == 2
    assert capsys.readouterr().err.strip() == "hf-apex: error: unknown command 'doctr' (choose from: doctor)"


def test_the_runtime_proof_keeps_its_columns_apart():
    report = doctor.collect(proof=False)
    report["runtime_proof"] = {
        "kernels": {"layer_norm": ["cuApplyLayerNorm"], "norm_backward": ["cuComputeGradInput"]},
        "max_abs_diff_vs_torch": {"ln": 1e-6},
    }
    lines = doctor.format_report(report).splitlines()
    proof = [line.split() for line in lines if "cuApplyLayerNorm" in line or "cuComputeGradInput" in line]
    assert proof == [["layer_norm", "cuApplyLayerNorm"], ["norm_backward", "cuComputeGradInput"]]
    columns = {line.index("cu") for line in lines if "cuApplyLayerNorm" in line or "cuComputeGradInput" in line}
    assert len(columns) == 1  # the kernels' names line up
