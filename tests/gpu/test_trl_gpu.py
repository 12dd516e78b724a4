"""TRL's SFTTrainer at ``fastest`` on a GPU (``hf_apex.with_stages``): the stock compiled SFTTrainer's loss curve, on
TRL's packed batches laid out in one shape.

Both runs see the same packed examples in the same order (TRL packs, the same seed shuffles); the stock run takes
each batch as one flattened row, ``fastest`` as rows of ``max_length`` (hf_apex.data.as_rows), with its compiled
steps (without CUDA graphs, which TRL's loss cannot run under: hf_apex.compose.graphs_blocker) and BF16 autocast in
both. Tolerance: the 10-step moving averages within 3 % of each other
over 60 steps at learning rate 1e-3. BF16 rounds each matmul's inputs to about 0.4 %, and two optimizers that differ
by that much a step drift apart slowly while the loss falls fast; a layout that broke the documents' masks or
targets moves the curve by far more (the CPU test holds the per-batch loss to 1e-5 in FP32,
tests/test_compose.py)."""

import json

import pytest
import torch

from hf_apex import with_stages
from hf_apex.measure.report import METRICS_FILENAME
from tests.testing_utils import (
    VOCAB,
    loss_curve_agreement,
    require_apex,
    require_cuda,
    tiny_model,
    word_level_tokenizer,
)

pytestmark = [pytest.mark.gpu, require_cuda, require_apex]
trl = pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'hf_apex[trl]'")
from datasets import Dataset  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

STEPS, ROWS, LENGTH = 60, 4, 64


def documents(n=1200, seed=0):
    """Learnable documents of 4 to 40 tokens: counting from a random token in steps of 1 to 3."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start, step, size = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((0, VOCAB), (1, 4), (4, 41)))
        out.append([3 + (start + i * step) % (VOCAB - 3) for i in range(size)])
    return Dataset.from_dict({"input_ids": out})


def sft(trainer_cls, config_cls, family, out, **kw):
    torch._dynamo.reset()
    args = config_cls(
        output_dir=str(out),
        report_to="none",
        max_steps=STEPS,
        per_device_train_batch_size=ROWS,
        max_length=LENGTH,
        packing=True,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-3,
        bf16=True,
        disable_tqdm=True,
        seed=0,
        **kw,
    )
    model = tiny_model(
        family, **({"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if family == "gpt2" else {})
    )
    trainer = trainer_cls(
        model=model.cuda().train(), args=args, train_dataset=documents(), processing_class=word_level_tokenizer()
    )
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sft_at_fastest_follows_the_stock_compiled_sft_trainer_in_one_shape(family, tmp_path):
    _, stock = sft(SFTTrainer, SFTConfig, family, tmp_path / "stock", torch_compile=True, optim="adamw_torch_fused")
    trainer, ours = sft(
        with_stages(SFTTrainer),
        with_stages(SFTConfig),
        family,
        tmp_path / "fastest",
        stage="fastest",
        stage_recipe={"min_steps": 0},
    )
    metrics = json.loads((tmp_path / "fastest" / METRICS_FILENAME).read_text())
    assert metrics["run"]["torch_compile"] and metrics["run"]["torch_compile_mode"] is None  # (no CUDA graphs:)
    assert metrics["kernels"]["cuda_graphs"].startswith("not used: SFTTrainer.compute_loss selects the labelled")
    assert metrics["batches"]["layout"] == "rows" and metrics["batches"]["shapes_trained"] == [[ROWS, LENGTH]]
    assert len(ours) == len(stock) == STEPS
    agreement = loss_curve_agreement(ours, stock, window=10)
    assert agreement["max_rel_gap_smoothed"] < 0.03, agreement
    assert sum(ours[-10:]) < 0.7 * sum(ours[:10])  # (and the curve fell: a test of agreement on a plateau is weak)
