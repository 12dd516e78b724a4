"""The subclass contract and the run's state on the GPU, where `fastest` compiles with CUDA graphs, its loss without
logits and the SDPA backend it times, and `auto` runs apex's norms inside CUDA graphs (tests/test_subclass.py and
tests/test_run_state.py run the rest on a CPU)."""

import json

import pytest
import torch
from transformers import set_seed

from hf_apex import ApexTrainer
from hf_apex.measure.report import METRICS_FILENAME
from tests.test_run_state import changed, process_state
from tests.test_subclass import DistillationTrainer, LogReader
from tests.test_trainer import train_args
from tests.testing_utils import TokenDataset, require_apex, require_cuda, tiny_model

pytestmark = [pytest.mark.gpu, require_cuda, require_apex]


def gpu_args(tmp_path, stage, **kw):
    return train_args(
        tmp_path, stage=stage, use_cpu=False, max_steps=6, stage_recipe={"min_steps": 0}, metrics_warmup_steps=2, **kw
    )


def test_fastest_keeps_a_custom_loss_its_logits_and_a_log_reader_on_the_gpu(tmp_path):
    teacher = tiny_model("llama").cuda()
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    reader = LogReader()
    trainer = DistillationTrainer(
        model=tiny_model("llama").train(),
        args=gpu_args(tmp_path, "fastest"),
        train_dataset=TokenDataset(),
        eval_dataset=TokenDataset(n=8),
        callbacks=[reader],
        teacher=teacher,
    )
    trainer.train()
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    assert len(trainer.terms) == 6 and min(trainer.terms) > 0.01 and set(trainer.logits_dtypes) == {torch.float32}
    assert metrics["lm_loss"] == {
        "fused_linear_cross_entropy": False,
        "reason": "a compute_loss of the subclass reads the model's outputs, logits included",
    }
    assert metrics["run"]["torch_compile_mode"] == "reduce-overhead" and "torch_compile" not in metrics["kernels"]
    assert (
        metrics["run"]["optimizer"] == "AdamW"
        and metrics["kernels"]["attention_backend"] != "torch (PyTorch's own choice)"
    )
    assert [log["at"] for log in reader.logs] == [1, 2, 3, 4, 5, 6]
    assert reader.at_log == reader.at_step_end  # each log with its own step's model
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [2]


@pytest.mark.parametrize("stage", ["fastest", "auto"])
def test_a_gpu_run_leaves_the_process_as_it_found_it_and_takes_turns(stage, tmp_path):
    def build(out, family):
        data = TokenDataset(task="lm" if family == "llama" else "cls")
        return ApexTrainer(model=tiny_model(family).train(), args=gpu_args(out, stage), train_dataset=data)

    def train(trainer):
        set_seed(0)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    torch.backends.cuda.matmul.fp32_precision = "tf32"
    alone = train(build(tmp_path / "alone", "llama"))
    a, b = build(tmp_path / "a", "llama"), build(tmp_path / "b", "bert")
    before = process_state()
    train(b)
    assert changed(before, process_state()) == {}
    assert train(a) == pytest.approx(alone, rel=1e-4)  # (atomics in CUDA's backward: not bit-exact)
    assert changed(before, process_state()) == {}
    assert a.accelerator.mixed_precision == "bf16" and hasattr(a.model_wrapped, "_orig_mod")  # its own settings ran
