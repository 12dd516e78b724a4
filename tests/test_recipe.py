"""recipes/finetune.py end to end on CPU: real slices of ../shared/data, generated data, resume, bad input."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_apex.kernels.apex.availability import portable_path
from hf_apex.measure.report import METRICS_FILENAME
from tests.testing_utils import SHARED_DATA, require_shared_data

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "finetune.py"
TINY_BERT = "num_hidden_layers=2,hidden_size=32,num_attention_heads=2,intermediate_size=64,max_position_embeddings=128"
TINY_GPT2 = "n_layer=2,n_embd=32,n_head=2,n_positions=128"
WORDS = "the a movie film was is great bad good awful fun dull plot acting not very really truly".split()


def load_recipe():
    spec = importlib.util.spec_from_file_location("finetune_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


finetune = load_recipe()


COMMON = "--use_cpu --report_to none --disable_tqdm true --per_device_train_batch_size 4 --logging_steps 1 "
COMMON += "--save_strategy no --metrics_warmup_steps 1 --seed 0"
MODEL = {
    "sst2": ["--model_type", "bert", "--config_overrides", TINY_BERT],
    "wikitext2": ["--model_type", "gpt2", "--config_overrides", TINY_GPT2],
}


def recipe_args(task, data_dir, tokenizer, out, *extra) -> list[str]:
    """Flags for a tiny from-scratch run of ``task`` on ``data_dir``, writing to ``out``."""
    return [
        "--task",
        task,
        "--data_dir",
        str(data_dir),
        "--tokenizer_name",
        str(tokenizer),
        *MODEL[task],
        "--output_dir",
        str(out),
        *COMMON.split(),
        *extra,
    ]


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """A real BertTokenizer over a small generated vocabulary (no download, no shared data)."""
    from transformers import BertTokenizer

    folder = tmp_path_factory.mktemp("tok")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizer(str(folder / "vocab.txt")).save_pretrained(folder)
    return str(folder)


@pytest.fixture
def generated_data(tmp_path):
    import random

    rng = random.Random(0)
    root = tmp_path / "data"
    (root / "sst2").mkdir(parents=True)
    (root / "wikitext-2").mkdir()
    for name, n in (("train", 64), ("dev", 16)):
        rows = [f"{' '.join(rng.choices(WORDS, k=rng.randint(3, 12)))} \t{rng.randint(0, 1)}" for _ in range(n)]
        (root / "sst2" / f"{name}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    for name, n in (("train", 200), ("valid", 40)):
        lines = [" " + " ".join(rng.choices(WORDS, k=rng.randint(5, 30))) + " " for _ in range(n)]
        (root / "wikitext-2" / f"{name}.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def real_slices(tmp_path_factory):
    """The first lines of the real SST-2 and WikiText-2 files from ../shared/data (never copied into the repo)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is absent")
    root = tmp_path_factory.mktemp("real")
    for rel, n in (
        ("sst2/train.tsv", 257),
        ("sst2/dev.tsv", 65),
        ("wikitext-2/train.txt", 400),
        ("wikitext-2/valid.txt", 120),
    ):
        (root / rel).parent.mkdir(exist_ok=True)
        with (SHARED_DATA / rel).open() as src:
            (root / rel).write_text("".join(line for _, line in zip(range(n), src)))
    return root


def metrics_of(out):
    return json.loads((Path(out) / METRICS_FILENAME).read_text())


@require_shared_data
def test_sst2_on_real_data(real_slices, tmp_path):
    tok = SHARED_DATA / "tokenizers" / "bert-base-uncased"
    finetune.main(recipe_args("sst2", real_slices, tok, tmp_path / "out", "--stage", "baseline", "--max_steps", "4"))
    m = metrics_of(tmp_path / "out")
    assert m["task"] == "sst2" and m["stage"] == "baseline"
    assert m["data"] == {"train_examples": 256, "eval_examples": 64, "source": portable_path(real_slices)}
    assert 0.0 <= m["eval"]["eval_accuracy"] <= 1.0 and m["tokens_per_s"] > 0
    assert (tmp_path / "out" / "config.json").is_file()  # the final model is saved


@require_shared_data
def test_wikitext2_on_real_data(real_slices, tmp_path):
    tok = SHARED_DATA / "tokenizers" / "gpt2"
    extra = ["--block_size", "64", "--stage", "fused_full", "--max_steps", "3"]
    finetune.main(recipe_args("wikitext2", real_slices, tok, tmp_path / "out", *extra))
    m = metrics_of(tmp_path / "out")
    assert m["run"]["seq_len"] == 64 and m["run"]["precision"] == "bf16"
    assert m["eval"]["eval_perplexity"] == pytest.approx(2.718281828 ** m["eval"]["eval_loss"], rel=1e-6)
    assert m["kernels"]["calls"]["layer_norm"]["fallback"] > 0  # CPU: the fallback is stated


@require_shared_data
def test_wikitext2_paragraphs_pad_per_batch_or_pack_into_rows(real_slices, tmp_path):
    """Paragraphs of their natural lengths: the stock Trainer pads each batch to its longest, ApexTrainer packs them
    into rows of --block_size tokens (one shape, almost no padding), both counting real tokens alike."""
    tok = SHARED_DATA / "tokenizers" / "gpt2"
    common = ["--wikitext_examples", "paragraphs", "--block_size", "128", "--max_steps", "3"]
    finetune.main(recipe_args("wikitext2", real_slices, tok, tmp_path / "pad", *common, "--trainer", "stock"))
    finetune.main(recipe_args("wikitext2", real_slices, tok, tmp_path / "pack", *common, "--packing", "documents"))
    padded, packed = metrics_of(tmp_path / "pad"), metrics_of(tmp_path / "pack")
    assert padded["padding_share"] > 0.15  # (at 128 tokens many paragraphs are cut: the batches pad less)
    assert packed["batches"]["layout"] == "documents" and packed["batches"]["row_length"] == 128
    assert packed["batches"]["shapes_trained"] == [[4, 128]] and packed["padding_share"] < 0.1
    assert packed["batches"]["documents"] == padded["data"]["train_examples"]  # the same paragraphs, in rows
    assert packed["eval"]["eval_perplexity"] > 1


@require_shared_data
def test_trl_sft_takes_a_stage(real_slices, tmp_path):
    """--trainer trl_sft --stage: TRL's SFTTrainer and SFTConfig through hf_apex.with_stages; TRL packs the data."""
    pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'hf_apex[trl]'")
    tok = SHARED_DATA / "tokenizers" / "gpt2"
    flags = ["--wikitext_examples", "paragraphs", "--block_size", "128", "--max_steps", "3", "--trainer", "trl_sft"]
    finetune.main(recipe_args("wikitext2", real_slices, tok, tmp_path / "sft", *flags, "--stage", "fused_adam_ln"))
    m = metrics_of(tmp_path / "sft")
    assert m["stage"] == "trl_sft_fused_adam_ln" and m["batches"]["layout"] == "the trainer's own"
    assert m["kernels"]["calls"]["layer_norm"]["fallback"] > 0 and m["kernels"]["calls"]["optimizer"]["fallback"] > 0
    assert m["run"]["per_device_train_batch_size"] == 4 and m["padding_share"] == 0  # (TRL's padding-free rows)


def test_an_attention_the_architecture_lacks_is_one_line(word_tokenizer):
    args = finetune.ScriptArguments(
        task="wikitext2", model_type="gpt2", tokenizer_name=str(word_tokenizer), attn_implementation="flex_attention"
    )
    with pytest.raises(finetune.InputError, match="--attn_implementation flex_attention: GPT2LMHeadModel does not"):
        finetune.load_model(args, finetune.load_tokenizer(args))


def test_an_override_the_architecture_cannot_build_is_one_line_naming_the_flag(word_tokenizer):
    args = finetune.ScriptArguments(
        task="wikitext2", model_type="gpt2", tokenizer_name=str(word_tokenizer), config_overrides="n_embd=250,n_head=4"
    )
    with pytest.raises(finetune.InputError, match=r"^--config_overrides n_embd=250,n_head=4: .*250.*4"):
        finetune.load_model(args, finetune.load_tokenizer(args))


def test_an_output_dir_that_is_a_file_is_refused_before_the_data_loads(word_tokenizer, tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    with pytest.raises(finetune.InputError, match="a file, not a folder"):  # (before the missing data is noticed)
        finetune.main(recipe_args("sst2", tmp_path / "no-such-data", word_tokenizer, out))
    assert out.read_text() == "mine"


def docstring_commands(header: str) -> list[list[str]]:
    """The commands under the comment of finetune.py's docstring that starts with ``header``, up to the blank line
    that ends them, as argument lists."""
    block = finetune.__doc__.split(header, 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
    return [shlex.split(line)[2:] for line in block.splitlines() if line.strip().startswith("python ")]


@require_shared_data
def test_the_docstrings_cpu_commands_run_on_a_cpu(real_slices, tmp_path):
    """As written (on slices of the data, for two steps): a GPU stage or a missing --use_cpu would fail here."""
    commands = docstring_commands("# On a CPU")
    assert [argv[argv.index("--task") + 1] for argv in commands] == ["sst2", "wikitext2"]
    for argv in commands:
        assert "--use_cpu" in argv
        out = tmp_path / argv[argv.index("--task") + 1]
        argv = [arg.replace("../shared/data", str(SHARED_DATA)) for arg in argv]
        argv += ["--data_dir", str(real_slices), "--output_dir", str(out), "--max_steps", "2"]
        finetune.main([*argv, "--max_eval_samples", "4", "--report_to", "none", "--disable_tqdm", "true"])
        assert metrics_of(out)["run"]["precision"] == "fp32"


@pytest.mark.parametrize("task", ["sst2", "wikitext2"])
def test_generated_data(task, generated_data, word_tokenizer, tmp_path, caplog):
    shape = ["--block_size", "32"] if task == "wikitext2" else ["--pad_to_max_length", "--max_seq_length", "16"]
    extra = ["--stage", "fused_adam_ln", "--max_steps", "3", "--max_eval_samples", "8", *shape]
    with caplog.at_level("INFO", logger="finetune"):
        finetune.main(recipe_args(task, generated_data, word_tokenizer, tmp_path / "out", *extra))
    assert f"Wrote the metrics (hf_apex_metrics.json) and the model to {(tmp_path / 'out').resolve()}" in caplog.text
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()
    m = metrics_of(tmp_path / "out")
    assert m["data"]["eval_examples"] == 8 and m["rewire"]["num_swapped"] > 0
    assert m["run"]["seq_len"] == (32 if task == "wikitext2" else 16)


@pytest.mark.parametrize("stage", ["baseline", "fused_adam"])
def test_resume_continues_the_same_loss_trajectory(stage, generated_data, word_tokenizer, tmp_path, caplog):
    def run(out, *extra):
        flags = f"--stage {stage} --max_steps 6 --learning_rate 1e-3 --save_strategy steps --save_steps 3".split()
        flags += extra
        finetune.main(recipe_args("sst2", generated_data, word_tokenizer, out, *flags))
        state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
        return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}

    straight = run(tmp_path / "a")
    caplog.clear()
    with caplog.at_level("WARNING", logger="finetune"):
        resumed = run(tmp_path / "b", "--resume_from_checkpoint", str(tmp_path / "a" / "checkpoint-3"))
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6)
    # The resumed run says so, from which checkpoint and step; it is not announced as a random init
    assert f"Resuming from {tmp_path / 'a' / 'checkpoint-3'} at step 3: bert (" in caplog.text
    assert "FROM SCRATCH" not in caplog.text


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, str(RECIPE), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
        cwd=RECIPE.parents[1],
    )


def test_help_lists_every_flag():
    out = run_cli("--help")
    assert out.returncode == 0
    for flag in ("--task", "--data_dir", "--model_type", "--stage", "--learning_rate", "--resume_from_checkpoint"):
        assert flag in out.stdout
    helps = " ".join(out.stdout.split())  # argparse wraps lines
    assert "--no-save-final-model Turn --save_final_model off." in helps  # not the help of --save_final_model


@pytest.mark.parametrize(
    "args, says",
    [
        (["--task", "sst2", "--model_name_or_path", "bert-base-uncased"], "tokenizer 'bert-base-uncased'"),
        (["--task", "wikitext2", "--model_type", "gpt2", "--tokenizer_name", "WORDTOK"], "wikitext"),
    ],
)
def test_offline_hub_names_fail_with_the_offline_alternative(args, says, word_tokenizer, tmp_path):
    args = [a.replace("WORDTOK", word_tokenizer) for a in args]
    out = run_cli(*args, "--output_dir", str(tmp_path / "out"), "--use_cpu", env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode != 0
    assert says in out.stderr and "HF_HUB_OFFLINE is set" in out.stderr
    assert "--data_dir" in out.stderr and "--model_type" in out.stderr
    assert "Traceback" not in out.stderr and out.stderr.startswith("finetune.py: error:")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags",
    [
        dict(model_name_or_path="./models/my-bert"),
        dict(model_name_or_path="/no/such/model"),
        dict(model_type="bert", tokenizer_name="../shared/data/tokenizers/no-such-tokenizer"),
    ],
)
def test_a_missing_local_folder_is_named_not_looked_up_on_the_hub(flags, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (flag, value), *_ = [(k, v) for k, v in flags.items() if k != "model_type"]
    with pytest.raises(finetune.InputError) as failed:
        finetune.check_args(finetune.ScriptArguments(task="sst2", **flags))
    assert str(failed.value).startswith(f"--{flag} {value}: no such directory")
    assert str(Path(value).resolve()) in str(failed.value)


@pytest.mark.parametrize("name", ["bert-base-uncased", "openai-community/gpt2"])
def test_hub_ids_are_left_to_the_hub(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    finetune.check_args(finetune.ScriptArguments(task="sst2", model_name_or_path=name))  # no InputError


def test_the_hubs_warnings_print_once():
    """The Hub's client logs through a handler of its own and, despite its docs, propagates to the root logger
    that the recipe configures: each retry warning printed twice."""
    code = (
        f"import sys; sys.path.insert(0, {str(RECIPE.parent)!r}); import finetune, logging; finetune.setup_logging(); "
        "logging.getLogger('huggingface_hub.file_download').warning('the Hub is unreachable')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("the Hub is unreachable") == 1


def test_a_hub_failure_without_hf_hub_offline_says_how_to_fail_fast(monkeypatch):
    """Offline without HF_HUB_OFFLINE, the Hub's client retries for about a minute before it fails: say how not to."""

    def unreachable():
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(finetune.InputError) as failed:
        finetune.hub_call("tokenizer 'bert-base-uncased'", unreachable)
    assert str(failed.value).endswith(finetune.OFFLINE_HINT + " " + finetune.NO_NETWORK_HINT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # already set: the alternatives only
    with pytest.raises(finetune.InputError) as failed:
        finetune.hub_call("tokenizer 'bert-base-uncased'", unreachable)
    assert str(failed.value).endswith(finetune.OFFLINE_HINT) and "HF_HUB_OFFLINE is set" in str(failed.value)


def test_a_model_from_scratch_is_announced_with_its_size_and_every_change_to_its_config(word_tokenizer, caplog):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(word_tokenizer)
    overrides = "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64,vocab_size=10"
    args = finetune.ScriptArguments(task="wikitext2", model_type="llama", config_overrides=overrides)
    with caplog.at_level("WARNING", logger="finetune"):
        model = finetune.load_model(args, tokenizer)
    assert model.config.vocab_size == len(tokenizer) > 10  # the tokenizer's words must all have an embedding
    assert (
        f"Training llama FROM SCRATCH (random init): {model.num_parameters() / 1e6:.1f}M parameters, its default "
        f"config with {overrides}, vocab_size={len(tokenizer)} (the tokenizer's)." in caplog.text
    )


def test_unknown_task_is_refused():
    out = run_cli("--task", "mnli", "--model_type", "bert")
    assert out.returncode == 2 and "invalid choice: 'mnli'" in out.stderr


def _break(data, kind):
    tsv = data / "sst2" / "train.tsv"
    if kind == "missing":
        tsv.unlink()
    elif kind == "empty":
        tsv.write_text("")
    elif kind == "ragged":
        tsv.write_text("sentence\tlabel\ngood film \t1\nbad\tfilm\t0\n")
    elif kind == "columns":
        tsv.write_text("text\ttarget\ngood film \t1\n")
    elif kind == "labels":
        tsv.write_text("sentence\tlabel\ngood film \t1\nbad film \t5\n")
    return tsv


@pytest.mark.parametrize(
    "kind, says",
    [
        ("missing", "train file not found"),
        ("empty", "file is empty"),
        ("ragged", "line 3 has 3 fields"),
        ("columns", "columns are ['text', 'target']"),
        ("labels", "outside the model's 2 labels"),
    ],
)
def test_bad_sst2_input_names_the_file(kind, says, generated_data, word_tokenizer, tmp_path):
    path = _break(generated_data, kind)
    with pytest.raises(ValueError, match=re.escape(says)) as err:
        finetune.main(recipe_args("sst2", generated_data, word_tokenizer, tmp_path / "out"))
    assert str(path) in str(err.value)
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.parametrize(
    "task, flag", [("wikitext2", "--block_size"), ("sst2", "--max_seq_length")], ids=["block", "seq"]
)
def test_sequences_longer_than_the_model_are_refused(task, flag, generated_data, word_tokenizer, tmp_path):
    with pytest.raises(ValueError, match=f"{flag} 256 is longer than the model's maximum of 128"):
        finetune.main(recipe_args(task, generated_data, word_tokenizer, tmp_path / "out", flag, "256"))
    assert not (tmp_path / "out").exists()


def test_strict_kernels_without_a_gpu_fail_before_anything_loads(tmp_path):
    """The real blocker (no GPU), in one line, before the tokenizer (a Hub id that does not exist) is looked up."""
    out = run_cli(
        *["--task", "sst2", "--model_type", "bert", "--tokenizer_name", "hf-apex-tests/no-such-tokenizer"],
        *["--stage", "fused_full", "--apex_strict_kernels", "--use_cpu", "--output_dir", str(tmp_path / "out")],
        env={"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.startswith("finetune.py: error: apex_strict_kernels=True") and "no CUDA GPU" in out.stderr
    assert not (tmp_path / "out").exists()


# A Hub id that does not exist and no data: a flag checked after the tokenizer or the data loads fails on those instead
NOTHING_LOADS = ["--task", "sst2", "--model_type", "bert", "--tokenizer_name", "hf-apex-tests/no-such-tokenizer"]
NOTHING_LOADS += ["--data_dir", "no-such-data", "--use_cpu"]


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--per_device_train_batch_size", "0", "per_device_train_batch_size"),  # ApexTrainingArguments' own checks
        ("--max_steps", "-5", "max_steps"),
        ("--metrics_warmup_steps", "-1", "metrics_warmup_steps must be >= 0, got -1"),
        ("--max_train_samples", "0", "--max_train_samples must be >= 1, got 0."),  # the script's
    ],
)
def test_a_flag_out_of_range_stops_in_one_line_before_anything_loads(flag, value, says, tmp_path):
    out = run_cli(*NOTHING_LOADS, flag, value, "--output_dir", str(tmp_path / "out"), env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("finetune.py: error: ") and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert says in out.stderr and value in out.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "field, value",
    [("max_train_samples", 0), ("max_eval_samples", -1), ("block_size", 0), ("max_seq_length", -128)],
)
def test_the_scripts_numbers_out_of_range_are_refused(field, value):
    with pytest.raises(finetune.InputError, match=f"^--{field} must be >= 1, got {value}.$"):
        finetune.check_args(
            finetune.ScriptArguments(model_type="bert", tokenizer_name="bert-base-uncased", **{field: value})
        )


@pytest.mark.parametrize(
    "flags, says",
    [
        (dict(model_type="bertt"), "--model_type bertt: no such architecture in transformers (did you mean bert"),
        (dict(model_type="gpt2", config_overrides="n_layers=2"), "n_layers=2: key n_layers isn't in the original"),
        (dict(model_type="gpt2", config_overrides="n_layer=two"), "n_layer=two: invalid literal for int()"),
    ],
)
def test_a_bad_architecture_or_override_is_refused_before_the_data_loads(flags, says):
    with pytest.raises(finetune.InputError, match=re.escape(says)):
        finetune.check_args(finetune.ScriptArguments(tokenizer_name="gpt2", **flags))


def fake_checkpoint(folder: Path, step: int) -> Path:
    (folder / f"checkpoint-{step}").mkdir(parents=True)
    (folder / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder / f"checkpoint-{step}"


def test_a_folder_of_checkpoints_is_refused_before_the_data_loads(word_tokenizer, tmp_path):
    """A second run into the --output_dir of a first would train from scratch over its checkpoints."""
    out = tmp_path / "out"
    for step in (3, 12):
        fake_checkpoint(out, step)
    with pytest.raises(finetune.InputError) as refused:  # (before the missing --data_dir is noticed)
        finetune.main(recipe_args("sst2", tmp_path / "no-such-data", word_tokenizer, out))
    assert str(refused.value) == (
        f"--output_dir {out} holds checkpoints of an earlier run: continue it with --resume_from_checkpoint "
        f"{out / 'checkpoint-12'}, or give a fresh --output_dir (--overwrite_output_dir starts over here, deleting "
        "them)."
    )
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-12", "checkpoint-3"]


def test_overwrite_output_dir_starts_over_there(generated_data, word_tokenizer, tmp_path):
    out = tmp_path / "out"
    fake_checkpoint(out, 3)
    (out / "checkpoint-notes").mkdir()  # not a checkpoint's name: kept
    finetune.main(
        recipe_args("sst2", generated_data, word_tokenizer, out, "--max_steps", "2", "--overwrite_output_dir")
    )
    assert not (out / "checkpoint-3").exists() and (out / "checkpoint-notes").is_dir()
    assert metrics_of(out)["train"]["train_loss"] > 0 and (out / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "resume, extra, says",
    [
        ("out/checkpoint-9", [], "--resume_from_checkpoint {tmp}/out/checkpoint-9: no such folder."),
        (
            "out",
            [],
            "--resume_from_checkpoint {tmp}/out: not a Trainer checkpoint (holds checkpoints, the last is "
            "{tmp}/out/checkpoint-3).",
        ),
        ("out/checkpoint-3", ["--overwrite_output_dir"], "--overwrite_output_dir starts over: give one."),
    ],
    ids=["missing", "output-dir", "and-overwrite"],
)
def test_a_resume_that_cannot_work_is_refused_before_the_data_loads(resume, extra, says, word_tokenizer, tmp_path):
    fake_checkpoint(tmp_path / "out", 3)
    argv = recipe_args("sst2", tmp_path / "no-such-data", word_tokenizer, tmp_path / "out", *extra)
    with pytest.raises(finetune.InputError, match=re.escape(says.format(tmp=tmp_path))):
        finetune.main([*argv, "--resume_from_checkpoint", str(tmp_path / resume)])


def test_a_typo_gets_a_short_error_with_the_choices():
    out = run_cli("--stage", "fused")
    assert out.returncode == 2 and "invalid choice: 'fused'" in out.stderr and "fused_full" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "flags, multiple",
    [(["--stage", "compiled", "--torch_compile_backend", "cudagraphs"], 16), (["--stage", "torch_fused"], 1)],
    ids=["cuda-graphs", "eager"],
)
def test_sst2_batches_take_few_shapes_under_cuda_graphs(generated_data, word_tokenizer, tmp_path, flags, multiple):
    # Each new batch shape records new CUDA graphs: under them the collator pads to a multiple of 16 tokens
    parser = finetune.Parser((finetune.ScriptArguments, finetune.ApexTrainingArguments))
    argv = recipe_args("sst2", generated_data, word_tokenizer, tmp_path / "out", *flags)
    script_args, args = parser.parse_args_into_dataclasses(args=argv)
    tokenizer = finetune.load_tokenizer(script_args)
    model = finetune.load_model(script_args, tokenizer)
    raw = finetune.load_raw_data(script_args)
    train, _, collator, _ = finetune.prepare_sst2(script_args, raw, tokenizer, model, args)
    rows = [train[i] for i in range(8)]
    longest = max(len(r["input_ids"]) for r in rows)
    batch = collator(rows)
    assert longest % 16 and batch["input_ids"].shape[1] == -(-longest // multiple) * multiple
    assert (batch["attention_mask"].sum(1) == torch.tensor([len(r["input_ids"]) for r in rows])).all()


def test_the_stock_trainer_trains_with_the_same_metrics_and_no_apex(generated_data, word_tokenizer, tmp_path):
    """--trainer stock: transformers' own Trainer (no norm swapped, torch's optimizer), measured by the same callback,
    under the name the bench's rows take."""
    extra = ["--trainer", "stock", "--optim", "adamw_torch", "--block_size", "32", "--max_steps", "3"]
    finetune.main(recipe_args("wikitext2", generated_data, word_tokenizer, tmp_path / "out", *extra))
    m = metrics_of(tmp_path / "out")
    assert m["stage"] == "stock" and m["run"]["optimizer"] == "AdamW" and "rewire" not in m
    assert m["run"]["steps"] == 3 and m["tokens_per_s"] > 0 and "eval_perplexity" in m["eval"]
    args = finetune.ApexTrainingArguments(output_dir="o", use_liger_kernel=True, torch_compile=True)
    assert finetune.reference_name(args) == "liger_compiled"


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--stage", "fastest"], "--stage fastest needs --trainer apex"),
        (["--apex_fused_norms", "true", "--autotune", "true"], "--apex_fused_norms, --autotune: apex switches"),
    ],
)
def test_the_stock_trainer_refuses_what_it_would_ignore(flags, says, word_tokenizer, tmp_path):
    with pytest.raises(finetune.InputError, match=re.escape(says)):  # (before the missing data is noticed)
        finetune.main(
            recipe_args(
                "sst2", tmp_path / "no-such-data", word_tokenizer, tmp_path / "o", "--trainer", "stock", *flags
            )
        )
