"""with_stages: TRL's SFTTrainer and SFTConfig with hf_apex's stages, their own defaults, data and loss kept."""

import json
import pickle
import random

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'hf_apex[trl]'")
from datasets import Dataset  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_apex import ApexTrainer, ApexTrainingArguments, with_stages  # noqa: E402
from hf_apex.data import FLAT_ROW_KEYS, REAL_TOKENS, RowsCollator  # noqa: E402
from hf_apex.measure.report import METRICS_FILENAME  # noqa: E402
from tests.testing_utils import VOCAB, tiny_model, word_level_tokenizer  # noqa: E402

FP32_STAGES = ["baseline", "fused_adam", "fused_adam_ln"]


@pytest.fixture(scope="module")
def tokenizer():
    return word_level_tokenizer()


def documents(n=48, seed=0):
    """Pre-tokenized documents of 3 to 20 tokens (SFTTrainer takes a dataset with input_ids as it is)."""
    rng = random.Random(seed)
    return Dataset.from_dict(
        {"input_ids": [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 20))] for _ in range(n)]}
    )


def sft_args(config_cls, tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=4,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        max_length=32,
        packing=True,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
    )
    return config_cls(**{**base, **kw})


def test_the_config_keeps_trls_defaults_and_meanings_and_adds_the_stages(tmp_path):
    Config = with_stages(SFTConfig)
    assert with_stages(SFTConfig) is Config and with_stages(Config) is Config
    assert issubclass(Config, SFTConfig) and issubclass(Config, ApexTrainingArguments)
    args = Config(output_dir=str(tmp_path), use_cpu=True, report_to="none", stage="fused_adam_ln")
    stock = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    # TRL's defaults, not TrainingArguments' (5e-05, 500) that a hand-made mix takes back
    assert (args.learning_rate, args.logging_steps) == (stock.learning_rate, stock.logging_steps) == (2e-05, 10)
    assert args.stage == "fused_adam_ln" and args.apex_fused_norms and args.apex_optimizer == "fused_adam"
    # TRL's packing (a bool) keeps its meaning; fastest's packing="auto" is not set over it
    fastest = Config(output_dir=str(tmp_path), use_cpu=True, report_to="none", stage="fastest")
    assert fastest.packing is False and fastest.torch_compile and "packing" in Config.BASE_OWNED
    assert Config(output_dir=str(tmp_path), use_cpu=True, report_to="none", packing=True).packing is True
    again = pickle.loads(pickle.dumps(args))  # (checkpoints save the arguments)
    assert type(again) is Config and again.stage == "fused_adam_ln"
    assert json.loads(args.to_json_string())["stage"] == "fused_adam_ln"
    assert with_stages(Trainer) is ApexTrainer and with_stages(TrainingArguments) is ApexTrainingArguments
    with pytest.raises(TypeError, match="with_stages takes a Trainer or TrainingArguments subclass"):
        with_stages(dict)


def test_the_config_parses_from_the_command_line_with_trls_defaults(tmp_path):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(with_stages(SFTConfig)).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--stage", "fastest"]
        + ["--stage_recipe", '{"min_steps": 3}', "--packing", "true"]
    )
    assert args.stage == "fastest" and args.recipe.min_steps == 3 and args.torch_compile
    assert args.packing is True and args.learning_rate == 2e-05  # TRL's packing and default


def train(trainer_cls, config_cls, tmp_path, tokenizer, **kw):
    trainer = trainer_cls(
        model=tiny_model("llama").train(),
        args=sft_args(config_cls, tmp_path, **kw),
        train_dataset=documents(),
        processing_class=tokenizer,
    )
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_baseline_trains_as_the_stock_sft_trainer(tmp_path, tokenizer):
    # baseline is FP32 with torch's AdamW: the stock run with those two of its defaults (BF16, fused AdamW) changed
    _, stock = train(SFTTrainer, SFTConfig, tmp_path / "stock", tokenizer, bf16=False, optim="adamw_torch")
    trainer, ours = train(
        with_stages(SFTTrainer), with_stages(SFTConfig), tmp_path / "ours", tokenizer, stage="baseline"
    )
    assert trainer.args.learning_rate == 2e-05 and trainer.args.bf16 is False
    assert len(stock) == len(ours) == 4 and ours == stock  # the same maths, to the bit
    # SFTTrainer's own metrics are still logged beside the stage's
    logged = {k for h in trainer.state.log_history for k in h}
    assert {"mean_token_accuracy", "step_time_ms"} <= logged


@pytest.mark.parametrize("stage", FP32_STAGES[1:])
def test_every_fp32_stage_trains_sft_and_says_what_it_left_to_trl(stage, tmp_path, tokenizer):
    trainer, losses = train(with_stages(SFTTrainer), with_stages(SFTConfig), tmp_path, tokenizer, stage=stage)
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    assert metrics["stage"] == stage and metrics["batches"]["layout"] == "the trainer's own"
    assert "ApexSFTTrainer's data pipeline" in metrics["batches"]["why"]
    calls = metrics["kernels"]["calls"]  # (on a CPU apex's components run their torch fallbacks, and say so)
    assert calls["optimizer"]["apex"] + calls["optimizer"]["fallback"] == 4  # every step through apex's FusedAdam
    assert ("rms_norm" in calls) == (stage == "fused_adam_ln")  # the tiny Llama's norms, swapped
    if stage == "fused_adam_ln":
        assert calls["rms_norm"]["apex"] + calls["rms_norm"]["fallback"] > 0


def test_sfts_own_loss_keeps_the_logits_and_the_metrics_say_why(tmp_path, tokenizer):
    trainer = with_stages(SFTTrainer)(
        model=tiny_model("llama").train(),
        args=sft_args(with_stages(SFTConfig), tmp_path, fused_linear_cross_entropy=True, max_steps=2),
        train_dataset=documents(),
        processing_class=tokenizer,
    )
    trainer.train()
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    assert metrics["lm_loss"] == {
        "fused_linear_cross_entropy": False,
        "reason": "SFTTrainer.compute_loss computes the loss from the model's outputs itself",
    }


def test_apex_arguments_that_trl_would_replace_are_refused(tmp_path, tokenizer):
    args = ApexTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", stage="baseline")
    with pytest.raises(TypeError, match=r"^SFTTrainer replaces ApexTrainingArguments with its own config, dropping"):
        with_stages(SFTTrainer)(
            model=tiny_model("llama").train(), args=args, train_dataset=documents(), processing_class=tokenizer
        )


def test_a_compiled_run_lays_trls_padding_free_batches_out_as_rows_of_one_shape(tmp_path, tokenizer):
    # TRL's packing flattens each batch into one row as long as its examples: a new length nearly every step, which
    # a compiled run would meet as a new shape. A run that compiles gets rows of max_length instead, one example each.
    Config = with_stages(SFTConfig)
    args = sft_args(Config, tmp_path, torch_compile=True, bf16=False, per_device_train_batch_size=3)
    trainer = with_stages(SFTTrainer)(
        model=tiny_model("llama").train(), args=args, train_dataset=documents(), processing_class=tokenizer
    )
    collator = trainer.batches.collator
    trl_collator = collator.collator
    assert isinstance(collator, RowsCollator) and trl_collator.padding_free
    assert trainer.batches.report["layout"] == "rows" and trainer.batches.report["row_length"] == 32
    batches = list(trainer.get_train_dataloader())
    assert {tuple(b["input_ids"].shape) for b in batches} == {(3, 32)} and len(batches) > 2
    assert not FLAT_ROW_KEYS & set(batches[0])  # (the flattened row's bounds: the model reads the positions)
    # The same tokens, targets and losses as TRL's flattened batch of the same examples
    model = tiny_model("llama").float()
    examples = [trainer.train_dataset[i] for i in range(3)]
    flat, rows = trl_collator(examples), collator(examples)
    real = rows.pop(REAL_TOKENS)
    assert real == flat["input_ids"].shape[1] == sum(len(e["input_ids"]) for e in examples)
    kept = rows["labels"] != -100
    assert torch.equal(rows["labels"][kept], flat["labels"][flat["labels"] != -100])
    assert torch.equal(rows["position_ids"][rows["input_ids"] != 0], flat["position_ids"][0])
    with torch.no_grad():
        ours, theirs = model(**rows, use_cache=False).loss, model(**flat, use_cache=False).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # A run that does not compile keeps TRL's batches as they are
    eager = with_stages(SFTTrainer)(
        model=tiny_model("llama").train(),
        args=sft_args(Config, tmp_path, stage="fused_adam"),
        train_dataset=documents(),
        processing_class=tokenizer,
    )
    assert eager.batches is None and type(eager.data_collator) is type(trl_collator)


def test_trls_loss_compiles_without_cuda_graphs_and_the_metrics_say_why(tmp_path, tokenizer):
    # TRL's loss selects the labelled positions (shapes known only from the data): under CUDA graphs its backward
    # failed to record on an H100 (tests/gpu/test_trl_gpu.py), so a mode that records them falls back to Inductor's
    from hf_apex.compose import graphs_blocker

    assert graphs_blocker(SFTTrainer).startswith("SFTTrainer.compute_loss selects the labelled positions")
    assert graphs_blocker(Trainer) is None and graphs_blocker(ApexTrainer) is None
    args = sft_args(with_stages(SFTConfig), tmp_path, stage="compiled", torch_compile_mode="reduce-overhead")
    trainer = with_stages(SFTTrainer)(
        model=tiny_model("llama").train(), args=args, train_dataset=documents(), processing_class=tokenizer
    )
    assert args.torch_compile_mode == "reduce-overhead"  # (yours, untouched: the trainer's is a copy)
    assert trainer.args.torch_compile and trainer.args.torch_compile_mode is None
    assert trainer.graphs_blocked == graphs_blocker(SFTTrainer)
    assert trainer.metrics_sections()["kernels"]["cuda_graphs"] == f"not used: {graphs_blocker(SFTTrainer)}"
