"""Every stage trains BERT-base-shaped and GPT-2-small-shaped models on the GPU, and the profiler shows which
kernels ran: apex's in the fused stages, none of apex's in baseline."""

import json

import pytest
import torch
import transformers

from hf_apex import STAGES, ApexTrainer, ApexTrainingArguments
from hf_apex.measure.report import METRICS_FILENAME
from tests.testing_utils import TokenDataset, require_apex, require_cuda

pytestmark = [pytest.mark.gpu, require_cuda, require_apex]

MODELS = {
    # BERT-base shape (12 x 768, 110M) for classification, GPT-2 small (12 x 768, 124M) for causal LM.
    "bert-base": (
        lambda: transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2)),
        "cls",
        128,
        32,
    ),
    "gpt2-small": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config()), "lm", 512, 8),
}


@pytest.mark.parametrize("stage", list(STAGES)[:4])
@pytest.mark.parametrize("name", list(MODELS))
def test_stage_trains_20_steps_with_the_right_kernels(name, stage, tmp_path):
    build, task, seq, batch = MODELS[name]
    torch.manual_seed(0)
    model = build()
    vocab = model.config.vocab_size
    args = ApexTrainingArguments(
        output_dir=str(tmp_path),
        stage=stage,
        apex_strict_kernels=stage != "baseline",
        max_steps=20,
        per_device_train_batch_size=batch,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        learning_rate=1e-4,
        metrics_warmup_steps=5,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = ApexTrainer(
        model=model, args=args, train_dataset=TokenDataset(n=20 * batch, seq=seq, task=task, vocab=vocab)
    )
    trainer.train()
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())

    losses = [h["loss"] for h in metrics["loss_history"]]
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))
    assert metrics["run"]["timed_steps"] == 15 and metrics["step_time_ms"]["p50"] > 0
    assert metrics["peak_memory_allocated_gib"] > 0 and 0 < metrics["mfu"] < 1

    profiled = metrics["kernels"]["profiled"]["apex"]
    calls = metrics["kernels"]["calls"]
    if stage == "baseline":
        assert profiled == {} and calls == {}
        return
    assert "fused_adam" in profiled and calls["optimizer"]["apex"] == 20 and calls["optimizer"]["fallback"] == 0
    if STAGES[stage].apex_fused_norms:
        assert "layer_norm" in profiled
        assert calls["layer_norm"]["apex"] > 0 and calls["layer_norm"]["fallback"] == 0
    else:
        assert "layer_norm" not in profiled and "layer_norm" not in calls
