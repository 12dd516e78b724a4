import dataclasses
import subprocess
import sys

import pytest
from transformers import HfArgumentParser
from transformers.utils import is_torch_bf16_gpu_available

from hf_apex import STAGES, ApexTrainingArguments, StageRecipe
from hf_apex.policy import why_not_compile
from hf_apex.training_args import graph_norm_kernel, uses_cuda_graphs


def make(**kw):
    return ApexTrainingArguments(output_dir="unused", use_cpu=True, report_to="none", **kw)


@pytest.mark.parametrize(
    "stage, apex_optimizer, fused_norms, bf16",
    [
        ("baseline", "none", False, False),
        ("fused_adam", "fused_adam", False, False),
        ("fused_adam_ln", "fused_adam", True, False),
        ("fused_full", "fused_adam", True, True),
    ],
)
def test_stage_sets_its_switches(stage, apex_optimizer, fused_norms, bf16):
    args = make(stage=stage)
    assert args.apex_optimizer == apex_optimizer
    assert args.apex_fused_norms is fused_norms
    assert args.bf16 is bf16 and args.fp16 is False
    assert args.tf32 is False
    assert args.optim == "adamw_torch"  # foreach torch AdamW, not the fused default
    assert args.mixed_precision == ("bf16" if bf16 else "no")


@pytest.mark.parametrize(
    "stage, optim, apex_optimizer, fused_norms, compile_, autotune",
    [
        ("torch_fused", "adamw_torch_fused", "none", False, False, False),
        ("compiled", "adamw_torch_fused", "none", False, True, False),
        ("auto", "adamw_torch", "fused_adam", True, True, True),
    ],
)
def test_beyond_seed_stages(stage, optim, apex_optimizer, fused_norms, compile_, autotune):
    args = make(stage=stage)
    assert (args.optim, args.apex_optimizer, args.apex_fused_norms) == (optim, apex_optimizer, fused_norms)
    assert (args.torch_compile, args.autotune, args.bf16, args.tf32) == (compile_, autotune, True, False)


def test_fastest_compiles_with_cuda_graphs_in_one_process_only(monkeypatch, caplog):
    assert make(stage="fastest").torch_compile_mode == "reduce-overhead"
    assert make(stage="compiled").torch_compile_mode is None
    assert make(stage="fastest", torch_compile_mode="max-autotune").torch_compile_mode == "max-autotune"  # yours wins
    # Under torchrun (WORLD_SIZE=2): the stage's row applied again, since building arguments there would set up
    # torch.distributed for the rest of this process
    args, yours = make(stage="fastest"), make(stage="fastest", torch_compile_mode="reduce-overhead")
    args.torch_compile_mode = None
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level("WARNING", logger="hf_apex"):
        args._apply_stage()
        yours._apply_stage()
    assert args.torch_compile and args.torch_compile_mode is None
    assert "2 processes (unmeasured with more than one process), so torch.compile keeps its default" in caplog.text
    assert yours.torch_compile_mode == "reduce-overhead"


def test_cuda_graphs_are_not_asked_to_accumulate_gradients(caplog):
    # The stage's default gives way (a warning); a mode of yours that records CUDA graphs is refused
    with caplog.at_level("WARNING", logger="hf_apex"):
        args = make(stage="fastest", gradient_accumulation_steps=2)
    assert args.torch_compile and args.torch_compile_mode is None
    assert "gradient_accumulation_steps=2" in caplog.text and "pytorch/pytorch#169545" in caplog.text
    for stage in ("fastest", None):
        with pytest.raises(ValueError, match="cannot accumulate gradients"):
            make(stage=stage, torch_compile_mode="reduce-overhead", gradient_accumulation_steps=2)
    # Modes without CUDA graphs accumulate as they do anywhere
    assert make(stage="fastest", torch_compile_mode="max-autotune-no-cudagraphs", gradient_accumulation_steps=2)
    assert make(stage="fastest", gradient_accumulation_steps=1).torch_compile_mode == "reduce-overhead"
    # torch.compile's cudagraphs backend records CUDA graphs too (cudagraph trees, without Inductor)
    with pytest.raises(ValueError, match="torch_compile_backend='cudagraphs' records CUDA graphs"):
        make(stage="compiled", torch_compile_backend="cudagraphs", gradient_accumulation_steps=2)
    graphed = make(stage="compiled", torch_compile_backend="cudagraphs")
    assert uses_cuda_graphs(graphed) and not uses_cuda_graphs(make(stage="compiled"))
    assert uses_cuda_graphs(make(stage="fastest")) and not uses_cuda_graphs(make(stage="torch_fused"))


def test_auto_replays_its_eager_kernels_as_cuda_graphs_in_one_process_only(monkeypatch, caplog):
    args = make(stage="auto")
    assert (args.torch_compile, args.torch_compile_backend, args.torch_compile_mode) == (True, "cudagraphs", None)
    assert uses_cuda_graphs(args) and graph_norm_kernel(args) == "apex" and args.recipe.min_steps == 2500
    # Without a GPU the trainer runs the eager kernels as they are (hf_apex.policy.why_not_compile; this machine)
    assert "no CUDA GPU" in why_not_compile(make(stage="auto", max_steps=5000), None)
    assert graph_norm_kernel(make(stage="fastest")) == graph_norm_kernel(make(stage="compiled")) == "torch"
    # A backend of yours wins (a default of the stage, as the mode is)
    inductor = make(stage="auto", torch_compile_backend="inductor")
    assert inductor.torch_compile_backend == "inductor" and not uses_cuda_graphs(inductor)
    assert graph_norm_kernel(inductor) == "torch"
    # Gradient accumulation, or more than one process: the stage runs eager (graphs of eager kernels, without them)
    with caplog.at_level("WARNING", logger="hf_apex"):
        accumulating = make(stage="auto", gradient_accumulation_steps=2)
    assert not accumulating.torch_compile and not uses_cuda_graphs(accumulating)
    assert "stage 'auto': gradient_accumulation_steps=2" in caplog.text and "runs eager" in caplog.text
    # A backend of yours is yours: with accumulation it is refused, as anywhere
    with pytest.raises(ValueError, match="torch_compile_backend='cudagraphs' records CUDA graphs"):
        make(stage="auto", torch_compile_backend="cudagraphs", gradient_accumulation_steps=2)
    args.torch_compile_backend = None
    monkeypatch.setenv("WORLD_SIZE", "2")
    args._apply_stage()
    assert not args.torch_compile and not uses_cuda_graphs(args)
    assert "stage 'auto': 2 processes" in caplog.text


def test_a_stage_owns_its_recipe_and_yours_overrides_single_entries():
    fastest = make(stage="fastest")
    assert fastest.recipe == STAGES["fastest"].recipe
    assert (fastest.recipe.recompute_pointwise, fastest.recipe.fuse_projections) == ("auto", "auto")
    assert fastest.recipe.rotary_once and fastest.recipe.eager_random and fastest.recipe.min_steps == 500
    assert make(stage="compiled").recipe == StageRecipe()  # torch's defaults; static masks on every stage
    yours = make(stage="fastest", stage_recipe={"fuse_projections": False, "min_steps": 0})
    assert (yours.recipe.fuse_projections, yours.recipe.min_steps) == ("false", 0)  # (False stands for "false")
    assert yours.recipe.rotary_once and yours.recipe.recompute_pointwise == "auto"  # the rest stays the stage's
    as_json = make(stage="fastest", stage_recipe='{"eager_random": false}')  # the CLI's form
    assert as_json.stage_recipe["eager_random"] is False and as_json.recipe.rotary_once
    assert make(stage="fastest", stage_recipe=StageRecipe(min_steps=7)).recipe == StageRecipe(min_steps=7)
    assert make(stage="compiled", stage_recipe={"rotary_once": True}).recipe.rotary_once


@pytest.mark.parametrize(
    "recipe, match",
    [
        ({"fuse_projections": "sometimes"}, "fuse_projections must be one of"),
        ({"recompute_pointwise": "yes"}, "recompute_pointwise must be one of"),
        ({"min_steps": -1}, "min_steps must be an integer >= 0"),
        ({"turbo": True}, r"unknown entries \['turbo'\]; its entries are \['min_steps'"),
        ("[1, 2]", "stage_recipe must be a dict"),
        ("{bad json", r"stage_recipe is not a JSON object \(Expecting property name"),  # (the CLI's form, mistyped)
    ],
)
def test_a_bad_recipe_entry_is_a_value_error_naming_it(recipe, match):
    with pytest.raises(ValueError, match=match):
        make(stage="fastest", stage_recipe=recipe)


@pytest.mark.parametrize(
    "entry", [{"rotary_once": True}, {"eager_random": True}, {"fuse_projections": "auto"}, {"compile_cache": False}]
)
def test_a_compiled_recipe_entry_on_a_run_that_does_not_compile_is_an_error(entry):
    for stage in ("torch_fused", None):
        with pytest.raises(ValueError, match="changes what torch.compile does, but torch_compile is off"):
            make(stage=stage, stage_recipe=entry)
    assert make(stage="torch_fused", stage_recipe={"static_masks": False}).recipe.static_masks is False  # any run
    assert make(stage="torch_fused", stage_recipe={"fp32_outputs": True}).recipe.fp32_outputs is True
    assert make(stage="torch_fused", stage_recipe={"rotary_once": False}).recipe == StageRecipe()  # (a no-op)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(per_device_train_batch_size=0), "per_device_train_batch_size must be >= 1, got 0"),
        (dict(per_device_eval_batch_size=-2), "per_device_eval_batch_size must be >= 1, got -2"),
        (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps must be >= 1"),
        (dict(max_steps=-5), "max_steps must be a positive number of optimizer steps, or -1"),
        (dict(max_steps=0), "max_steps must be a positive number"),
        (dict(num_train_epochs=0), "num_train_epochs must be > 0"),
        (dict(learning_rate=-1e-3), "learning_rate must be >= 0"),
    ],
)
def test_numbers_out_of_range_are_refused_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as refused:
        make(**kw)
    assert "\n" not in str(refused.value)
    assert make(max_steps=-1).max_steps == -1 and make(max_steps=3, num_train_epochs=0).max_steps == 3


def test_fused_full_with_fp16():
    args = make(stage="fused_full", amp_dtype="fp16")
    assert args.fp16 and not args.bf16
    assert make(stage="fused_full", fp16=True).amp_dtype == "fp16"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(stage="baseline", bf16=True), "bf16=False, but you set bf16=True"),
        (dict(stage="fused_adam_ln", fp16=True), "FP32"),
        (dict(stage="fused_adam", tf32=True), "tf32"),
        (dict(stage="baseline", apex_optimizer="fused_adam"), "apex_optimizer"),
        (dict(stage="fused_adam", apex_optimizer="fused_lamb"), "apex_optimizer"),
        (dict(stage="fused_adam", apex_fused_norms=True), "apex_fused_norms"),
        (dict(stage="baseline", optim="sgd"), "optim"),
        (dict(stage="fused_full", bf16=True, amp_dtype="fp16"), "amp_dtype"),
        (dict(stage="fused_full", bf16=True, fp16=True), "fp16"),
        (dict(amp_dtype="fp8"), "amp_dtype"),
        (dict(stage="warp_speed"), "Unknown stage"),
        (dict(stage="fused_full", torch_compile=True), "torch_compile"),
        (dict(stage="fused_full", autotune=True), "autotune"),
        (dict(stage="torch_fused", torch_compile_mode="reduce-overhead"), "does not compile.*torch_compile_mode"),
        (dict(stage="baseline", torch_compile_backend="inductor"), "does not compile.*torch_compile_backend"),
        (dict(stage="torch_fused", optim="adamw_torch"), "optim"),
        (dict(apex_optimizer="adamax"), "apex_optimizer"),
        (dict(metrics_warmup_steps=-1), "metrics_warmup_steps"),
    ],
)
def test_contradictions_are_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


@pytest.mark.skipif(is_torch_bf16_gpu_available(), reason="a GPU that runs BF16 takes a BF16 stage without use_cpu")
def test_a_bf16_stage_without_a_gpu_names_the_stage_and_the_two_ways_on():
    with pytest.raises(ValueError) as refused:
        ApexTrainingArguments(output_dir="unused", report_to="none", stage="fused_full")
    message = str(refused.value)
    assert message == (
        "stage='fused_full' runs BF16 autocast and no GPU here runs BF16: on a CPU take an FP32 stage "
        "(baseline, fused_adam, fused_adam_ln) with use_cpu=True, or keep this stage and set use_cpu=True "
        "(--use_cpu on the command line)."
    )
    assert ApexTrainingArguments(output_dir="unused", report_to="none", stage="fused_full", use_cpu=True).bf16
    assert not ApexTrainingArguments(output_dir="unused", report_to="none", stage="fused_adam_ln").bf16
    with pytest.raises(ValueError, match="doesn't support bf16"):  # no stage: transformers' own refusal
        ApexTrainingArguments(output_dir="unused", report_to="none", bf16=True)


def test_no_stage_leaves_trainingarguments_defaults():
    args = make()
    plain = dataclasses.fields(ApexTrainingArguments)
    assert args.stage is None and args.apex_optimizer == "none" and not args.apex_fused_norms
    assert args.optim == next(f.default for f in plain if f.name == "optim")


def test_round_trip_through_to_dict_is_stable():
    args = make(stage="fused_full", apex_optimizer_kwargs='{"bias_correction": false}')
    assert args.apex_optimizer_kwargs == {"bias_correction": False}
    again = ApexTrainingArguments(**args.to_dict())
    assert (again.bf16, again.apex_optimizer, again.apex_fused_norms) == (True, "fused_adam", True)
    eager_auto = make(stage="auto", gradient_accumulation_steps=2)  # its recipe's min_steps stands, uncompiled
    assert ApexTrainingArguments(**eager_auto.to_dict()).recipe == eager_auto.recipe == STAGES["auto"].recipe


def test_cli_parsing():
    (args,) = HfArgumentParser(ApexTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "o", "--stage", "fused_adam_ln", "--use_cpu", "--metrics_warmup_steps", "2"]
    )
    assert args.apex_fused_norms and args.metrics_warmup_steps == 2
    with pytest.raises(SystemExit):
        HfArgumentParser(ApexTrainingArguments).parse_args_into_dataclasses(["--stage", "nope"])
    (args,) = HfArgumentParser(ApexTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "o", "--stage", "fastest", "--use_cpu", "--stage_recipe", '{"recompute_pointwise": "false"}']
    )
    assert args.recipe.recompute_pointwise == "false" and args.recipe.fuse_projections == "auto"


def test_help_works_without_apex_and_lists_every_field():
    code = (
        "import sys; from transformers import HfArgumentParser; from hf_apex import ApexTrainingArguments; "
        "HfArgumentParser(ApexTrainingArguments).parse_args_into_dataclasses(['--help'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for name in (
        "--stage",
        "--apex_optimizer",
        "--apex_fused_norms",
        "--apex_strict_kernels",
        "--peak_tflops",
        "--metrics_warmup_steps",
        "--amp_dtype",
        "--profile_kernels",
    ):
        assert name in out.stdout
    assert all(s in out.stdout for s in STAGES)


def test_every_field_has_help():
    own = {f.name for f in dataclasses.fields(ApexTrainingArguments)} - {
        f.name for f in dataclasses.fields(ApexTrainingArguments.__mro__[1])
    }
    assert own
    for f in dataclasses.fields(ApexTrainingArguments):
        if f.name in own:
            assert f.metadata.get("help"), f.name
            assert f.name in ApexTrainingArguments.__doc__, f.name


def test_docs_arguments_names_every_added_argument_and_recipe_entry():
    from pathlib import Path

    from hf_apex.training_args import ADDED_ARGUMENTS

    text = (Path(__file__).resolve().parents[1] / "docs" / "arguments.md").read_text()
    missing = [n for n in ADDED_ARGUMENTS if f"**`{n}`**" not in text]
    missing += [f.name for f in dataclasses.fields(StageRecipe) if f"`{f.name}`" not in text]
    assert not missing, f"docs/arguments.md does not describe {missing}"
