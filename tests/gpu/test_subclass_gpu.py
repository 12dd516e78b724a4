"""The subclass contract and the run's state on the GPU, where `fastest` compiles with CUDA graphs, its loss without
logits and the SDPA backend it times, and `auto` runs apex's norms inside CUDA graphs (tests/test_subclass.py and
tests/test_run_state.py run the rest on a CPU)."""

import json

import pytest
import torch
from transformers import set_seed

from hf_apex import ApexTrainer
from hf_apex.kernels.models.attention import STATIC_MASKS
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
    # six steps, and the forward that fastest's SDPA choice captures the model's first attention call from
    assert len(trainer.terms) == 7 and min(trainer.terms) > 0.01 and set(trainer.logits_dtypes) == {torch.float32}
    assert metrics["lm_loss"] == {
        "fused_linear_cross_entropy": False,
        "reason": "DistillationTrainer.compute_loss computes the loss from the model's outputs itself",
    }
    assert metrics["run"]["torch_compile_mode"] == "reduce-overhead" and "torch_compile" not in metrics["kernels"]
    assert (
        metrics["run"]["optimizer"] == "AdamW"
        and metrics["kernels"]["attention_backend"] != "torch (PyTorch's own choice)"
    )
    assert [log["at"] for log in reader.logs] == [1, 2, 3, 4, 5, 6]
    assert reader.at_log == reader.at_step_end  # each log with its own step's model
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [2]


def test_fastest_and_auto_take_turns_each_with_its_own_settings_and_leave_the_process_as_they_found_it(tmp_path):
    """Built one after the other, trained in the other order: each runs compiled as its stage asks (accelerate's
    process-wide state, which the second Trainer built overwrites, is its own again) and leaves nothing behind."""

    def build(out, stage, family):
        data = TokenDataset(task="lm" if family == "llama" else "cls")
        return ApexTrainer(model=tiny_model(family).train(), args=gpu_args(out, stage), train_dataset=data)

    torch.backends.cuda.matmul.fp32_precision = "tf32"  # (not torch's default: a run that resets it is caught)
    fastest, auto = build(tmp_path / "fastest", "fastest", "llama"), build(tmp_path / "auto", "auto", "bert")
    for trainer, backend in ((auto, "cudagraphs"), (fastest, "inductor")):
        before = process_state()
        set_seed(0)
        trainer.train()
        assert changed(before, process_state()) == {}
        assert trainer.accelerator.mixed_precision == "bf16"
        assert trainer.model_wrapped._orig_mod is trainer.model and trainer.args.torch_compile_backend == backend
    assert fastest.model.config._attn_implementation != STATIC_MASKS  # its masks decided on the host: the run's only
