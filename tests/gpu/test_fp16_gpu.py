"""FP16 through the ladder: `fused_full --amp_dtype fp16` (a GradScaler with apex FusedAdam) trains a few hundred
steps, follows the BF16 run's loss, and counts the steps the scaler skipped."""

import json

import pytest
import torch
import transformers

from hf_apex import ApexTrainer, ApexTrainingArguments
from hf_apex.measure.report import METRICS_FILENAME
from tests.testing_utils import loss_curve_agreement, require_apex, require_cuda

pytestmark = [pytest.mark.gpu, require_cuda, require_apex]
STEPS = 300


class Progressions(torch.utils.data.Dataset):
    """Arithmetic progressions mod 1000 with a random start and stride: learnable, so the loss falls far."""

    def __init__(self, n: int, seq: int = 128):
        g = torch.Generator().manual_seed(0)
        start, stride = torch.randint(0, 1000, (n, 1), generator=g), torch.randint(1, 9, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq)) % 1000

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(out, amp_dtype):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000))
    args = ApexTrainingArguments(
        output_dir=str(out),
        stage="fused_full",
        amp_dtype=amp_dtype,
        apex_strict_kernels=True,
        max_steps=STEPS,
        per_device_train_batch_size=16,
        learning_rate=1e-3,
        warmup_steps=0.05,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = ApexTrainer(model=model, args=args, train_dataset=Progressions(STEPS * 16))
    trainer.train()
    return trainer, json.loads((out / METRICS_FILENAME).read_text())


@pytest.mark.slow
def test_fp16_with_a_grad_scaler_follows_the_bf16_run(tmp_path):
    fp16, fp16_metrics = train(tmp_path / "fp16", "fp16")
    _, bf16_metrics = train(tmp_path / "bf16", "bf16")
    assert fp16_metrics["run"]["precision"] == "fp16" and fp16_metrics["kernels"]["calls"]["optimizer"]["apex"] > 0
    # The scaler starts at 2**16 and halves on each overflow (no growth within 2000 steps): every halving is a
    # skipped step, and the metrics must count exactly those.
    scale = fp16.accelerator.scaler.get_scale()
    assert fp16_metrics["skipped_steps"] == round(torch.log2(torch.tensor(65536.0 / scale)).item())
    losses = {
        name: [h["loss"] for h in m["loss_history"]] for name, m in (("fp16", fp16_metrics), ("bf16", bf16_metrics))
    }
    assert losses["fp16"][-1] < 0.5 * losses["fp16"][0]  # it learned
    # FP16 has more mantissa than BF16, but its skipped steps shift the curve by a few steps while the loss falls
    # fast: 20-step means within 10 % after the first 50 steps, the last 20 steps within 5 %.
    agreement = loss_curve_agreement(losses["fp16"][50:], losses["bf16"][50:], window=20)
    assert agreement["max_rel_gap_smoothed"] < 0.10 and agreement["final_rel_gap"] < 0.05, agreement
