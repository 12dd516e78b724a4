"""Fine-tune (or train from scratch) a Hugging Face model at any hf_apex stage, on real data.

Tasks: `sst2` (sequence classification, accuracy on the dev split) and `wikitext2` (causal LM packed into
fixed blocks, perplexity on the validation split). Every `TrainingArguments` / `ApexTrainingArguments` flag
works; `python recipes/finetune.py --help` lists them all.

    # On a CPU, offline: a small model from scratch at an FP32 stage, a few steps and a short eval
    # (sst2 ~25 s, wikitext2 ~30 s on 2 idle CPU cores; about 1.5 min each while other work shares them)
    python recipes/finetune.py --task sst2 --data_dir ../shared/data --model_type bert \
        --config_overrides num_hidden_layers=4,hidden_size=256,num_attention_heads=4,intermediate_size=1024 \
        --tokenizer_name ../shared/data/tokenizers/bert-base-uncased --use_cpu --stage fused_adam_ln \
        --max_steps 50 --max_eval_samples 200 --save_strategy no --output_dir out/sst2-cpu
    python recipes/finetune.py --task wikitext2 --data_dir ../shared/data --model_type gpt2 \
        --config_overrides n_layer=4,n_embd=256,n_head=4 --tokenizer_name ../shared/data/tokenizers/gpt2 \
        --block_size 64 --per_device_train_batch_size 4 --use_cpu --stage fused_adam_ln --max_steps 20 \
        --max_eval_samples 40 --save_strategy no --output_dir out/wt2-cpu

    # On a CUDA GPU, offline: full-size models from scratch with apex's kernels and BF16
    python recipes/finetune.py --task sst2 --data_dir ../shared/data --model_type bert \
        --tokenizer_name ../shared/data/tokenizers/bert-base-uncased --stage fused_full --max_steps 300 \
        --output_dir out/sst2
    python recipes/finetune.py --task wikitext2 --data_dir ../shared/data --model_type gpt2 \
        --tokenizer_name ../shared/data/tokenizers/gpt2 --block_size 1024 --stage fused_full --max_steps 200 \
        --output_dir out/wt2

    # On a CUDA GPU with network access: a pretrained model and the dataset from the Hugging Face Hub
    python recipes/finetune.py --task sst2 --model_name_or_path bert-base-uncased --stage fused_full \
        --max_steps 300 --output_dir out/sst2-hub

`--trainer stock` trains with transformers' own `Trainer` instead, with the same metrics: what you would run
without hf_apex (the bench's `stock_compiled` and `liger` rows), e.g. `--trainer stock --torch_compile true --optim
adamw_torch_fused --bf16 true`.

A CPU with AVX512-BF16 or AMX can also run --stage torch_fused (BF16). A run into an --output_dir that holds
checkpoints is refused: continue it with --resume_from_checkpoint <output_dir>/checkpoint-N, or start over there
with --overwrite_output_dir.

`--data_dir` holds `sst2/{train,dev}.tsv` (columns `sentence`, `label`) and/or
`wikitext-2/{train,valid}.txt`. The eval accuracy or perplexity is written into
`<output_dir>/hf_apex_metrics.json` beside the stage's speed and memory figures.
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import itertools
import json
import logging
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import torch
import transformers
from huggingface_hub.utils import logging as hub_logging
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    HfArgumentParser,
    default_data_collator,
    set_seed,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

import hf_apex
from hf_apex import ApexTrainer, ApexTrainingArguments, StageMetricsCallback
from hf_apex.distributed import close_process_group
from hf_apex.kernels.apex.availability import portable_path
from hf_apex.measure.report import update_metrics_file
from hf_apex.policy import validate_apex_args
from hf_apex.training_args import ADDED_ARGUMENTS, uses_cuda_graphs

logger = logging.getLogger("finetune")

TASKS = {
    # task -> (hub dataset, local files under --data_dir: split -> relative path)
    "sst2": (("glue", "sst2"), {"train": "sst2/train.tsv", "validation": "sst2/dev.tsv"}),
    "wikitext2": (
        ("wikitext", "wikitext-2-raw-v1"),
        {"train": "wikitext-2/train.txt", "validation": "wikitext-2/valid.txt"},
    ),
}
OFFLINE_HINT = (
    "Offline alternatives: --data_dir DIR with local files, --model_name_or_path /local/model/dir, or "
    "--model_type bert|gpt2|... --tokenizer_name /local/tokenizer/dir to train from scratch."
)
NO_NETWORK_HINT = (
    "Without network access, export HF_HUB_OFFLINE=1: a missing Hub then fails at once, not after retries."
)


class InputError(ValueError):
    """Bad flags or data, found before training: reported without a traceback, exit status 2 (as argparse's)."""


class Parser(HfArgumentParser):
    def __init__(self, dataclass_types):
        super().__init__(dataclass_types)
        for action in self._actions:  # HfArgumentParser gives `--no_x` the help of `--x`, which then reads backwards
            flag = action.option_strings[0] if action.option_strings else ""
            if flag.startswith("--no_"):
                action.help = f"Turn --{flag.removeprefix('--no_')} off."

    def error(self, message):  # a typo gets one line with the valid choices, not the whole usage
        self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


GRAPH_PAD_MULTIPLE = 16  # sst2 under CUDA graphs: batches padded to a multiple of this many tokens
PARAGRAPH_CHARS = 80  # wikitext2 paragraphs: lines longer than this (the headings and blank lines are shorter)


@dataclass
class ScriptArguments:
    """What to train on: the task, its data and the model (flags follow the HF example scripts)."""

    task: str = field(default="sst2", metadata={"help": "Task to train.", "choices": list(TASKS)})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub id or local directory of a pretrained model (loaded in float32)."}
    )
    model_type: str | None = field(
        default=None, metadata={"help": "Train from scratch with this architecture's default config (random init)."}
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": "With --model_type: config overrides 'k=v,...', e.g. 'n_layer=6,n_embd=512'."}
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer hub id or directory (default: --model_name_or_path)."}
    )
    data_dir: str | None = field(
        default=None, metadata={"help": "Local data: sst2/{train,dev}.tsv and wikitext-2/{train,valid}.txt."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only this many training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only this many eval examples."})
    max_seq_length: int = field(default=128, metadata={"help": "sst2: truncate sentences to this many tokens."})
    pad_to_max_length: bool = field(
        default=False,
        metadata={
            "help": "sst2: pad every batch to max_seq_length (fixed shapes, for benchmarks) instead of dynamically "
            f"(under CUDA graphs to a multiple of {GRAPH_PAD_MULTIPLE} tokens)."
        },
    )
    block_size: int | None = field(
        default=None, metadata={"help": "wikitext2: tokens per training block (default: min(1024, model maximum))."}
    )
    wikitext_examples: str = field(
        default="blocks",
        metadata={
            "help": "wikitext2: blocks (the text concatenated and cut into --block_size blocks: no padding) or "
            f"paragraphs (each line of over {PARAGRAPH_CHARS} characters one example of its natural length, cut at "
            "--block_size, padded per batch, or packed with --packing)",
            "choices": ["blocks", "paragraphs"],
        },
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "The model's attention: sdpa (transformers' default), flex_attention (compiled block-sparse "
            "masks: a packed run's document masks skip the blocks they mask out) or eager.",
            "choices": ["sdpa", "flex_attention", "eager"],
        },
    )
    save_final_model: bool = field(default=True, metadata={"help": "Save the trained model to --output_dir."})
    trainer: str = field(
        default="apex",
        metadata={
            "help": "apex: ApexTrainer at --stage. stock: transformers' own Trainer with hf_apex's "
            "StageMetricsCallback, what you would run instead (set its flags yourself, e.g. --torch_compile true "
            "--optim adamw_torch_fused --bf16 true, and --use_liger_kernel true for Liger-Kernel); it refuses "
            "--stage and the apex switches. trl_sft: TRL's SFTTrainer with its packing (best fit, padding-free: one "
            "row of the batch's documents with positions restarting per document), the same metrics and your "
            "TrainingArguments flags, and with --stage the stage's switches (hf_apex.with_stages); --task wikitext2 "
            "--wikitext_examples paragraphs; needs trl.",
            "choices": ["apex", "stock", "trl_sft"],
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Train from scratch in an --output_dir that holds checkpoints, deleting its checkpoint-* folders "
            "when training starts (without it such a folder is refused: resume with --resume_from_checkpoint)."
        },
    )


def main(argv: list[str] | None = None) -> dict:
    parser = Parser((ScriptArguments, ApexTrainingArguments))
    try:  # a value out of range or an inconsistent combination of TrainingArguments
        script_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as exc:
        raise InputError(one_line(exc)) from exc
    setup_logging()
    check_args(script_args)
    staged_sft = script_args.trainer == "trl_sft" and training_args.stage is not None
    if script_args.trainer != "apex" and not staged_sft:
        check_stock_args(training_args)
    try:  # environment problems (no GPU, no apex kernels under strict mode) before any data or model loads
        validate_apex_args(training_args)
    except ValueError as exc:
        raise InputError(one_line(exc)) from exc
    resume = check_output_dir(script_args, training_args)
    set_seed(training_args.seed)

    # 1. Tokenizer, raw data, model
    tokenizer = load_tokenizer(script_args)
    raw = load_raw_data(script_args)
    model = load_model(script_args, tokenizer, resume)

    # 2. Task-specific preprocessing and evaluation
    prepare = prepare_sst2 if script_args.task == "sst2" else prepare_wikitext2
    train_ds, eval_ds, collator, compute_metrics = prepare(script_args, raw, tokenizer, model, training_args)

    # 3. Train at the requested stage (ApexTrainer rewires the model and records the stage metrics), or with the
    # stock Trainer and the same metrics
    trainer_cls, extra = ApexTrainer, {}
    if script_args.trainer == "stock":
        trainer_cls, extra = transformers.Trainer, {"callbacks": stock_callbacks(training_args, "stock")}
    if script_args.trainer == "trl_sft":  # TRL packs the documents and makes its own collator
        trainer_cls, extra = sft_trainer(), {"callbacks": stock_callbacks(training_args, "trl_sft")}
        if staged_sft:  # SFTTrainer and SFTConfig with the stage (their metrics are ApexTrainer's)
            trainer_cls, extra = hf_apex.with_stages(trainer_cls), {}
        training_args, collator = sft_config(training_args, staged=staged_sft), None
    trainer = trainer_cls(
        **extra,
        model=model,
        args=training_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=collator,
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=argmax_logits if script_args.task == "sst2" else None,
    )
    if staged_sft and trainer.stage_metrics is not None:  # its metrics' name: the bench's row
        trainer.stage_metrics.stage = f"trl_sft_{training_args.stage}"
    if script_args.overwrite_output_dir and trainer.args.should_save:
        delete_checkpoints(training_args.output_dir)
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    # 4. Evaluate, and put quality next to cost in the metrics JSON
    eval_metrics = trainer.evaluate()
    if script_args.task == "wikitext2":
        eval_metrics["eval_perplexity"] = math.exp(min(eval_metrics["eval_loss"], 50.0))
    trainer.log_metrics("eval", eval_metrics)
    if script_args.save_final_model:
        trainer.save_model()
    if trainer.is_world_process_zero():
        metrics_path = update_metrics_file(
            training_args.output_dir,
            task=script_args.task,
            eval={k: float(v) for k, v in eval_metrics.items()},
            train={k: float(v) for k, v in train_result.metrics.items()},
            data={"train_examples": len(train_ds), "eval_examples": len(eval_ds), "source": data_source(script_args)},
        )
        saved = " and the model" if script_args.save_final_model else ""
        logger.info("Wrote the metrics (%s)%s to %s", metrics_path.name, saved, metrics_path.parent.resolve())
    return eval_metrics


def setup_logging() -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    transformers.utils.logging.set_verbosity_warning()
    hub_logging.disable_propagation()  # the Hub's client prints with its own handler: not a second time through ours


def one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def check_args(args: ScriptArguments) -> None:
    if (args.model_name_or_path is None) == (args.model_type is None):
        raise InputError("Give exactly one of --model_name_or_path (pretrained) or --model_type (from scratch).")
    if args.model_type is not None and args.tokenizer_name is None:
        raise InputError("--model_type trains from scratch and needs --tokenizer_name (a hub id or a local folder).")
    if args.trainer == "trl_sft" and (args.task, args.wikitext_examples) != ("wikitext2", "paragraphs"):
        raise InputError("--trainer trl_sft fine-tunes on documents: --task wikitext2 --wikitext_examples paragraphs.")
    if args.wikitext_examples != "blocks" and args.task != "wikitext2":
        raise InputError(f"--wikitext_examples {args.wikitext_examples} applies to --task wikitext2 only.")
    if args.config_overrides is not None and args.model_type is None:
        raise InputError("--config_overrides only applies with --model_type.")
    for flag in ("model_name_or_path", "tokenizer_name"):
        value = getattr(args, flag)
        if value is not None and looks_local(value) and not Path(value).expanduser().exists():
            raise InputError(f"--{flag} {value}: no such directory ({Path(value).expanduser().resolve()}).")
    for name in ("max_train_samples", "max_eval_samples", "block_size", "max_seq_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InputError(f"--{name} must be >= 1, got {value}.")
    if args.model_type is not None:  # an unknown architecture or override: now, not after the data has loaded
        if args.model_type not in CONFIG_MAPPING:
            close = difflib.get_close_matches(args.model_type, list(CONFIG_MAPPING), n=3)
            raise InputError(
                f"--model_type {args.model_type}: no such architecture in transformers"
                + (f" (did you mean {', '.join(close)}?)" if close else ".")
            )
        try:
            if args.config_overrides:
                AutoConfig.for_model(args.model_type).update_from_string(args.config_overrides)
        except ValueError as exc:  # an unknown key, a value of the wrong type, or not 'k=v,...'
            raise InputError(f"--config_overrides {args.config_overrides}: {exc}.") from exc


# ApexTrainingArguments' own fields that the stock Trainer's metrics read; the others are apex switches.
METRICS_FIELDS = ("stage_metrics", "metrics_warmup_steps", "peak_tflops", "profile_kernels")


def check_stock_args(training_args: ApexTrainingArguments) -> None:
    """--trainer stock runs transformers' Trainer: it would ignore a stage or an apex switch, so refuse them."""
    if training_args.stage is not None:
        raise InputError(f"--stage {training_args.stage} needs --trainer apex (the stock Trainer has no stages).")
    stock = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    defaults = ApexTrainingArguments(output_dir=training_args.output_dir, use_cpu=training_args.use_cpu)
    changed = [
        f.name
        for f in dataclasses.fields(ApexTrainingArguments)
        if f.name not in stock and f.name not in METRICS_FIELDS
        if getattr(training_args, f.name) != getattr(defaults, f.name)
    ]
    if changed:
        flags = ", ".join(f"--{name}" for name in changed)
        raise InputError(f"{flags}: apex switches, which the stock Trainer ignores; drop them or use --trainer apex.")


def reference_name(training_args, trainer: str = "stock") -> str:
    """What a stock run is called in the metrics and the bench: stock or liger (use_liger_kernel), + _compiled; TRL's
    SFTTrainer: trl_sft (compiled, as the bench runs it), else trl_sft_eager."""
    if trainer == "trl_sft":
        return "trl_sft" + ("" if training_args.torch_compile else "_eager")
    name = "liger" if training_args.use_liger_kernel else "stock"
    return name + ("_compiled" if training_args.torch_compile else "")


def sft_trainer():
    """TRL's SFTTrainer, or an InputError that says how to get it."""
    try:
        from trl import SFTTrainer
    except ImportError as exc:
        raise InputError(f"--trainer trl_sft needs TRL: pip install trl ({exc}).") from exc
    return SFTTrainer


def sft_config(training_args, staged: bool = False):
    """An SFTConfig with the parsed TrainingArguments flags, packing the documents into rows of --block_size tokens
    (TRL's best-fit packing, padding-free); ``staged``: ``with_stages(SFTConfig)`` with the stage and the apex
    switches given too."""
    from trl import SFTConfig

    config = hf_apex.with_stages(SFTConfig) if staged else SFTConfig
    fields = {f.name for f in dataclasses.fields(config) if f.init}
    stock = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init} & fields
    given = {k: v for k, v in training_args.to_dict().items() if k in stock and not k.endswith("_token")}
    if staged:  # the stage and the apex switches as parsed (TRL's packing is its own: True below)
        given.update({k: getattr(training_args, k) for k in ADDED_ARGUMENTS if k in fields and k != "packing"})
    given["accelerator_config"] = training_args.accelerator_config.to_dict()
    length = training_args.packing_length
    return config(**given, packing=True, max_length=length, dataset_kwargs={})


def stock_callbacks(training_args, trainer: str) -> list:
    if not training_args.stage_metrics:
        return []
    callback = StageMetricsCallback(
        stage=reference_name(training_args, trainer),
        warmup_steps=training_args.metrics_warmup_steps,
        peak_tflops=training_args.peak_tflops,
        profile_kernels=training_args.profile_kernels,
    )
    return [callback]


@dataclass
class Checkpoint:
    path: str
    step: int


def check_output_dir(args: ScriptArguments, training_args: ApexTrainingArguments) -> Checkpoint | None:
    """Refuse to train from scratch over the checkpoints of an earlier run; return the checkpoint to resume from."""
    resume, out = training_args.resume_from_checkpoint, training_args.output_dir
    if resume is not None and args.overwrite_output_dir:
        raise InputError("--resume_from_checkpoint continues a run and --overwrite_output_dir starts over: give one.")
    if resume is not None:
        if not os.path.isdir(resume):
            raise InputError(f"--resume_from_checkpoint {resume}: no such folder.")
        step = checkpoint_step(resume)
        if step is None:  # the run's --output_dir, say, not one of its checkpoints
            inner = get_last_checkpoint(resume)
            why = f"holds checkpoints, the last is {inner}" if inner else "no readable trainer_state.json"
            raise InputError(f"--resume_from_checkpoint {resume}: not a Trainer checkpoint ({why}).")
        return Checkpoint(resume, step)
    if os.path.exists(out) and not os.path.isdir(out):
        raise InputError(f"--output_dir {out}: a file, not a folder; give a folder to write the run into.")
    last = get_last_checkpoint(out) if os.path.isdir(out) else None
    if last is not None and not args.overwrite_output_dir:
        raise InputError(
            f"--output_dir {out} holds checkpoints of an earlier run: continue it with --resume_from_checkpoint "
            f"{last}, or give a fresh --output_dir (--overwrite_output_dir starts over here, deleting them)."
        )
    return None


def checkpoint_step(path: str) -> int | None:
    """The step a Trainer checkpoint was saved at; None where ``path`` is not one."""
    try:
        return int(json.loads(Path(path, "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def delete_checkpoints(output_dir: str) -> None:
    for folder in Path(output_dir).iterdir():  # the folders get_last_checkpoint looks at, and no others
        if folder.is_dir() and re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-\d+", folder.name):
            shutil.rmtree(folder)


def looks_local(name: str) -> bool:
    """A folder, not a Hub id: a Hub id is `name` or `namespace/name`, never `./x`, `/x`, `~/x` or `a/b/c`."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def hub_call(what: str, fn, *args, **kwargs):
    """Run a loader that may need the Hub; turn an offline/unreachable failure into a message with alternatives."""
    try:
        return fn(*args, **kwargs)
    except (OSError, ConnectionError, ValueError) as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        hint = OFFLINE_HINT if offline else OFFLINE_HINT + " " + NO_NETWORK_HINT
        raise InputError(
            f"Could not load {what}{' (HF_HUB_OFFLINE is set)' if offline else ''}: {exc}\n{hint}"
        ) from exc


def load_tokenizer(args: ScriptArguments):
    name = args.tokenizer_name or args.model_name_or_path
    tokenizer = hub_call(f"tokenizer {name!r}", AutoTokenizer.from_pretrained, name)
    if tokenizer.pad_token is None:  # GPT-2 style tokenizers: pad with EOS (never attended to)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def data_source(args: ScriptArguments) -> str:
    if args.data_dir is None:
        return "hub:" + "/".join(TASKS[args.task][0])
    return portable_path(args.data_dir)


def load_raw_data(args: ScriptArguments) -> datasets.DatasetDict:
    hub_name, files = TASKS[args.task]
    if args.data_dir is None:
        return hub_call(f"dataset {'/'.join(hub_name)!r} from the Hub", datasets.load_dataset, *hub_name)
    paths = {split: Path(args.data_dir) / rel for split, rel in files.items()}
    for split, path in paths.items():
        if not path.is_file():
            raise InputError(f"{path}: {split} file not found (--data_dir must hold {', '.join(files.values())}).")
        if path.stat().st_size == 0:
            raise InputError(f"{path}: file is empty.")
    if args.task == "wikitext2":
        return datasets.load_dataset("text", data_files={k: str(v) for k, v in paths.items()})
    for path in paths.values():
        check_tsv(path, columns=("sentence", "label"))
    # Through `datasets` (not pandas or csv by hand) so that the parsed table and the tokenisation are cached.
    return datasets.load_dataset(
        "csv",
        data_files={k: str(v) for k, v in paths.items()},
        delimiter="\t",
        quoting=csv.QUOTE_NONE,
        keep_default_na=False,
        na_filter=False,
    )


def check_tsv(path: Path, columns: tuple[str, str]) -> None:
    """A GLUE-style TSV with a header; every row must have exactly the header's fields and an integer label."""
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    header, body = rows[0], rows[1:]
    if set(columns) - set(header):
        raise InputError(f"{path}: columns are {header}, expected {list(columns)}.")
    if not body:
        raise InputError(f"{path}: has a header but no rows.")
    bad = next((i for i, r in enumerate(body, start=2) if len(r) != len(header)), None)
    if bad is not None:
        raise InputError(f"{path}: line {bad} has {len(body[bad - 2])} fields, the header has {len(header)}.")
    label = header.index("label")
    for line, row in enumerate(body, start=2):
        if not row[label].strip().lstrip("-").isdigit():
            raise InputError(f"{path}: line {line} has label {row[label]!r}; labels must be integers.")


def load_model(args: ScriptArguments, tokenizer, resume: Checkpoint | None = None):
    auto_cls = AutoModelForSequenceClassification if args.task == "sst2" else AutoModelForCausalLM
    extra = {"num_labels": 2} if args.task == "sst2" else {}
    if args.model_name_or_path is not None:
        name = args.model_name_or_path
        if args.attn_implementation:
            extra["attn_implementation"] = args.attn_implementation
        model = hub_call(f"model {name!r}", auto_cls.from_pretrained, name, dtype=torch.float32, **extra)
    else:
        config = AutoConfig.for_model(args.model_type, **extra)
        if args.config_overrides:
            config.update_from_string(args.config_overrides)
        changes = [args.config_overrides] if args.config_overrides else []
        if len(tokenizer) > config.vocab_size:
            changes.append(f"vocab_size={len(tokenizer)} (the tokenizer's)")
            config.vocab_size = len(tokenizer)
        try:
            model = auto_cls.from_config(config, attn_implementation=args.attn_implementation)
        except ValueError as exc:  # a config the architecture cannot build, or an attention it does not take
            given = [
                f"--{k} {v}" for k, v in vars(args).items() if k in ("config_overrides", "attn_implementation") and v
            ]
            raise InputError(f"{' with '.join(given) or f'--model_type {args.model_type}'}: {one_line(exc)}") from exc
        if resume is None:
            logger.warning(
                "Training %s FROM SCRATCH (random init): %.1fM parameters, its default config%s.",
                args.model_type,
                model.num_parameters() / 1e6,
                f" with {', '.join(changes)}" if changes else "",
            )
    if resume is not None:  # the Trainer loads the checkpoint's weights over these
        logger.warning(
            "Resuming from %s at step %d: %s (%.1fM parameters) with the checkpoint's weights, optimizer and "
            "scheduler.",
            resume.path,
            resume.step,
            args.model_type or args.model_name_or_path,
            model.num_parameters() / 1e6,
        )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def model_max_positions(model) -> int | None:
    config = model.config
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def prepare_sst2(args, raw, tokenizer, model, training_args):
    max_positions = model_max_positions(model)
    if max_positions is not None and args.max_seq_length > max_positions:
        raise InputError(
            f"--max_seq_length {args.max_seq_length} is longer than the model's maximum of {max_positions} positions."
        )
    num_labels = model.config.num_labels
    for split in ("train", "validation"):
        labels = raw[split].unique("label")  # (min/max over the column itself take a second per process)
        if min(labels) < 0 or max(labels) >= num_labels:
            where = Path(args.data_dir, TASKS["sst2"][1][split]) if args.data_dir else f"{split} split"
            raise InputError(
                f"{where}: labels span [{min(labels)}, {max(labels)}], outside the model's {num_labels} labels."
            )
    raw = limit(raw, args)
    padding = "max_length" if args.pad_to_max_length else False

    def tokenize(batch):
        return tokenizer(batch["sentence"], truncation=True, max_length=args.max_seq_length, padding=padding)

    with training_args.main_process_first(desc="tokenizing"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=["sentence"], desc="Tokenizing")
    # Under CUDA graphs each new batch shape is recorded anew: padded to multiples of 16 tokens, SST-2's batches at
    # 128 tokens take 8 shapes at most instead of up to 128 (the padding is masked: the same maths)
    multiple = GRAPH_PAD_MULTIPLE if uses_cuda_graphs(training_args) else None
    collator = (
        default_data_collator
        if args.pad_to_max_length
        else DataCollatorWithPadding(tokenizer, pad_to_multiple_of=multiple)
    )
    return tokenized["train"], tokenized["validation"], collator, accuracy


def prepare_wikitext2(args, raw, tokenizer, model, training_args):
    max_positions = model_max_positions(model)
    block = args.block_size or min(1024, max_positions or 1024)
    if max_positions is not None and block > max_positions:
        raise InputError(f"--block_size {block} is longer than the model's maximum of {max_positions} positions.")

    def tokenize(batch):
        return tokenizer(batch["text"])

    def pack(batch):  # concatenate everything, cut into blocks of `block` tokens, drop the remainder
        joined = {k: list(itertools.chain.from_iterable(batch[k])) for k in batch}
        usable = (len(joined["input_ids"]) // block) * block
        out = {k: [v[i : i + block] for i in range(0, usable, block)] for k, v in joined.items()}
        out["labels"] = [ids.copy() for ids in out["input_ids"]]
        return out

    if args.wikitext_examples == "paragraphs":
        return prepare_paragraphs(args, raw, tokenizer, block, training_args)

    with training_args.main_process_first(desc="tokenizing"):
        transformers.utils.logging.set_verbosity_error()  # "sequence longer than max" is expected before packing
        tokenized = raw.map(tokenize, batched=True, remove_columns=["text"], desc="Tokenizing")
        transformers.utils.logging.set_verbosity_warning()
        packed = tokenized.map(pack, batched=True, batch_size=1000, desc=f"Packing into blocks of {block}")
    for split in ("train", "validation"):
        if len(packed[split]) == 0:
            raise InputError(
                f"{split} split holds fewer than {block} tokens: nothing to train on at --block_size {block}."
            )
    packed = limit(packed, args)
    return packed["train"], packed["validation"], default_data_collator, None


def prepare_paragraphs(args, raw, tokenizer, block, training_args):
    """WikiText-2's paragraphs as examples of their natural lengths (cut at ``block`` tokens), in the data's order,
    padded per batch to the longest by transformers' language-modelling collator (labels: the inputs, padding
    ignored), as a fine-tuning run on documents does; ``--packing`` packs them instead."""
    if training_args.packing_length is None:  # packed rows as long as the blocks would be
        training_args.packing_length = block
    raw = raw.filter(lambda row: len(row["text"]) > PARAGRAPH_CHARS, desc="Keeping paragraphs")
    raw = limit(raw, args)

    def tokenize(batch):
        return tokenizer([t.strip() for t in batch["text"]], truncation=True, max_length=block)

    with training_args.main_process_first(desc="tokenizing"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=["text"], desc="Tokenizing")
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return tokenized["train"], tokenized["validation"], collator, None


def limit(ds: datasets.DatasetDict, args: ScriptArguments) -> datasets.DatasetDict:
    if args.max_train_samples is not None:
        ds["train"] = ds["train"].select(range(min(args.max_train_samples, len(ds["train"]))))
    if args.max_eval_samples is not None:
        ds["validation"] = ds["validation"].select(range(min(args.max_eval_samples, len(ds["validation"]))))
    return ds


def argmax_logits(logits, labels):
    return logits.argmax(dim=-1)


def accuracy(eval_pred) -> dict[str, float]:
    predictions, labels = eval_pred
    return {"accuracy": float(np.mean(np.asarray(predictions) == np.asarray(labels)))}


if __name__ == "__main__":
    try:
        main()
    except InputError as exc:  # bad input: one clear line, no traceback (errors during training keep theirs)
        print(f"finetune.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    finally:  # under torchrun: free the process group here (main's trainer is garbage now), not at interpreter exit
        close_process_group()
