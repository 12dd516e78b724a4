"""Supervised fine-tuning with TRL's SFTTrainer at any hf_apex stage, on a local dataset.

The dataset is a local file (`.jsonl`/`.json`, `.csv`, `.parquet` or `.txt`) in a format SFTTrainer takes: a `text`
column (language modeling), a `messages` column (conversational: the model's chat template applies), or
`prompt`/`completion` columns (the loss on the completion only). Every `SFTConfig` flag works beside `--stage` and
the other hf_apex arguments (`hf_apex.with_stages(SFTConfig)`); `python recipes/sft.py --help` lists them all.

    # On a CPU, offline: a small Llama from scratch at an FP32 stage on text documents (~35 s on 2 cores, 400 of
    # WikiText-2's paragraphs in docs.jsonl)
    python recipes/sft.py --train_file docs.jsonl --model_type llama --tokenizer_name ../shared/data/tokenizers/gpt2 \\
        --config_overrides num_hidden_layers=2,hidden_size=128,intermediate_size=256 --use_cpu --stage fused_adam_ln \\
        --max_steps 20 --per_device_train_batch_size 2 --max_length 128 --packing true --output_dir out/sft-cpu

    # On a CUDA GPU: a pretrained model, TRL's packing, fastest's switches
    python recipes/sft.py --train_file chats.jsonl --model_name_or_path Qwen/Qwen3-0.6B --stage fastest \\
        --packing true --max_length 1024 --max_steps 500 --output_dir out/sft

The stage's metrics (and what it left to TRL: its data pipeline, its own loss) are written to
`<output_dir>/hf_apex_metrics.json`, SFTTrainer's own metrics (token accuracy, entropy) to its logs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import finetune  # recipes/ is the script's folder, so it is on sys.path
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import hf_apex
from hf_apex.distributed import close_process_group

FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
COLUMNS = ({"text"}, {"messages"}, {"prompt", "completion"})  # what SFTTrainer takes, one set per format


@dataclass
class ScriptArguments:
    """The data and the model."""

    train_file: str = field(
        metadata={"help": "The training set: " + ", ".join(FORMATS) + " (a .txt: one text a line)."}
    )
    eval_file: str | None = field(default=None, metadata={"help": "An evaluation set, in the same format."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A pretrained causal LM (Hub id or folder)."}
    )
    model_type: str | None = field(default=None, metadata={"help": "Train this architecture from scratch instead."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer (default: the model's)."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "With --model_type: config changes, e.g. num_hidden_layers=2,hidden_size=128."}
    )


def main(argv: list[str] | None = None) -> dict:
    config_cls = sft_config_class()
    parser = finetune.Parser((ScriptArguments, config_cls))
    try:  # a value out of range or an inconsistent combination of arguments
        script_args, args = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as exc:
        raise finetune.InputError(finetune.one_line(exc)) from exc
    finetune.setup_logging()
    if (script_args.model_name_or_path is None) == (script_args.model_type is None):
        raise finetune.InputError(
            "Give exactly one of --model_name_or_path (pretrained) or --model_type (from scratch)."
        )
    data = load_data(script_args)
    name = script_args.tokenizer_name or script_args.model_name_or_path
    if name is None:
        raise finetune.InputError("--model_type trains from scratch and needs --tokenizer_name.")
    tokenizer = finetune.hub_call(f"tokenizer {name!r}", AutoTokenizer.from_pretrained, name)
    if tokenizer.pad_token is None:  # GPT-2 style tokenizers: pad with EOS (TRL pads the labels with -100)
        tokenizer.pad_token = tokenizer.eos_token
    trainer = hf_apex.with_stages(sft_trainer_class())(
        model=load_model(script_args, tokenizer),
        args=args,
        train_dataset=data["train"],
        eval_dataset=data.get("validation"),
        processing_class=tokenizer,
    )
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = dict(result.metrics)
    if "validation" in data:
        metrics.update(trainer.evaluate())
    trainer.save_model()
    return metrics


def sft_config_class():
    try:
        from trl import SFTConfig
    except ImportError as exc:
        raise finetune.InputError(f"recipes/sft.py needs TRL: pip install 'hf_apex[trl]' ({exc}).") from exc
    return hf_apex.with_stages(SFTConfig)


def sft_trainer_class():
    from trl import SFTTrainer

    return SFTTrainer


def load_data(args: ScriptArguments) -> datasets.DatasetDict:
    files = {"train": args.train_file, **({"validation": args.eval_file} if args.eval_file else {})}
    for split, path in files.items():
        if not Path(path).is_file():
            raise finetune.InputError(f"--{split.replace('validation', 'eval')}_file {path}: no such file.")
        if Path(path).suffix not in FORMATS:
            raise finetune.InputError(
                f"{path}: a {Path(path).suffix or 'suffixless'} file; give one of {', '.join(FORMATS)}."
            )
    data = datasets.load_dataset(FORMATS[Path(args.train_file).suffix], data_files=files)
    for split, ds in data.items():
        if not any(columns <= set(ds.column_names) for columns in COLUMNS):
            takes = " or ".join("/".join(sorted(c)) for c in COLUMNS)
            raise finetune.InputError(f"{files[split]}: columns {ds.column_names}; SFTTrainer takes {takes}.")
    return data


def load_model(args: ScriptArguments, tokenizer):
    if args.model_name_or_path is not None:
        name = args.model_name_or_path
        return finetune.hub_call(f"model {name!r}", AutoModelForCausalLM.from_pretrained, name, dtype=torch.float32)
    try:
        config = AutoConfig.for_model(args.model_type)
        if args.config_overrides:
            config.update_from_string(args.config_overrides)
        config.vocab_size = max(config.vocab_size, len(tokenizer))
        return AutoModelForCausalLM.from_config(config)
    except ValueError as exc:  # an unknown architecture, a bad override, a config the architecture cannot build
        given = (
            f"--config_overrides {args.config_overrides}"
            if args.config_overrides
            else f"--model_type {args.model_type}"
        )
        raise finetune.InputError(f"{given}: {finetune.one_line(exc)}") from exc


if __name__ == "__main__":
    try:
        main()
    except finetune.InputError as exc:  # bad input: one clear line, no traceback
        print(f"sft.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        close_process_group()
