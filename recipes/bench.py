"""The seed's incremental stage benchmark: each stage in a fresh process, through recipes/finetune.py.

    make bench                                   # what this runs, with the defaults below
    python recipes/bench.py --models bert gpt2 llama --stages baseline fused_adam fused_adam_ln fused_full
    python recipes/bench.py --models gpt2 --stages fused_full auto compiled --nproc 1 2   # and DDP scaling

For each model and stage it runs `recipes/finetune.py` (ApexTrainer, the path users take) for
`--warmup + --steps` optimizer steps with a fixed seed, and, unless `--no_plain_loop`, the same model, data,
optimizer and precision in a plain PyTorch loop, so the Trainer's overhead per stage is visible in the same run.
It prints a markdown table and writes results.{md,csv,json,png} to `--out_dir`; `--append_results
benchmarks/results.csv` (`make bench BENCH_RESULTS=benchmarks/results.csv`) also appends its rows to the curated
results table (benchmarks/README.md; `python recipes/bench_report.py append` does it later from a results.json).

A run that fails is reported where it happens, with the end of its log, and left out of the table; the other runs
go on, and the bench exits with status 1 naming the failed ones (`--skip_existing` then reruns only those).

`--repeats N` runs each row N times, each run a fresh process, in rounds (every stage of a model once per round),
as `runs/{model}-{stage}`, `runs/{model}-{stage}-r2`, ...; the row pools their steps and its 95 % intervals
include how much the runs differ (`recipes/bench_report.py`). On CUDA, BERT's BF16 stages but `fastest` default to
3 runs, and so do GPT-2's and Llama's `fused_full`, `torch_fused` and `auto` (the rows the `auto` comparison reads).
Every other round runs each plain-loop reference before its Trainer run instead of after it.

`--nproc` takes one or more world sizes: each model and stage then runs once per size (n > 1 under torchrun,
DDP, the same per-device batch), in `runs/{model}-{stage}` for one process and `runs/{model}-{stage}-x{n}`
otherwise, and the table adds a GPUs column and each multi-process row's tokens/s scaling against its 1-process
run, with a 95 % interval.

Defaults saturate a large GPU: BERT-base on SST-2 at 128 sequences x 128 tokens (padded), GPT-2 124M and a
~124M Llama-architecture model (RMSNorm; GPT-2 tokenizer) on WikiText-2 at 16 x 1024. Smaller batches (BERT
32 x 128 on an H200) are limited by kernel-launch overhead and hide the differences. Stages default to the
seed's ladder, then torch_fused, compiled, fastest and auto. Without CUDA the benchmark shrinks to tiny models and
says, in the banner and on every row, that its numbers are torch fallbacks, not apex kernels.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import itertools
import json
import multiprocessing
import os
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_report import (  # recipes/ is on sys.path
    add_ratios,
    append_bench,
    appended_message,
    format_table,
    hf_apex_commit,
    row_from_runs,
    write_outputs,
)

from hf_apex import STAGES
from hf_apex.kernels.apex.availability import blocker, portable_path
from hf_apex.measure.report import METRICS_FILENAME, provenance
from hf_apex.stages import SEED_STAGES

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_DATA = REPO.parent / "shared" / "data"

# model -> task, architecture, tokenizer (folder under <data_dir>/tokenizers, else hub id), shape flags
_CAUSAL_LM = dict(
    task="wikitext2",
    tokenizer="gpt2",
    shape=["--block_size", "1024"],
    batch=16,
    eval_samples=64,
    steps=60,
    # FP32 steps are device-bound and steady: in every FP32 run of the 2026-12-01 whole bench the median of the
    # first 20 timed steps was within 0.01 % of all 30's (raw runs: git show 46ca0e8:benchmarks/h200-2026-12-01-whole)
    fp32_steps=20,
    # The rows `auto` is judged against, and `auto`: 3 runs each, in rounds. On an H200 (2026-12-01) a one-run Llama
    # `auto` row shifted from 89 to 96 ms at its 28th step, and its plain loop ran slow throughout, with the very
    # kernels of `fused_full` (46ca0e8:benchmarks/h200-2026-12-01-masks): one run cannot tell such a spell from a
    # choice.
    repeats=3,
    repeat_stages=("fused_full", "torch_fused", "auto"),
)
MODELS = {
    "bert": dict(
        task="sst2",
        model_type="bert",
        tokenizer="bert-base-uncased",
        shape=["--pad_to_max_length", "--max_seq_length", "128"],
        batch=128,
        eval_samples=512,
        # BF16: ~35 ms host-bound steps that slow down in bursts, and differ by up to 10 % from one process to the
        # next: 3 runs of 100 steps each, interleaved with the other stages' (tests/test_bench.py). `fastest`'s
        # steps replay CUDA graphs and are device-bound: on an H200 its Trainer run and two plain loops took 26.52,
        # 26.53 and 26.54 ms (46ca0e8:benchmarks/h200-2026-12-01-cuda-graphs), so one run. FP32: ~200 ms
        # device-bound steady steps, one run of 20.
        steps=100,
        repeats=3,
        repeat_stages=("fused_full", "torch_fused", "compiled", "auto"),
        fp32_steps=20,
    ),
    "gpt2": {**_CAUSAL_LM, "model_type": "gpt2"},
    # A Llama-architecture model of GPT-2 small's width and depth (124M; GPT-2 tokenizer): what FusedRMSNorm does.
    "llama": {
        **_CAUSAL_LM,
        "model_type": "llama",
        "overrides": "hidden_size=768,num_hidden_layers=12,num_attention_heads=12,num_key_value_heads=12,head_dim=64,"
        "intermediate_size=2048,max_position_embeddings=1024,vocab_size=50257,tie_word_embeddings=True",
    },
}
# The families set (--models families): an encoder and decoders of other norms, attention and heads than the three
# above, and one of over 1B parameters, at the shapes of the published configs (random init; RoPE's theta and
# scaling left at the config's defaults, which cost the same). Real data through the local GPT-2 tokenizer; the
# vocabularies keep their published sizes. Eight sequences of 1024 tokens as published LMs are trained on one GPU;
# one run per row, 30 timed steps.
_FAMILY = {**_CAUSAL_LM, "batch": 8, "steps": 30, "repeats": 1, "repeat_stages": ()}
MODELS |= {
    "roberta": {  # RoBERTa-base
        **MODELS["bert"],
        "model_type": "roberta",
        "tokenizer": "gpt2",
        "overrides": "vocab_size=50265,max_position_embeddings=514,type_vocab_size=1,layer_norm_eps=1e-5",
        "steps": 60,
        "repeats": 1,
        "repeat_stages": (),
    },
    "qwen3": {  # Qwen3-0.6B: QK-norm, grouped-query attention, head_dim 128, a 152k vocabulary
        **_FAMILY,
        "model_type": "qwen3",
        "overrides": "hidden_size=1024,num_hidden_layers=28,num_attention_heads=16,num_key_value_heads=8,head_dim=128,"
        "intermediate_size=3072,vocab_size=151936,max_position_embeddings=40960,tie_word_embeddings=True,"
        "rms_norm_eps=1e-6",
    },
    "pythia": {  # Pythia-410M (GPT-NeoX): parallel residual, partial rotary, LayerNorm with biases, untied head
        **_FAMILY,
        "model_type": "gpt_neox",
        "overrides": "hidden_size=1024,num_hidden_layers=24,num_attention_heads=16,intermediate_size=4096,"
        "vocab_size=50304,max_position_embeddings=2048,use_parallel_residual=True,tie_word_embeddings=False",
    },
    "llama1b": {  # Llama-3.2-1B: 1.24B parameters, grouped-query attention, a 128k vocabulary
        **_FAMILY,
        "model_type": "llama",
        "overrides": "hidden_size=2048,num_hidden_layers=16,num_attention_heads=32,num_key_value_heads=8,head_dim=64,"
        "intermediate_size=8192,vocab_size=128256,max_position_embeddings=131072,tie_word_embeddings=True,"
        "rms_norm_eps=1e-5",
    },
}
# The natural set (--models natural): the same models on data of its natural lengths, what fine-tuning sees. The causal
# LMs train on WikiText-2's paragraphs (15,569 lines of over 80 characters, 148 GPT-2 tokens on average, 815 at most),
# 16 to a batch padded to its longest (8 for the 1.24B model), by transformers' language-modelling collator: 46 % of
# the positions are real tokens, about 5,200 a step (sampled: benchmarks/reports/natural-lengths.md). A row that
# packs them (fastest; TRL's SFTTrainer) takes rows of 1,024 tokens, as many as the padded batch's positions:
# 5 (2 for the 1.24B model), the same GPU work a step. The encoders train on SST-2's sentences padded per batch
# (transformers' DataCollatorWithPadding), 128 to a batch as in the default set. The figure of merit is real tokens/s.
_ROW_PARAGRAPHS = 8  # a packed row of 1,024 tokens holds ~7 paragraphs: the pool every natural row draws from
# GPT-2's and BERT's rows time 1,000 steps, what the shapes of a long run cost, recompilations included; the 124M
# Llama and RoBERTa 300, the 1.24B model 100.
_NATURAL_LM = {
    "shape": ["--wikitext_examples", "paragraphs", "--block_size", "1024"],
    "packed_batch": 5,
    "repeats": 1,
    "repeat_stages": (),
    "steps": 1000,
}
_NATURAL_ENCODER = {"shape": ["--max_seq_length", "128"], "repeats": 1, "repeat_stages": (), "steps": 1000}
MODELS |= {
    "gpt2nat": {**MODELS["gpt2"], **_NATURAL_LM},
    "llamanat": {**MODELS["llama"], **_NATURAL_LM, "steps": 300},
    "llama1bnat": {**MODELS["llama1b"], **_NATURAL_LM, "batch": 8, "packed_batch": 2, "steps": 100},
    "bertnat": {**MODELS["bert"], **_NATURAL_ENCODER},
    "robertanat": {**MODELS["roberta"], **_NATURAL_ENCODER, "steps": 300},
}
# --models takes a set's name too; `make bench` runs the default set.
SETS = {
    "default": ["bert", "gpt2", "llama"],
    "families": ["roberta", "qwen3", "pythia", "llama1b"],
    "natural": ["gpt2nat", "llamanat", "llama1bnat", "bertnat", "robertanat"],
}

# What a user would run instead of hf_apex, as bench rows beside the stages: transformers' own Trainer (through
# recipes/finetune.py --trainer stock, with the same metrics callback), never ApexTrainer. Every row of a bench that
# has stock_compiled gets its speedup against it (bench_report.REFERENCE).
_STOCK = ["--trainer", "stock", "--optim", "adamw_torch_fused", "--bf16", "true"]
REFERENCES = {
    "stock_compiled": [*_STOCK, "--torch_compile", "true"],
    "stock": _STOCK,  # eager
    # TRL's SFTTrainer with its own packing (best fit, padding-free) and the stock row's settings
    "trl_sft": ["--trainer", "trl_sft", "--optim", "adamw_torch_fused", "--bf16", "true", "--torch_compile", "true"],
    # the same SFTTrainer and data with fastest's switches (hf_apex.with_stages; TRL still packs)
    "trl_sft_fastest": ["--trainer", "trl_sft", "--stage", "fastest"],
    "liger": [*_STOCK, "--use_liger_kernel", "true"],  # Liger-Kernel's Triton kernels, eager
    "liger_compiled": [*_STOCK, "--use_liger_kernel", "true", "--torch_compile", "true"],
}
ROWS = [*STAGES, *REFERENCES]
# The stages a set runs by default on CUDA: the whole ladder and the compiled and Liger references for the three bench
# models, the references and fastest for the families, the stock Trainer (eager and compiled), TRL's SFTTrainer and
# fastest on natural lengths.
DEFAULT_STAGES = {
    "default": [*STAGES, "stock_compiled", "liger", "liger_compiled"],
    "families": ["stock_compiled", "fastest", "liger", "liger_compiled"],
    "natural": ["stock", "stock_compiled", "trl_sft", "trl_sft_fastest", "fastest"],
}

# Without CUDA: tiny shapes so the whole ladder finishes in minutes on a laptop or CI.
TINY = {
    "bert": dict(
        overrides="num_hidden_layers=2,hidden_size=64,num_attention_heads=2,intermediate_size=128",
        shape=["--pad_to_max_length", "--max_seq_length", "32"],
        batch=8,
        eval_samples=32,
    ),
    "gpt2": dict(overrides="n_layer=2,n_embd=64,n_head=2", shape=["--block_size", "64"], batch=8, eval_samples=8),
    "llama": dict(
        overrides="hidden_size=64,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2,"
        "intermediate_size=128,max_position_embeddings=128,head_dim=32",
        shape=["--block_size", "64"],
        batch=8,
        eval_samples=8,
    ),
}
TINY |= {
    "roberta": {**TINY["bert"], "overrides": TINY["bert"]["overrides"] + ",vocab_size=50265"},
    "qwen3": {**TINY["llama"], "overrides": TINY["llama"]["overrides"] + ",vocab_size=50304"},
    "pythia": {
        **TINY["gpt2"],
        "overrides": "hidden_size=64,num_hidden_layers=2,num_attention_heads=2,intermediate_size=128,vocab_size=50304",
    },
    "llama1b": TINY["llama"],
}
_TINY_NATURAL = {"shape": ["--wikitext_examples", "paragraphs", "--block_size", "64"], "packed_batch": 4}
TINY |= {
    "gpt2nat": {**TINY["gpt2"], **_TINY_NATURAL},
    "llamanat": {**TINY["llama"], **_TINY_NATURAL},
    "llama1bnat": {**TINY["llama"], **_TINY_NATURAL},
    "bertnat": {**TINY["bert"], "shape": ["--max_seq_length", "32"]},
    "robertanat": {**TINY["roberta"], "shape": ["--max_seq_length", "32"]},
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Run the hf_apex stage ladder and print the table.")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=[*MODELS, *SETS],
        help="models, or a set's name: default (bert gpt2 llama, the default on CUDA; bert gpt2 on CPU), families "
        "(roberta qwen3 pythia llama1b: other architectures, and one of over 1B parameters) or natural (gpt2nat "
        "llamanat llama1bnat bertnat robertanat: WikiText-2's paragraphs and SST-2's sentences at their natural "
        "lengths)",
    )
    parser.add_argument(
        "--stages",
        nargs="+",
        choices=ROWS,
        help="stages, and rows of what you would run instead: stock_compiled (transformers' Trainer with "
        "torch_compile, fused AdamW, BF16), stock (the same, eager), liger and liger_compiled (with use_liger_kernel, "
        "eager and compiled; models Liger-Kernel has no kernels for are skipped), trl_sft (TRL's SFTTrainer, packing, "
        "compiled; causal LMs on paragraphs), trl_sft_fastest (the same at --stage fastest). Default on CUDA: for the "
        "default set all eight stages, the seed's ladder, then torch_fused, compiled, fastest and auto, then "
        "stock_compiled, liger and liger_compiled; for the families set those three and fastest; for the natural set "
        "stock, stock_compiled, trl_sft, trl_sft_fastest and fastest; on CPU: the seed's ladder",
    )
    parser.add_argument(
        "--cold_warm",
        action="store_true",
        help="run each compiled stage twice, in rounds: first with empty compile caches (torch's Inductor cache and "
        "hf_apex's, which also holds autotune's decisions: a first run on a new machine), then with an empty Inductor "
        "cache and the hf_apex cache the first run left; compiled stock rows run once, from empty caches; the table "
        "says how long each run took to step 10",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed optimizer steps per run (default on CUDA: 60 for BF16 stages, 100 for BERT's, 20 for FP32 "
        "stages; on CPU: 6)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        metavar="N",
        help="runs per row, each a fresh process, interleaved with the other stages' runs of the model; the row "
        "pools them and its intervals include how much runs differ (default on CUDA: 3 for BERT's BF16 stages but "
        "fastest, whose host-bound steps vary between processes, and for the causal LMs' fused_full, torch_fused "
        "and auto, which the auto comparison reads; 1 elsewhere; on CPU: 1)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed warm-up steps (default 10 on CUDA, 2 on CPU)"
    )
    parser.add_argument(
        "--batch", action="append", type=model_batch, default=[], metavar="MODEL=N", help="batch size, e.g. bert=64"
    )
    parser.add_argument(
        "--data_dir",
        default=str(DEFAULT_DATA) if DEFAULT_DATA.is_dir() else None,
        help="local data (sst2/, wikitext-2/, tokenizers/); default ../shared/data if present, else the Hub",
    )
    parser.add_argument("--out_dir", default=".bench")
    parser.add_argument(
        "--append_results",
        metavar="CSV",
        help="also append the table's rows to this results table (e.g. benchmarks/results.csv), each row once; the "
        "hf_apex commit comes from git, else from the environment's HF_APEX_COMMIT",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny models (the default without CUDA)")
    parser.add_argument("--no_plain_loop", action="store_true", help="skip the plain-loop reference runs")
    parser.add_argument(
        "--nproc",
        nargs="+",
        type=positive_int,
        default=[1],
        metavar="N",
        help="processes (GPUs) per run, one or more sizes (e.g. --nproc 1 2): every model and stage runs at each, "
        "n > 1 with torchrun (DDP); the per-device batch stays as set, so the global batch grows with n; the "
        "table then reports each n > 1 run's scaling against its 1-process run; plain-loop references run only "
        "with 1 process",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--logging_steps",
        type=int,
        default=10,
        help="Trainer logging interval (the plain loop reads its loss as often)",
    )
    parser.add_argument(
        "--skip_existing",
        action="store_true",
        help="reuse runs already in --out_dir/runs (finish an interrupted bench, or fill the table over several "
        "sessions) instead of running them again",
    )
    parser.add_argument(
        "--no_preload",
        dest="preload",
        action="store_false",
        help="start every run as a new interpreter instead of from a fork server that has done the imports",
    )
    opts = parser.parse_args(argv)
    if len(set(opts.nproc)) != len(opts.nproc):
        parser.error(f"argument --nproc: each size once, got {' '.join(map(str, opts.nproc))}")
    return opts


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return int(text)


def run_name(model: str, stage: str, nproc: int, repeat: int = 0) -> str:
    """A run's folder under runs/ and its log's name: the first 1-process run keeps its name of before --nproc
    sizes and --repeats; later runs of the same row end in -r2, -r3..."""
    name = f"{model}-{stage}" if nproc == 1 else f"{model}-{stage}-x{nproc}"
    return name if repeat == 0 else f"{name}-r{repeat + 1}"


def repeats(name: str, stage: str, opts) -> int:
    """Runs of this model and stage: --repeats, else the model's default for its precision and stage (one on
    CPU); at least two for a compiled stage under --cold_warm."""
    spec = MODELS[name]
    runs = opts.repeats or (1 if opts.tiny or stage not in spec["repeat_stages"] else spec["repeats"])
    return max(runs, 2) if opts.cold_warm and compiles(stage) and stage not in REFERENCES else runs


def packs(stage: str) -> bool:
    """Whether a row packs a causal LM's documents into rows of tokens (its batch counts rows, not examples)."""
    return stage.startswith("trl_sft") or stage in STAGES and STAGES[stage].packing is not None


def compiles(stage: str) -> bool:
    flags = REFERENCES.get(stage, ["--stage", stage])
    if "--stage" in flags:  # a stage's row, or a reference run at a stage (trl_sft_fastest)
        return STAGES[flags[flags.index("--stage") + 1]].torch_compile
    return "--torch_compile" in flags


def why_skipped(name: str, stage: str) -> str | None:
    """Why a Liger row of this model cannot run here: Liger-Kernel not installed, or no kernels for the
    architecture (asked of the installed Liger-Kernel itself)."""
    if stage.startswith("trl_sft"):
        if MODELS[name]["task"] != "wikitext2":
            return "TRL's SFTTrainer trains causal LMs; this model classifies"
        try:
            import trl  # noqa: F401
        except ImportError:
            return "trl is not installed (pip install trl)"
        return None
    if not stage.startswith("liger"):
        return None
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return "liger-kernel is not installed (pip install liger-kernel)"
    model_type = MODELS[name]["model_type"]
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"Liger-Kernel has no kernels for {model_type}"
    return None


def model_batch(text: str) -> tuple[str, int]:
    name, _, size = text.partition("=")
    if name not in MODELS or not size.isdigit() or int(size) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MODEL=N with MODEL in {', '.join(MODELS)} and N >= 1")
    return name, int(size)


def finetune_args(name: str, stage: str, opts, out: Path, nproc: int | None = None) -> list[str]:
    """recipes/finetune.py's flags for one run of ``nproc`` processes (default: the only size of --nproc)."""
    if nproc is None:
        (nproc,) = opts.nproc
    spec, tiny = MODELS[name], TINY[name]
    data = Path(opts.data_dir) if opts.data_dir else None
    tok_dir = data / "tokenizers" / spec["tokenizer"] if data else None
    batch = dict(opts.batch).get(name, tiny["batch"] if opts.tiny else spec["batch"])
    packed = (tiny if opts.tiny else spec).get("packed_batch")
    steps = opts.steps or spec["steps" if stage in REFERENCES or STAGES[stage].bf16 else "fp32_steps"]
    samples = (opts.warmup + steps) * batch * nproc  # what the run reads: no time spent tokenizing the rest
    if packed:  # natural lengths: every row draws from one pool, as large as the packed rows need
        samples = (opts.warmup + steps) * packed * _ROW_PARAGRAPHS * nproc
        if packs(stage):
            batch = dict(opts.batch).get(name, packed)
    args = [
        "--task",
        spec["task"],
        "--model_type",
        spec["model_type"],
        *(REFERENCES[stage] if stage in REFERENCES else ["--stage", stage]),
        "--tokenizer_name",
        str(tok_dir) if tok_dir and tok_dir.is_dir() else spec["tokenizer"],
        *(["--data_dir", str(data)] if data else []),
        *(tiny["shape"] if opts.tiny else spec["shape"]),
        "--per_device_train_batch_size",
        str(batch),
        "--per_device_eval_batch_size",
        str(batch),
        "--max_steps",
        str(opts.warmup + steps),
        "--max_train_samples",
        str(samples),
        "--metrics_warmup_steps",
        str(opts.warmup),
        "--max_eval_samples",
        str(tiny["eval_samples"] if opts.tiny else spec["eval_samples"]),
        "--learning_rate",
        "1e-4",
        "--warmup_steps",
        "0.1",
        "--weight_decay",
        "0.01",
        "--seed",
        str(opts.seed),
        "--logging_steps",  # a realistic interval: per-step times come from the recorded events anyway
        str(opts.logging_steps),
        "--save_strategy",
        "no",
        "--save_final_model",
        "false",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--output_dir",
        str(out),
        "--dataloader_num_workers",
        "2",
    ]
    if "--stage" in REFERENCES.get(stage, ["--stage"]):  # a stage's compiled rows measure the compiled steps (the
        args += ["--stage_recipe", '{"min_steps": 0}']  # table says when compilation pays); trl_sft_fastest's too
    overrides = tiny["overrides"] if opts.tiny else spec.get("overrides")
    if overrides:
        args += ["--config_overrides", overrides]
    if not torch.cuda.is_available():
        args += ["--use_cpu"] + (["--ddp_backend", "gloo"] if nproc > 1 else [])
    return args


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# What the runs import, for the fork server to import once. Packages only: the server does not get this script's
# sys.path (Python 3.11-3.13 pass it and ignore it), so recipes/ modules such as plain_loop cannot be preloaded, and
# one that fails to import is skipped without a word (tests/test_bench.py checks that these arrive).
PRELOAD = [
    "datasets",
    "transformers.trainer",
    *(f"transformers.models.{m}.modeling_{m}" for m in ("bert", "gpt2", "llama")),
    "hf_apex.trainer",
    "hf_apex.autotune",
    "hf_apex.measure.callback",
]


def use_fork_server(cuda: bool) -> bool:
    """Have runs started with ``preload`` fork from a server that imports ``PRELOAD`` once, and check, with a first
    forked process, that the imports arrived and (``cuda``) that a forked process can use CUDA. False, with the
    reason printed, where it cannot: then every run starts as a new interpreter. PyTorch's availability checks go
    through NVML (``PYTORCH_NVML_BASED_CUDA_CHECK``) so that none initialises CUDA in the server."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    multiprocessing.set_forkserver_preload(PRELOAD)
    started = time.time()
    check = multiprocessing.get_context("forkserver").Process(target=_check_forked, args=(cuda,))
    check.start()
    check.join()
    if check.exitcode != 0:
        print(
            f"bench: a process forked from the fork server failed its check (exit {check.exitcode}): every run "
            "starts as a new interpreter instead",
            flush=True,
        )
        return False
    print(f"bench: fork server ready in {time.time() - started:.0f} s (its imports serve every run)", flush=True)
    return True


def _check_forked(cuda: bool) -> None:
    missing = [m for m in PRELOAD if m not in sys.modules]
    if missing:  # the runs still work, importing these themselves
        print(f"bench: the fork server did not import {', '.join(missing)}", file=sys.stderr, flush=True)
    if cuda:
        torch.zeros(1, device="cuda").add_(1).cpu()


def _run_script(script: str, args: list[str], log: str, env: dict[str, str]) -> None:
    """What `python script args > log 2>&1` does, in a process forked from the fork server: a fresh process (no
    CUDA context, no compiled code, no allocator state) whose Python imports are already done."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.reconfigure(line_buffering=True)
    multiprocessing.set_start_method(None, force=True)  # loader workers start as in a new interpreter, not from here
    os.chdir(REPO)
    os.environ.update(env)
    sys.argv = [script, *args]  # what the run records as its command line
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # as at interpreter exit (a forked child leaves through os._exit)


class RunFailed(Exception):
    """A run exited with an error; the message holds the end of its log, ``error_line`` its last line that names an
    error (else its last line)."""

    def __init__(self, message: str, log_lines: list[str] = ()):
        super().__init__(message)
        lines = [line.strip() for line in log_lines if line.strip()]
        errors = [line for line in lines if "Error" in line or "error:" in line]
        self.error_line = (errors or lines or ["(empty log)"])[-1][:300]


def run(cmd: list[str], log: Path, preload: bool = False, env: dict[str, str] | None = None) -> None:
    """Run ``cmd`` (a new process, with ``env`` added to the environment) with its output in ``log``;
    :class:`RunFailed` if it fails. ``preload``: a
    ``python script.py ...`` command starts from the fork server (:func:`use_fork_server`), which has imported
    ``PRELOAD`` once for all runs (on an H200 machine a run spent ~14 s before it touched the GPU, for 5-25 s of
    training; on a 2-core CPU box the imports took ~3 s of a tiny run's 5)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    if preload and cmd[0] == sys.executable and cmd[1].endswith(".py"):
        proc = multiprocessing.get_context("forkserver").Process(
            target=_run_script, args=(cmd[1], cmd[2:], str(log), env or {})
        )
        proc.start()
        proc.join()
        proc.returncode = proc.exitcode
    else:
        with log.open("w") as f:
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    if proc.returncode != 0:
        lines = log.read_text().splitlines(keepends=True)
        tail = "".join(lines[-30:])
        raise RunFailed(f"bench: {' '.join(cmd[:4])} ... failed (exit {proc.returncode}); log {log}:\n{tail}", lines)


def bench_run(name: str, stage: str, nproc: int, repeat: int, opts, out_dir: Path) -> tuple[dict, dict | None]:
    """One run of a model and stage on ``nproc`` processes, and its plain-loop reference (one process only):
    their results, read back from disk, where a kept run made with the same settings is reused
    (``--skip_existing``)."""
    run_id = run_name(name, stage, nproc, repeat)
    run_dir = out_dir / "runs" / run_id
    metrics_json, plain_json = run_dir / METRICS_FILENAME, out_dir / "runs" / f"{run_id}-plain.json"
    # (none on natural lengths: the plain loop trains on the collator's batches as they come, unpacked and unbucketed)
    want_plain = not opts.no_plain_loop and nproc == 1 and stage not in REFERENCES and name not in SETS["natural"]
    label = f"{name:5s} {stage:14s}" + (f" x{nproc}" if len(opts.nproc) > 1 else "")
    if repeat or repeats(name, stage, opts) > 1:
        label += f" run {repeat + 1}/{repeats(name, stage, opts)}"
    t0 = time.time()
    # What defines the run: a kept run is reused only when it was made with these very settings.
    flags = finetune_args(name, stage, opts, run_dir, nproc)
    portable = [portable_path(a) if a.startswith("/") else a for a in flags]  # no machine paths on disk
    if "--output_dir" in portable:  # where a run is kept is not what it ran: one moved to another --out_dir counts
        portable[portable.index("--output_dir") + 1] = f"<out_dir>/runs/{run_id}"
    # the stage's row too: a run kept from before the row changed (e.g. fastest's compile mode) is not this stage
    if stage in REFERENCES:
        row = {"flags": REFERENCES[stage]}
    else:
        row = dataclasses.asdict(STAGES[stage])  # its switches and its recipe
        row.pop("summary", None)
    env = cache_env(name, stage, nproc, repeat, opts, out_dir)
    settings = {"nproc": nproc, "finetune": portable, "plain": want_plain, "stage": row}
    if env:
        settings["caches"] = "warm" if repeat else "cold"
    settings_json = run_dir / "bench_settings.json"
    done = metrics_json.is_file() and (plain_json.is_file() or not want_plain)
    seconds = {}  # each process's wall time, start-up and exit included
    if opts.skip_existing and done and _read_json(settings_json) == settings:
        print(f"  {label} kept from {run_dir}", flush=True)
    else:
        if opts.skip_existing and done:
            print(f"  {label} kept run has other settings: running it again", flush=True)
        settings_json.unlink(missing_ok=True)
        launcher = [sys.executable]
        if nproc > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        pair = {"Trainer": [[*launcher, str(HERE / "finetune.py"), *flags], out_dir / f"{run_id}.log"]}
        if want_plain:
            plain_args = finetune_args(name, stage, opts, run_dir / "plain", nproc)
            plain_cmd = [sys.executable, str(HERE / "plain_loop.py"), str(plain_json), *plain_args]
            pair["plain loop"] = [plain_cmd, out_dir / f"{run_id}-plain.log"]
        # Every other round the plain loop goes first, so a drift of the machine does not fall on it alone (round 1
        # runs the Trainer first: the plain loop then reuses the autotune decisions that run cached).
        if env and not repeat:  # the row's first run starts with empty caches
            shutil.rmtree(out_dir / "caches" / run_name(name, stage, nproc), ignore_errors=True)
        for who in reversed(pair) if repeat % 2 else pair:
            started = time.time()
            run(*pair[who], opts.preload, env=env)
            seconds[who] = time.time() - started
        settings_json.write_text(json.dumps(settings, indent=1))
    metrics = json.loads(metrics_json.read_text())
    p50 = (metrics.get("step_time_ms") or {}).get("p50")
    startup = (metrics.get("run") or {}).get("startup_s")
    spent = ", ".join(f"{who} {s:.0f} s" for who, s in seconds.items())
    if seconds and startup is not None:
        spent += f"; the Trainer's process started {startup:.0f} s before training"
    p50 = f"{p50:8.1f} ms" if p50 is not None else "n/a"
    print(f"  {label} p50 {p50}  ({time.time() - t0:.0f} s{': ' + spent if spent else ''})", flush=True)
    return metrics, json.loads(plain_json.read_text()) if want_plain else None


def cache_env(name: str, stage: str, nproc: int, repeat: int, opts, out_dir: Path) -> dict[str, str]:
    """--cold_warm, a compiled row: its runs' compile caches, under <out_dir>/caches/<row>/. Each run gets an empty
    Inductor (and Triton) cache of its own, and all of a row's runs share one hf_apex cache folder (autotune's
    decisions and the compiled work ApexTrainer keeps beside them): the first run starts cold, a later one with what
    hf_apex kept of the first, as on another machine or after torch's cache in /tmp was cleared. A stock row runs
    once, from empty caches: torch keeps nothing outside its Inductor cache."""
    if not (opts.cold_warm and compiles(stage)):
        return {}
    caches = (out_dir / "caches" / run_name(name, stage, nproc)).resolve()
    inductor = caches / f"inductor-run{repeat + 1}"
    shutil.rmtree(inductor, ignore_errors=True)
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(inductor),
        "TRITON_CACHE_DIR": str(inductor / "triton"),
        "HF_APEX_CACHE": str(caches / "hf_apex" / "autotune.json"),
    }


def data_source(data_dir: str | None) -> str:
    """Where the runs' data and tokenizers come from, said before the first run: a bench that reads the Hub offline
    fails only once its first run has started."""
    if data_dir:
        return f"data: {portable_path(data_dir)}"
    return (
        f"data: the Hub (no local copy at {portable_path(str(DEFAULT_DATA))}; use one with --data_dir DIR, through "
        'make BENCH_ARGS="--data_dir DIR")'
    )


def choose_rows(opts, cuda: bool) -> None:
    """The models (a set's name expanded) and stages to run, the defaults where none are given: on CUDA the default
    set at every stage and its compiled and Liger rows, or the families' or natural set's default rows when only its
    models are named; on CPU BERT and GPT-2 at the seed's ladder."""
    opts.models = list(dict.fromkeys(m for name in opts.models or [] for m in SETS.get(name, [name])))
    opts.models = opts.models or (SETS["default"] if cuda else ["bert", "gpt2"])
    named = next((s for s in ("families", "natural") if set(opts.models) <= set(SETS[s])), "default")
    opts.stages = opts.stages or (DEFAULT_STAGES[named] if cuda else list(SEED_STAGES))


def not_run_text(not_run: dict[str, str]) -> str:
    return "".join(f"\nNot run: {row}: {why}." for row, why in not_run.items())


def main(argv=None) -> int:
    opts = parse_args(argv)
    cuda = torch.cuda.is_available()
    opts.tiny = opts.tiny or not cuda
    choose_rows(opts, cuda)
    if opts.tiny:
        opts.steps = opts.steps or 6
    opts.warmup = opts.warmup if opts.warmup is not None else (10 if cuda else 2)
    missing = blocker("fused_adam") or blocker("layer_norm")
    prov = provenance()
    if missing is None:
        banner = f"hf_apex stage benchmark on {prov['gpu']} (apex kernels)"
    else:
        why = "no CUDA" if not cuda else "apex kernels missing"
        banner = f"FALLBACK NUMBERS ({why}, no apex kernels): torch fallbacks stand in for apex; not apex results"
    apex_commit = prov["apex"].get("commit", "not installed")[:8] if prov["apex"]["installed"] else "not installed"
    banner += f" | torch {prov['torch']}, transformers {prov['transformers']}, apex {apex_commit}"
    if max(opts.nproc) > 1:
        sizes = [str(n) for n in opts.nproc]
        sizes = " and ".join([", ".join(sizes[:-1]), sizes[-1]] if len(sizes) > 1 else sizes)
        banner += f" | {sizes} processes per run (DDP)"
    print(banner, flush=True)
    print(data_source(opts.data_dir), flush=True)

    if opts.preload:
        opts.preload = use_fork_server(cuda)
    out_dir = Path(opts.out_dir)
    runs: dict[tuple, list] = {}  # (model, stage, nproc) -> [(metrics, plain-loop result or None)] in run order
    failed = []  # a failed run is reported and left out; the others still run (--skip_existing keeps them)
    not_run = {}  # a Liger row that cannot run here, or fails in Liger or torch: a finding, said under the table
    for name in opts.models:
        for stage in opts.stages:
            if why_skipped(name, stage):
                not_run[f"{name} {stage}"] = why_skipped(name, stage)
                print(f"  {name:5s} {stage:14s} skipped: {not_run[f'{name} {stage}']}", flush=True)
        # Round by round, each stage once per round: a slow spell of the machine cannot fall on one stage's runs only.
        rounds = max(repeats(name, stage, opts) for stage in opts.stages)
        for repeat, stage, nproc in itertools.product(range(rounds), opts.stages, opts.nproc):
            if repeat < repeats(name, stage, opts) and f"{name} {stage}" not in not_run:
                try:
                    done = bench_run(name, stage, nproc, repeat, opts, out_dir)
                except RunFailed as exc:
                    print(exc, flush=True)
                    if stage.startswith("liger"):  # Liger-Kernel's or torch's failure, not the bench's
                        not_run[f"{name} {stage}"] = f"failed: {exc.error_line}"
                    else:
                        failed.append(run_name(name, stage, nproc, repeat))
                    continue
                runs.setdefault((name, stage, nproc), []).append(done)
    rows = []
    for (name, _, _), done in runs.items():
        plains = [plain for _, plain in done]
        rows.append(row_from_runs(name, [metrics for metrics, _ in done], plains if all(plains) else None))
        rows[-1].cold_warm = opts.cold_warm
    if not rows:
        print(f"\nbench: every run failed ({', '.join(failed)}): no table")
        return 1
    add_ratios(rows)
    config = {k: portable_path(v) if k in ("data_dir", "out_dir") and v else v for k, v in vars(opts).items()}
    args = argv if argv is not None else sys.argv[1:]
    config["failed_runs"] = failed
    config["not_run"] = not_run
    config["hf_apex_commit"] = hf_apex_commit(REPO)
    config["command"] = " ".join(
        ["python", "recipes/bench.py", *(portable_path(a) if a.startswith("/") else a for a in args)]
    )
    paths = write_outputs(rows, out_dir, banner, config)
    print(format_table(rows, banner) + not_run_text(not_run))
    print("\nwritten: " + ", ".join(portable_path(p) for p in paths.values()))
    if "png" not in paths:
        print("no chart: install matplotlib (pip install 'hf_apex[plot]') for results.png")
    if opts.append_results:
        table = Path(opts.append_results)
        try:
            print(appended_message(table, *append_bench(paths["json"], table)))
        except ValueError as exc:  # no commit known: the outputs stay, to append later with the commit given
            print(f"bench: not appended to {table}: {exc} (python recipes/bench_report.py append --hf_apex_commit)")
    if failed:
        print(f"\nbench: {len(failed)} run(s) failed and are left out of the table: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
