"""recipes/sft.py: TRL's SFTTrainer at a stage on a local dataset."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'hf_apex[trl]'")

from hf_apex.measure.report import METRICS_FILENAME  # noqa: E402
from tests.testing_utils import SHARED_DATA, require_shared_data  # noqa: E402

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
sys.path.insert(0, str(RECIPES))
import sft  # noqa: E402

TINY_LLAMA = "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2"


def paragraphs(path: Path, n: int) -> Path:
    """The first ``n`` paragraphs of WikiText-2's training split as a jsonl of ``text``."""
    lines = [line.strip() for line in open(SHARED_DATA / "wikitext-2" / "train.txt") if len(line) > 80][:n]
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return path


def flags(train: Path, out: Path, *extra: str) -> list[str]:
    return [
        *("--train_file", str(train), "--model_type", "llama", "--config_overrides", TINY_LLAMA),
        *("--tokenizer_name", str(SHARED_DATA / "tokenizers" / "gpt2"), "--output_dir", str(out)),
        *("--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no", "--seed", "0"),
        *("--max_length", "128", "--per_device_train_batch_size", "2", "--logging_steps", "1"),
        *extra,
    ]


@require_shared_data
def test_sft_trains_local_documents_at_a_stage(tmp_path):
    train, valid = paragraphs(tmp_path / "train.jsonl", 48), paragraphs(tmp_path / "valid.jsonl", 8)
    out = tmp_path / "out"
    metrics = sft.main(
        flags(
            train, out, "--eval_file", str(valid), "--stage", "fused_adam_ln", "--packing", "true", "--max_steps", "3"
        )
    )
    assert metrics["eval_loss"] > 0 and metrics["train_loss"] > 0
    m = json.loads((out / METRICS_FILENAME).read_text())
    assert m["stage"] == "fused_adam_ln" and m["batches"]["layout"] == "the trainer's own"
    assert m["kernels"]["calls"]["rms_norm"]["fallback"] > 0 and m["kernels"]["calls"]["optimizer"]["fallback"] == 3
    assert m["padding_share"] == 0 and m["run"]["steps"] == 3  # TRL's padding-free rows
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda p: p.with_suffix(".csv").write_text("sentence,label\nfine,1\n"), "columns ['sentence', 'label']"),
        (lambda p: p.with_suffix(".xml").write_text("<a/>"), "a .xml file; give one of .jsonl"),
        (lambda p: None, "--train_file {tmp}/data.csv: no such file."),
    ],
)
def test_bad_data_is_one_line_before_the_model_loads(make, says, tmp_path):
    make(tmp_path / "data")
    train = next(tmp_path.glob("data.*"), tmp_path / "data.csv")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(RECIPES.parent)}
    cmd = [sys.executable, str(RECIPES / "sft.py"), "--train_file", str(train), "--model_type", "llama"]
    out = subprocess.run(
        [*cmd, "--tokenizer_name", "unused", "--output_dir", str(tmp_path / "o"), "--use_cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]  # (before it: TRL's and datasets' own warnings and progress)
    assert last.startswith("sft.py: error: ") and "Traceback" not in out.stderr, out.stderr
    assert says.format(tmp=tmp_path) in last
    assert not (tmp_path / "o").exists()
