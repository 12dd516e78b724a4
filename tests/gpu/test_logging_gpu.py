"""A logging step on the GPU: ApexTrainer's log of the loss and gradient norm, and the stage metrics' token counts,
make no synchronising CUDA call (`torch.cuda.set_sync_debug_mode("error")` raises on one), and the token counts
read from the host copies are the batches' real ones."""

import pytest
import torch

from hf_apex import ApexTrainer
from tests.test_trainer import train_args
from tests.testing_utils import TokenDataset, require_cuda, tiny_model

pytestmark = [pytest.mark.gpu, require_cuda]
REAL = 12  # real tokens per row of 16: the rest is padding


class Padded(TokenDataset):
    def __getitem__(self, i):
        item = super().__getitem__(i)
        item["attention_mask"][REAL:] = 0
        return item


def test_a_logging_step_syncs_nothing_and_counts_the_real_tokens(tmp_path):
    args = train_args(tmp_path, stage="torch_fused", max_steps=12, logging_steps=3, use_cpu=False)
    model = tiny_model("bert", pad_token_id=0).train()
    trainer = ApexTrainer(model=model, args=args, train_dataset=Padded(task="cls"))
    checked, log = [], trainer._maybe_log_save_evaluate

    def strict_log(*a, **kw):  # a logging step but the last (which logs at once, as the stock Trainer does)
        strict = trainer.control.should_log and not trainer.control.should_training_stop
        if strict:
            checked.append(trainer.state.global_step)
            torch.cuda.set_sync_debug_mode("error")
        try:
            return log(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    trainer._maybe_log_save_evaluate = strict_log
    trainer.train()
    assert checked == [3, 6, 9]
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [3, 6, 9, 12]
    records = trainer.stage_metrics.steps
    assert len(records) == 12 and all(r.tokens == r.samples * REAL for r in records)
