import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_apex import STAGES, ApexTrainer, ApexTrainingArguments, StageMetricsCallback
from hf_apex.kernels.apex.norms import is_swapped
from hf_apex.kernels.apex.optim import FusedAdamFallback
from hf_apex.measure.report import METRICS_FILENAME, process_age_s, summary_lines
from hf_apex.policy import fsdp_version, validate_apex_args
from tests.testing_utils import TokenDataset, tiny_model

SEED_STAGES = list(STAGES)[:4]


def train_args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=6,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-3,
        weight_decay=0.1,
        metrics_warmup_steps=2,
        disable_tqdm=True,
        seed=0,
    )
    return ApexTrainingArguments(**{**base, **kw})


@pytest.mark.parametrize("stage", SEED_STAGES)
def test_every_stage_trains_and_writes_its_metrics(stage, tmp_path, caplog):
    model = tiny_model("gpt2").train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = ApexTrainer(model=model, args=train_args(tmp_path, stage=stage), train_dataset=TokenDataset())
    with caplog.at_level("INFO", logger="hf_apex"):
        trainer.train()

    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    assert metrics["stage"] == stage
    assert metrics["run"]["steps"] == 6 and metrics["run"]["timed_steps"] == 4
    assert metrics["run"]["seq_len"] == 16
    assert metrics["step_time_ms"]["p50"] > 0 and metrics["tokens_per_s"] > 0
    assert metrics["run"]["precision"] == ("bf16" if stage == "fused_full" else "fp32")
    assert metrics["provenance"]["torch"] == torch.__version__
    calls = metrics["kernels"]["calls"]
    if stage == "baseline":
        assert type(trainer.optimizer.optimizer) is torch.optim.AdamW
        assert calls == {} and metrics["rewire"] is None
    else:
        # No apex kernels on this machine: the fallback is stated, with its reason, never silent.
        assert type(trainer.optimizer.optimizer) is FusedAdamFallback
        assert calls["optimizer"]["apex"] == 0 and calls["optimizer"]["fallback"] == 6
        assert sum(calls["optimizer"]["fallback_reasons"].values()) == 6  # "cpu tensors (apex kernels need CUDA...)"
    if stage in ("fused_adam_ln", "fused_full"):
        assert metrics["rewire"]["num_swapped"] == 5
        assert calls["layer_norm"]["fallback"] == 5 * 6 and calls["layer_norm"]["apex"] == 0
        assert is_swapped(model.transformer.h[0].ln_1)
    else:
        assert not is_swapped(model.transformer.h[0].ln_1)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    # A step's time runs to the next step's start, so each log reports the steps before it.
    assert len(logged) == 6 and all("step_time_ms" in h and "tokens_per_s" in h for h in logged[1:])
    assert [h["loss"] for h in metrics["loss_history"]] == [h["loss"] for h in logged]
    # The console says what the run bought, with the JSON's figures
    head = f"hf_apex: stage {stage}, 4 timed steps after 2 warm-up ({metrics['run']['precision']}): "
    assert head + f"{metrics['step_time_ms']['p50']:,.1f} ms/step p50" in caplog.text
    assert f"{metrics['tokens_per_s']:,.0f} tokens/s" in caplog.text and "peak memory n/a (no CUDA)" in caplog.text
    if stage != "baseline":
        assert "optimizer 0 apex / 6 fallback (cpu tensors" in caplog.text
    else:
        assert "hf_apex: calls: no apex component in this run" in caplog.text


def test_the_end_of_run_line_says_when_the_norms_ran_inside_cuda_graphs():
    """From the committed H200 bench: Llama's `auto` replayed apex's RMSNorm inside CUDA graphs, where no call is
    counted, and its line said "no apex component in this run" beside the apex kernels the profiler saw."""
    run = Path(__file__).parents[1] / "benchmarks" / "h200-2026-12-02-whole" / "runs" / "llama-auto"
    metrics = json.loads((run / METRICS_FILENAME).read_text())
    assert summary_lines(metrics)[1] == (
        "hf_apex: calls: norms: apex's kernel inside the CUDA graphs (the cudagraphs backend: no code generation), "
        "not counted per call; apex kernels seen running: rms_norm, norm_backward"
    )
    eager = copy.deepcopy(metrics)  # norms that ran eager (a run too short to compile) are counted instead
    eager["kernels"]["calls"]["rms_norm"] = {"apex": 70, "fallback": 0, "fallback_reasons": {}}
    assert summary_lines(eager)[1].startswith("hf_apex: calls: rms_norm 70 apex / 0 fallback; apex kernels seen")


def test_fused_stages_match_baseline_maths_on_cpu(tmp_path):
    """Same hyper-parameters and maths in every FP32 stage: the fallback kernels track the baseline closely."""
    losses = {}
    for stage in ("baseline", "fused_adam", "fused_adam_ln"):
        trainer = ApexTrainer(
            model=tiny_model("gpt2").train(),
            args=train_args(tmp_path / stage, stage=stage),
            train_dataset=TokenDataset(),
        )
        trainer.train()
        losses[stage] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    torch.testing.assert_close(losses["fused_adam"], losses["baseline"], rtol=1e-4, atol=1e-5)
    assert losses["fused_adam_ln"] == losses["fused_adam"]


def test_norm_weights_stay_in_the_no_decay_group(tmp_path):
    model = tiny_model("gpt2")
    trainer = ApexTrainer(model=model, args=train_args(tmp_path, stage="fused_adam_ln"), train_dataset=TokenDataset())
    optimizer = trainer.create_optimizer()
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ln_weight = model.transformer.h[0].ln_1.weight
    assert any(p is ln_weight for p in no_decay["params"])
    assert not any(p is ln_weight for p in decay["params"])


def test_model_init_models_are_rewired_every_time(tmp_path):
    built = []

    def model_init():
        built.append(tiny_model("gpt2").train())
        return built[-1]

    trainer = ApexTrainer(
        model_init=model_init,
        args=train_args(tmp_path, stage="fused_adam_ln", max_steps=2),
        train_dataset=TokenDataset(),
    )
    trainer.train()
    assert len(built) == 2  # once in __init__, again in train()
    assert all(is_swapped(m.transformer.ln_f) for m in built)
    assert trainer.plan.norms.report.num_swapped == 5


def test_plain_training_arguments_behave_like_trainer(tmp_path):
    model = tiny_model("gpt2")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=2, save_strategy="no")
    trainer = ApexTrainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train()
    assert trainer.stage_metrics is None and trainer.plan is None
    assert not any(is_swapped(m) for m in model.modules())
    assert not (tmp_path / METRICS_FILENAME).exists()
    assert type(trainer.optimizer.optimizer).__name__ == "AdamW"


@pytest.mark.parametrize(
    "kw, env, match",
    [
        (dict(stage="fused_adam", apex_strict_kernels=True), {}, "no CUDA GPU"),
        (dict(stage="fused_adam_ln", apex_strict_kernels=True), {}, "apex_strict_kernels=True but"),
        (dict(apex_optimizer="fused_lamb"), {}, "fused_lamb"),
        (dict(stage="fused_adam"), {"ACCELERATE_USE_FSDP": "true"}, "FSDP1"),
        (dict(apex_fused_norms=True, torch_compile=True, apex_strict_kernels=True, bf16=True), {}, "torch.compile"),
    ],
)
def test_validation_errors_before_training(tmp_path, monkeypatch, kw, env, match):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # as on a CPU machine, whatever this one is
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        ApexTrainer(model=tiny_model("gpt2"), args=train_args(tmp_path, **kw), train_dataset=TokenDataset())


def test_fsdp2_is_accepted_with_apex_optimizers(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    validate_apex_args(train_args(tmp_path, stage="fused_adam"))  # no error: apex steps the local shards
    with pytest.raises(ValueError, match="fused_lamb.*FSDP2"):  # LAMB's trust ratios need whole parameters
        validate_apex_args(train_args(tmp_path, apex_optimizer="fused_lamb"))
    with pytest.raises(ValueError, match="master_weights"):
        validate_apex_args(train_args(tmp_path, stage="fused_adam", apex_optimizer_kwargs={"master_weights": True}))
    # transformers' own flags (TrainingArguments refuses FSDP without a GPU, so a stand-in carries them)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    assert fsdp_version(SimpleNamespace(fsdp=True, fsdp_config={})) == 2  # transformers' default
    assert fsdp_version(SimpleNamespace(fsdp=True, fsdp_config={"version": 1})) == 1
    assert fsdp_version(SimpleNamespace(fsdp=False, fsdp_config=None)) is None


def test_stock_trainer_with_the_callback_writes_metrics(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=4,
        save_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=2,
    )
    callback = StageMetricsCallback(stage="custom", warmup_steps=1)
    trainer = Trainer(
        model=tiny_model("bert").train(), args=args, train_dataset=TokenDataset(task="cls"), callbacks=[callback]
    )
    before = process_age_s()
    trainer.train()
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    assert metrics["stage"] == "custom" and metrics["run"]["timed_steps"] == 3
    # what the process spent before training: at least its age when train() was called, less than its age now
    assert before <= metrics["run"]["startup_s"] <= process_age_s() - metrics["run"]["wall_time_s"] + 0.05
    assert metrics["tokens_per_s"] > 0 and metrics["samples_per_s"] > 0
    assert metrics["mfu"] is None  # no GPU, no peak: MFU is not invented
    assert not callback._window  # nothing merges the window on a stock Trainer: each log drops it


def test_a_train_that_raised_leaves_no_hook_behind(tmp_path):
    class FailsOnce(TokenDataset):
        fail_at = 10  # items fetched before the first run dies (as an OOM retry or a Ctrl-C would)

        def __getitem__(self, i):
            self.fail_at -= 1
            if self.fail_at == 0:
                raise RuntimeError("interrupted")
            return super().__getitem__(i)

    model = tiny_model("gpt2").train()
    trainer = ApexTrainer(model=model, args=train_args(tmp_path, stage="baseline"), train_dataset=FailsOnce())
    with pytest.raises(RuntimeError, match="interrupted"):
        trainer.train()
    trainer.train()
    assert [s.tokens for s in trainer.stage_metrics.steps] == [4 * 16] * 6  # counted once, not by two hooks
    assert not model._forward_pre_hooks


def test_a_rewired_model_reused_for_baseline_gets_its_stock_norms_back(tmp_path):
    model = tiny_model("gpt2").train()
    ApexTrainer(model=model, args=train_args(tmp_path / "ln", stage="fused_adam_ln"), train_dataset=TokenDataset())
    assert any(is_swapped(m) for m in model.modules())
    trainer = ApexTrainer(
        model=model, args=train_args(tmp_path / "base", stage="baseline"), train_dataset=TokenDataset()
    )
    trainer.train()
    assert not any(is_swapped(m) for m in model.modules())
    metrics = json.loads((tmp_path / "base" / METRICS_FILENAME).read_text())
    assert metrics["rewire"] is None and "layer_norm" not in metrics["kernels"]["calls"]


def test_peak_tflops_override_gives_mfu(tmp_path):
    trainer = ApexTrainer(
        model=tiny_model("gpt2").train(),
        args=train_args(tmp_path, stage="baseline", peak_tflops=1.0),
        train_dataset=TokenDataset(),
    )
    trainer.train()
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    fpt = 6 * metrics["model"]["matmul_params"] + 12 * 2 * 32 * 16
    assert metrics["mfu"] == pytest.approx(fpt * metrics["tokens_per_s"] / 1e12, rel=1e-9)
    assert "12*L*A*T" in metrics["mfu_formula"] and "no halving" in metrics["mfu_formula"]
    # the formula's N leaves the embeddings, norms and biases out; "parameters" is the model's count
    assert metrics["model"]["parameters"] == sum(p.numel() for p in trainer.model.parameters())
    assert metrics["model"]["parameters"] > metrics["model"]["matmul_params"]


def test_tokens_come_from_the_attention_mask(tmp_path):
    class Padded(TokenDataset):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            item["attention_mask"] = torch.cat([torch.ones(10, dtype=torch.long), torch.zeros(6, dtype=torch.long)])
            return item

    args = train_args(tmp_path, stage="baseline", max_steps=3)
    trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=Padded())
    trainer.train()
    steps = trainer.stage_metrics.steps
    assert [s.tokens for s in steps] == [4 * 10] * 3 and [s.samples for s in steps] == [4] * 3
    assert [s.positions for s in steps] == [4 * 16] * 3  # MFU counts padded positions: the GPU computes them


@pytest.mark.parametrize("stage", ["baseline", "fused_adam"])
def test_resume_from_checkpoint_continues_the_same_trajectory(stage, tmp_path):
    def run(out, max_steps=6, resume=None):
        args = train_args(out, stage=stage, max_steps=max_steps, save_strategy="steps", save_steps=3)
        trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset())
        trainer.train(resume_from_checkpoint=resume)
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        return trainer, losses

    straight, straight_losses = run(tmp_path / "run")
    # A fresh trainer resumes from the step-3 checkpoint that the uninterrupted run saved.
    again, again_losses = run(tmp_path / "run", resume=str(tmp_path / "run" / "checkpoint-3"))
    for step in (4, 5, 6):
        assert again_losses[step] == pytest.approx(straight_losses[step], rel=1e-6, abs=1e-7)
    if stage == "fused_adam":
        assert [g["step"] for g in again.optimizer.optimizer.param_groups] == [6, 6]
    # Warm-up counts from the resumed run's first step: steps 4 and 5 warm up, step 6 is timed.
    assert json.loads((tmp_path / "run" / METRICS_FILENAME).read_text())["run"]["timed_steps"] == 1
    for p, q in zip(straight.model.parameters(), again.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_torch_fused_stage_uses_torch_fused_adamw(tmp_path):
    trainer = ApexTrainer(
        model=tiny_model("gpt2").train(), args=train_args(tmp_path, stage="torch_fused"), train_dataset=TokenDataset()
    )
    trainer.train()
    optimizer = trainer.optimizer.optimizer
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    assert metrics["run"]["precision"] == "bf16" and metrics["kernels"]["calls"] == {}


# Gradient accumulation without CUDA graphs; with them, one micro-batch per step (they cannot accumulate). Graphs come
# from a mode that records them, or from torch's cudagraphs backend (no code generation; on a CPU it runs the traced
# kernels without graphs).
@pytest.mark.parametrize(
    "backend, mode, accumulation", [("eager", None, 2), ("eager", "reduce-overhead", 1), ("cudagraphs", None, 1)]
)
def test_compiled_stage_trains_and_reports_the_first_step(tmp_path, monkeypatch, backend, mode, accumulation):
    # The eager backend traces with Dynamo without generating code, which keeps this CPU test fast.
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    compiled = dict(stage="compiled", torch_compile_backend=backend, torch_compile_mode=mode)
    args = train_args(tmp_path, **compiled, gradient_accumulation_steps=accumulation)
    trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset())
    trainer.train()
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    assert metrics["run"]["torch_compile"] is True and metrics["run"]["first_step_ms"] > 0
    assert metrics["run"]["torch_compile_mode"] == mode  # the mode asked for ("reduce-overhead": CUDA graphs on a GPU)
    assert metrics["run"]["torch_compile_backend"] == backend
    # With CUDA graphs each optimizer step marks a new step (its outputs, the gradients among them, are done with)
    assert len(marks) == (args.max_steps if mode or backend == "cudagraphs" else 0)
    assert metrics["rewire"] is None  # native norms under compile
    assert len(metrics["loss_history"]) == 6


def test_recompute_pointwise_keeps_one_ffn_activation_for_the_backward_not_two(tmp_path):
    """By default a compiled step keeps its FFN's activation both before the GELU (for the GELU's backward) and
    after it (for the second matmul's); with the recipe's recompute_pointwise, only before it (the backward recomputes
    the GELU). The same losses; torch's default is back once a step is done; trainers one after another in a
    process each compile under their own setting (Dynamo alone would reuse the first one's graphs); and "auto"
    recomputes for BERT but not for a GPT-2 whose loss runs without the logits."""
    import torch._functorch.config as partitioner

    width, tokens = 48, 4 * 16  # the FFN's width (unlike any other here) and a batch's tokens

    class Recording(ApexTrainer):
        ffn_activations_kept = 0

        def training_step(self, *args, **kwargs):
            def pack(t):
                self.ffn_activations_kept += t.ndim > 0 and t.shape[-1] == width and t.numel() == tokens * width
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return super().training_step(*args, **kwargs)

    def run(name, family, recompute, **kw):
        # aot_eager: AOTAutograd's partitioner, as under Inductor, without generating code
        recipe = {} if recompute is None else {"recompute_pointwise": recompute}
        compiled = dict(torch_compile_backend="aot_eager", stage_recipe=recipe, **kw)
        args = train_args(tmp_path / name, max_steps=2, **compiled)
        if family == "bert":
            data = TokenDataset(task="cls")
            model = tiny_model("bert", intermediate_size=width, hidden_dropout_prob=0.0)
        else:
            model, data = tiny_model("gpt2", n_inner=width, resid_pdrop=0.0, embd_pdrop=0.0), TokenDataset()
        trainer = Recording(model=model.train(), args=args, train_dataset=data)
        trainer.train()
        assert partitioner.ban_recompute_materialized_backward is True  # (torch's default, outside the steps)
        kernels = json.loads((tmp_path / name / METRICS_FILENAME).read_text())["kernels"]
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return trainer.ffn_activations_kept, losses, kernels.get("compiled_backward", "")

    torch._dynamo.reset()
    bert = [run(str(i), "bert", value, stage="compiled") for i, value in enumerate((None, True, None, "auto"))]
    # GPT-2 with the logits-free loss (as fastest runs it, in FP32 here): "auto" keeps what torch keeps
    lm = dict(torch_compile=True, fused_linear_cross_entropy=True)
    gpt2 = [run(f"gpt2-{value}", "gpt2", value, **lm) for value in ("auto", "true")]
    torch._dynamo.reset()
    layers, steps = 2, 2
    assert [kept for kept, _, _ in bert] == [2 * layers * steps, layers * steps, 2 * layers * steps, layers * steps]
    for _, losses, _ in bert[1:]:
        assert losses == pytest.approx(bert[0][1], rel=1e-6)
    assert "recomputes" in bert[1][2] and "recomputes" in bert[3][2] and not bert[0][2]
    (auto_kept, auto_losses, auto_says), (true_kept, true_losses, _) = gpt2
    assert auto_kept == 2 * layers * steps and true_kept == layers * steps, (auto_kept, true_kept)
    assert true_losses == pytest.approx(auto_losses, rel=1e-6)
    assert auto_says.startswith("keeps") and "without the logits" in auto_says


def test_eager_random_draws_dropouts_masks_as_eager_mode_does(tmp_path):
    """With the recipe's eager_random, a run compiled by Inductor draws dropout masks with torch's own kernels: from
    the same seed, the same masks as the eager run, so the same losses (to the compiler's roundings). Without it,
    Inductor generates its own random numbers: other masks, other losses. The switch holds for the training steps
    only, and the metrics JSON says so."""
    import torch._inductor.config as inductor

    def losses(name, **switches):
        model = tiny_model("bert", hidden_dropout_prob=0.5, attention_probs_dropout_prob=0.0).train()
        args = train_args(tmp_path / name, max_steps=3, **switches)
        ApexTrainer(model=model, args=args, train_dataset=TokenDataset(task="cls")).train()
        assert inductor.fallback_random is False  # (torch's default, outside the steps)
        metrics = json.loads((tmp_path / name / METRICS_FILENAME).read_text())
        return [h["loss"] for h in metrics["loss_history"]], metrics["kernels"]

    torch._dynamo.reset()
    eager, _ = losses("eager")
    inductor_own, kernels = losses("inductor", torch_compile=True)
    assert "random_ops" not in kernels
    torch._dynamo.reset()  # (the next run compiles under its own setting: ApexTrainer resets between runs too)
    torch_own, kernels = losses("eager-random", torch_compile=True, stage_recipe={"eager_random": True})
    torch._dynamo.reset()
    assert kernels["random_ops"].startswith("torch's own kernels")
    assert torch_own == pytest.approx(eager, rel=1e-4)
    assert inductor_own != pytest.approx(eager, rel=1e-2)


def test_fuse_projections_runs_llamas_projections_as_two_matmuls_a_layer_in_inductor(tmp_path):
    """Under Inductor, the recipe's fuse_projections fuses each layer's q/k/v and gate/up projections (four groups in a
    two-layer Llama) with the losses of the run without it; under a backend that is not Inductor the metrics say
    why nothing was fused. torch's setting is its own again after the steps."""
    import torch._inductor.config as inductor
    from torch._dynamo.utils import counters

    from hf_apex.kernels.passes.projections import COUNTER

    def run(name, **switches):
        torch._dynamo.reset()
        fused_before = counters["inductor"][COUNTER]
        args = train_args(tmp_path / name, max_steps=3, torch_compile=True, **switches)
        with inductor.patch(force_disable_caches=True):  # (a graph from Inductor's caches skips the pass)
            ApexTrainer(model=tiny_model("llama").train(), args=args, train_dataset=TokenDataset()).train()
        assert inductor.pre_grad_custom_pass is None
        metrics = json.loads((tmp_path / name / METRICS_FILENAME).read_text())
        losses = [h["loss"] for h in metrics["loss_history"]]
        return losses, metrics["kernels"].get("projections", ""), counters["inductor"][COUNTER] - fused_before

    stock, says, fused = run("stock")
    assert not says and fused == 0
    losses, says, fused = run("fused", stage_recipe={"fuse_projections": True})
    assert fused == 2 * 2 and says.startswith("Inductor's pre-grad pass runs the linears")
    assert losses == pytest.approx(stock, rel=1e-5)
    _, says, fused = run("aot", stage_recipe={"fuse_projections": True}, torch_compile_backend="aot_eager")
    assert fused == 0 and says == "not fused: its pass is Inductor's, and torch_compile_backend='aot_eager'"
    _, says, fused = run("auto", stage_recipe={"fuse_projections": "auto"})  # a causal LM: left apart
    assert fused == 0 and says.startswith("not fused: fuse_projections=auto leaves a causal LM's")
    torch._dynamo.reset()


def test_fastest_fuses_projections_in_an_encoder_and_not_in_a_causal_lm(tmp_path):
    """`auto` (fastest's value): BERT's compiled steps run the pass, a Llama's and a GPT-2's do not."""
    from hf_apex.kernels.passes.projections import FUSE_SHARED_INPUT_LINEARS
    from hf_apex.policy import compile_settings

    args = ApexTrainingArguments(output_dir=str(tmp_path), stage="fastest", use_cpu=True)
    inductor = {family: compile_settings(args, tiny_model(family)) for family in ("bert", "llama", "gpt2")}
    passes = {f: s.get("torch._inductor.config", {}).get("pre_grad_custom_pass") for f, s in inductor.items()}
    assert passes == {"bert": FUSE_SHARED_INPUT_LINEARS, "llama": None, "gpt2": None}


def test_rotary_once_swaps_the_rotary_embedding_and_says_so(tmp_path):
    model = tiny_model("llama").train()
    switches = dict(torch_compile=True, torch_compile_backend="aot_eager", max_steps=2)
    ApexTrainer(
        model=model,
        args=train_args(tmp_path / "on", stage_recipe={"rotary_once": True}, **switches),
        train_dataset=TokenDataset(),
    ).train()
    kernels = json.loads((tmp_path / "on" / METRICS_FILENAME).read_text())["kernels"]
    assert kernels["rotary_embedding"].startswith("cos/sin computed once per compiled forward (1 module(s)")
    assert "hf_apex" in repr(model.model.rotary_emb)
    # A later trainer on the same model without the switch gives the rotary embedding its stock class back
    ApexTrainer(model=model, args=train_args(tmp_path / "off", **switches), train_dataset=TokenDataset()).train()
    assert "hf_apex" not in repr(model.model.rotary_emb)
    assert "rotary_embedding" not in json.loads((tmp_path / "off" / METRICS_FILENAME).read_text())["kernels"]
    torch._dynamo.reset()


def test_plain_training_arguments_are_not_let_accumulate_under_cuda_graphs(tmp_path):
    # ApexTrainingArguments refuse it (tests/test_training_args.py); ApexTrainer refuses it of plain ones too
    plain = dict(use_cpu=True, report_to="none", torch_compile_mode="reduce-overhead", gradient_accumulation_steps=2)
    args = TrainingArguments(output_dir=str(tmp_path), **plain)
    with pytest.raises(ValueError, match="cannot accumulate gradients"):
        ApexTrainer(model=tiny_model("gpt2"), args=args, train_dataset=TokenDataset())


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_evaluation_keeps_copies_of_what_the_next_cuda_graph_replay_overwrites(tmp_path, mode):
    model = tiny_model("gpt2").eval()
    args = train_args(tmp_path, stage="compiled", torch_compile_mode=mode)
    trainer = ApexTrainer(model=model, args=args, train_dataset=TokenDataset())
    produced = []
    model.register_forward_hook(lambda module, inputs, outputs: produced.append(outputs.logits))
    batch = trainer.data_collator([TokenDataset()[i] for i in range(2)])
    loss, logits, labels = trainer.prediction_step(model, batch, prediction_loss_only=False)
    assert torch.equal(logits, produced[0]) and loss.ndim == 0
    # Under CUDA graphs the model's outputs are views of a graph's memory: the Trainer's copy must be its own
    assert (logits.data_ptr() == produced[0].data_ptr()) is (mode is None)


def test_auto_stage_without_kernels_states_every_fallback(tmp_path):
    trainer = ApexTrainer(
        model=tiny_model("llama").train(), args=train_args(tmp_path, stage="auto"), train_dataset=TokenDataset()
    )
    trainer.train()
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    calls = metrics["kernels"]["calls"]
    assert calls["rms_norm"]["fallback"] > 0 and calls["optimizer"]["fallback"] == 6
    swapped = [m for m in trainer.model.modules() if is_swapped(m)]
    assert len(swapped) == 5 and all(m.hf_apex_chooser is not None for m in swapped)
    reason = "not timed: apex cannot run here (cpu tensors (apex kernels need CUDA tensors))"
    assert [(d["component"], d["reason"]) for d in metrics["autotune"]] == [("optimizer", reason), ("norms", reason)]


def test_every_run_logs_its_last_step_however_short(tmp_path):
    args = train_args(tmp_path, stage="baseline", max_steps=3, logging_steps=500)
    trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset())
    trainer.train()
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    assert [h["step"] for h in metrics["loss_history"]] == [3] and metrics["loss"]["last"] is not None


def test_a_script_that_never_set_up_logging_still_sees_the_summary(tmp_path, capsys):
    import logging

    assert not logging.getLogger("hf_apex").isEnabledFor(logging.INFO)  # Python's default: WARNING
    args = train_args(tmp_path, stage="fused_adam", max_steps=3)
    ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset()).train()
    printed = capsys.readouterr().out
    assert "ms/step p50" in printed and f"stage metrics written to {tmp_path / METRICS_FILENAME}" in printed


def test_two_trainers_in_one_process_keep_their_own_counts(tmp_path):
    a = ApexTrainer(
        model=tiny_model("gpt2").train(),
        args=train_args(tmp_path / "a", stage="fused_adam_ln"),
        train_dataset=TokenDataset(),
    )
    b = ApexTrainer(
        model=tiny_model("gpt2").train(),
        args=train_args(tmp_path / "b", stage="fused_adam_ln", max_steps=2),
        train_dataset=TokenDataset(),
    )
    a.train()
    b.train()
    a_calls = json.loads((tmp_path / "a" / METRICS_FILENAME).read_text())["kernels"]["calls"]
    b_calls = json.loads((tmp_path / "b" / METRICS_FILENAME).read_text())["kernels"]["calls"]
    assert a_calls["optimizer"]["fallback"] == 6 and b_calls["optimizer"]["fallback"] == 2
    assert a_calls["layer_norm"]["fallback"] == 30 and b_calls["layer_norm"]["fallback"] == 10


def test_a_rewired_reference_model_does_not_count_into_the_run(tmp_path):
    from hf_apex import rewire

    reference = tiny_model("gpt2")
    rewire(reference)
    trainer = ApexTrainer(
        model=tiny_model("gpt2").train(),
        args=train_args(tmp_path, stage="fused_adam_ln", max_steps=2),
        train_dataset=TokenDataset(),
    )
    trainer.train()
    with torch.no_grad():
        reference(torch.randint(3, 100, (2, 16)))  # e.g. a teacher model, or an eval copy
    calls = json.loads((tmp_path / METRICS_FILENAME).read_text())["kernels"]["calls"]
    assert calls["layer_norm"]["fallback"] == 10 and trainer.stage_metrics.calls()["layer_norm"]["fallback"] == 10


def test_strict_fp32_holds_during_the_run_even_after_something_turned_tf32_on_and_is_undone_after(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = True  # what accelerate does for torch.compile in FP32
    seen = []

    class Flags(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))

    trainer = ApexTrainer(
        model=tiny_model("gpt2").train(),
        args=train_args(tmp_path, stage="baseline", max_steps=2),
        train_dataset=TokenDataset(),
        callbacks=[Flags()],
    )
    trainer.train()
    assert seen == [(False, False)] * 2
    assert json.loads((tmp_path / METRICS_FILENAME).read_text())["run"]["fp32_matmul_precision"] == "highest"
    assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is True  # as found


def test_the_training_loop_does_not_sync_per_micro_batch(tmp_path, monkeypatch):
    """The stock NaN/Inf loss filter reads each loss on the host: off by default. And the parameter count behind
    the Trainer's FLOP estimate is taken once, not on every micro-batch."""
    args = train_args(tmp_path, stage="baseline", gradient_accumulation_steps=2)
    assert args.logging_nan_inf_filter is False
    model = tiny_model("gpt2").train()
    counted = []
    real = model.num_parameters
    monkeypatch.setattr(model, "num_parameters", lambda **kw: counted.append(1) or real(**kw))
    ApexTrainer(model=model, args=args, train_dataset=TokenDataset()).train()
    assert len(counted) == 1


class Order(TrainerCallback):
    """Notes when each step begins (a callback without on_log: one with its own would turn the delay off)."""

    def __init__(self, fail_at_step_end=None):
        self.events, self.fail_at = [], fail_at_step_end

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append(("step", state.global_step + 1))

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.fail_at:
            raise RuntimeError("stopped")


def _logged_run(tmp_path, defer=True, fail_at_step_end=None, callbacks=(), **kw):
    args = train_args(
        tmp_path, stage="fused_adam_ln", max_steps=12, logging_steps=3, eval_strategy="steps", eval_steps=6, **kw
    )
    trainer = ApexTrainer(
        model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset(), eval_dataset=TokenDataset(n=8)
    )
    order, log = Order(fail_at_step_end), trainer.log
    trainer.add_callback(order)

    def noted_log(logs, *args, **kwargs):  # when each log (by its step) is written
        order.events.append(("eval" if "eval_loss" in logs else "log", trainer.state.global_step))
        log(logs, *args, **kwargs)

    trainer.log = noted_log
    metrics, windows = trainer.stage_metrics, []
    pop = metrics.pop_log_metrics

    def noted_pop(step=None, calls=None):  # which steps' records each log's figures come from
        windows.append([r.step for r in metrics._window if step is None or r.step < step])
        return pop(step, calls)

    metrics.pop_log_metrics = noted_pop
    for callback in callbacks:
        trainer.add_callback(callback)
    if not defer:
        trainer._deferred_log.applies = lambda trainer: False
    try:
        loss = trainer.train().training_loss
    except RuntimeError:
        loss = None
    keys = ("loss", "grad_norm", "learning_rate", "epoch", "step", "eval_loss", "num_input_tokens_seen")
    history = [
        {k: v for k, v in h.items() if k in keys or k.startswith(("fallback_calls/", "apex_calls/"))}
        for h in trainer.state.log_history
    ]
    return history, order.events, loss, windows


def test_a_logging_step_is_logged_at_the_end_of_the_next_one_with_the_same_values(tmp_path):
    """Its loss and gradient norm are read after the next step has run (on a GPU: no wait for a running step),
    and logged as the stock Trainer logs them; a step followed by an evaluation, and the last step, log at once."""
    history, order, loss, windows = _logged_run(tmp_path / "deferred")
    stock_history, stock_order, stock_loss, stock_windows = _logged_run(tmp_path / "stock", defer=False)
    assert history == stock_history and loss == stock_loss
    assert history[0]["fallback_calls/layer_norm"] == 5 * 3  # the counts at the logging step, not a step later
    assert windows == stock_windows and windows[:2] == [[1, 2], [3, 4, 5]]  # each step's time in one log
    assert [h["step"] for h in history if "loss" in h] == [3, 6, 9, 12]
    late = [s for s in (3, 6, 9) if order.index(("log", s)) > order.index(("step", s + 1))]
    assert late == [3, 9]  # step 6 is evaluated: its log comes first, as without the delay
    assert order.index(("step", 12)) < order.index(("log", 12)) < order.index(("eval", 12))  # the last step too
    assert order.index(("log", 6)) < order.index(("eval", 6)) < order.index(("step", 7))
    assert stock_order.index(("log", 3)) < stock_order.index(("step", 4))


def test_a_run_that_stops_after_a_logging_step_keeps_its_log(tmp_path):
    history, *_ = _logged_run(tmp_path, fail_at_step_end=4)  # logging step 3 was waiting for step 4's end
    assert [h["step"] for h in history if "loss" in h] == [3]


class ActsOnLogs(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):  # (could ask for an evaluation here)
        pass


@pytest.mark.parametrize("case", ["a callback of yours reads the logs", "auto_find_batch_size"])
def test_where_a_log_must_come_at_its_step_it_does(tmp_path, case):
    kw = {"auto_find_batch_size": True} if case == "auto_find_batch_size" else {"callbacks": [ActsOnLogs()]}
    _, order, *_ = _logged_run(tmp_path, **kw)
    assert all(order.index(("log", s)) < order.index(("step", s + 1)) for s in (3, 6, 9))


class HostReads(TorchDispatchMode):
    """Counts the operators that bring a tensor's value to the host (a device sync on a GPU)."""

    READS = {getattr(torch.ops.aten, name).default for name in ("_local_scalar_dense", "is_nonzero", "item")}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


# GPT-2 and Llama as the bench builds them (no pad token: their all-ones masks are left out of the batches)
@pytest.mark.parametrize("family, task, pad", [("gpt2", "lm", None), ("llama", "lm", None), ("bert", "cls", 0)])
def test_a_training_step_reads_nothing_back_from_the_device(tmp_path, family, task, pad):
    """Forward and backward of each micro-batch, the model's own mask decisions included (without a mask,
    transformers reads the position ids to rule out packed rows, `.all()`, unless told: one_sequence_per_row), bring
    no value to the host."""
    trainer = ApexTrainer(
        model=tiny_model(family, pad_token_id=pad).train(),
        args=train_args(tmp_path, stage="fused_full", max_steps=3),
        train_dataset=TokenDataset(task=task),
    )
    reads, step = [], trainer.training_step

    def counted(*args, **kwargs):
        with HostReads() as mode:
            out = step(*args, **kwargs)
        reads.append(mode.count)
        return out

    trainer.training_step = counted
    trainer.train()
    assert reads == [0, 0, 0]


@pytest.mark.parametrize("native_bf16", [False, True])
def test_bf16_autocast_warns_on_a_cpu_without_bf16_hardware(native_bf16, tmp_path, caplog, monkeypatch):
    import logging

    import hf_apex.policy

    monkeypatch.setattr(hf_apex.policy, "cpu_has_native_bf16", lambda: native_bf16)
    with caplog.at_level(logging.WARNING, logger="hf_apex"):
        ApexTrainer(
            model=tiny_model("gpt2"), args=train_args(tmp_path, stage="fused_full"), train_dataset=TokenDataset()
        )
    warned = "BF16 (this CPU has neither AVX512-BF16 nor AMX) autocast on the CPU is often far slower" in caplog.text
    assert warned is not native_bf16


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU's flags from Linux's /proc/cpuinfo")
def test_native_bf16_is_what_the_cpu_flags_say():
    from hf_apex.kernels.apex.availability import cpu_has_native_bf16

    flags = set(Path("/proc/cpuinfo").read_text().split())
    assert cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_tile"})


def test_trainers_sharing_a_model_each_train_with_their_own_norms(tmp_path):
    model = tiny_model("gpt2").train()
    fused = ApexTrainer(
        model=model, args=train_args(tmp_path / "ln", stage="fused_adam_ln", max_steps=2), train_dataset=TokenDataset()
    )
    ApexTrainer(model=model, args=train_args(tmp_path / "base", stage="baseline"), train_dataset=TokenDataset())
    assert not any(is_swapped(m) for m in model.modules())  # the second trainer took the apex norms off
    fused.train()
    calls = json.loads((tmp_path / "ln" / METRICS_FILENAME).read_text())["kernels"]["calls"]
    assert calls["layer_norm"]["fallback"] == 10  # the first trainer's run rewired it back: 5 norms x 2 steps


def test_epoch_logging_carries_the_stage_metrics(tmp_path):
    args = train_args(tmp_path, stage="baseline", max_steps=-1, num_train_epochs=2, logging_strategy="epoch")
    trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset(n=16))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all("step_time_ms" in h for h in logged)


def test_an_all_ones_attention_mask_is_left_out_and_masks_are_decided_on_the_host(tmp_path):
    from hf_apex.kernels.models.attention import STATIC_MASKS
    from hf_apex.runtime import DropFullAttentionMask

    collate = DropFullAttentionMask(torch.utils.data.default_collate)
    full = [{"input_ids": torch.arange(4), "attention_mask": torch.ones(4, dtype=torch.long)}] * 2
    padded = [full[0], {"input_ids": torch.arange(4), "attention_mask": torch.tensor([1, 1, 0, 0])}]
    assert set(collate(full)) == {"input_ids"} and set(collate(padded)) == {"input_ids", "attention_mask"}
    positions = [{**f, "position_ids": torch.tensor([0, 1, 0, 1])} for f in full]  # packed: the mask stays
    assert "attention_mask" in collate(positions)
    assert collate([torch.zeros(2)]).shape == (1, 2)  # not a mapping: as the collator made it

    model = tiny_model("gpt2", pad_token_id=None).train()  # (eager runs keep the mask of a model with a pad token)

    class Implementation(TrainerCallback):  # the attention each training step ran with
        def __init__(self):
            self.seen = set()

        def on_step_end(self, args, state, control, **kw):
            self.seen.add(model.config._attn_implementation)

    def run(name, **kw):
        args = train_args(tmp_path / name, max_steps=2, **kw)
        seen = Implementation()
        trainer = ApexTrainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[seen])
        trainer.train()
        assert model.config._attn_implementation == "sdpa"  # the model leaves train() as it came
        metrics = json.loads((tmp_path / name / METRICS_FILENAME).read_text())
        return trainer, [h["loss"] for h in metrics["loss_history"]], metrics, seen.seen

    initial = {k: v.clone() for k, v in model.state_dict().items()}
    for name, kw in (("compiled", dict(torch_compile=True, torch_compile_backend="aot_eager")), ("eager", {})):
        model.load_state_dict(initial)
        trainer, losses, metrics, seen = run(name, **kw)
        assert isinstance(trainer.data_collator, DropFullAttentionMask) and "attention_mask" in metrics["kernels"]
        assert seen == {STATIC_MASKS} and "attention_masks" in metrics["kernels"]
        if name == "compiled":
            compiled_losses = losses
    assert losses == pytest.approx(compiled_losses, rel=1e-5)
    model.load_state_dict(initial)
    kept, kept_losses, metrics, seen = run("kept", stage_recipe={"static_masks": False})
    assert not isinstance(kept.data_collator, DropFullAttentionMask) and "attention_masks" not in metrics["kernels"]
    assert seen == {"sdpa"}  # transformers' own masks
    assert kept_losses == pytest.approx(losses, rel=1e-5)  # all ones or none, host or transformers: the same training


def test_in_eager_a_model_with_a_pad_token_keeps_its_all_ones_mask(tmp_path):
    """Given no mask, transformers would look for the pad token in every row's first and last token, a device sync
    per forward; so only compiled runs, or models without a pad token, leave the mask out."""
    from hf_apex.policy import drops_full_attention_mask
    from hf_apex.runtime import DropFullAttentionMask

    padded_model = tiny_model("gpt2", pad_token_id=0)
    eager, compiled = train_args(tmp_path, max_steps=1), train_args(tmp_path, max_steps=1, torch_compile=True)
    assert not drops_full_attention_mask(eager, padded_model) and drops_full_attention_mask(compiled, padded_model)
    unpadded = tiny_model("gpt2", pad_token_id=None)
    assert drops_full_attention_mask(eager, unpadded)  # no pad token: nothing to look for
    off = train_args(tmp_path, max_steps=1, torch_compile=True, stage_recipe={"static_masks": False})
    assert not drops_full_attention_mask(off, unpadded)
    trainer = ApexTrainer(model=padded_model.train(), args=eager, train_dataset=TokenDataset())
    assert not isinstance(trainer.data_collator, DropFullAttentionMask)

    class Seen(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            seen.append(padded_model.config._attn_implementation)

    seen = []
    trainer.add_callback(Seen())
    trainer.train()
    assert seen == ["hf_apex_sdpa"]  # the kept mask is built without reading it


def test_a_run_too_short_to_repay_compilation_runs_eager_and_says_why(tmp_path, caplog):
    from hf_apex.policy import why_not_compile

    args = ApexTrainingArguments(output_dir=str(tmp_path), stage="fastest", use_cpu=True, max_steps=3)
    assert args.recipe.min_steps == 500 and args.torch_compile  # the stage's default threshold
    assert "3 optimizer steps, fewer than the stage recipe's min_steps=500" in why_not_compile(args, None)
    mine = ApexTrainingArguments(
        output_dir=str(tmp_path), stage="fastest", use_cpu=True, stage_recipe={"min_steps": 0}
    )
    assert mine.recipe.min_steps == 0 and why_not_compile(mine, None) is None  # yours wins over the stage's
    epochs = ApexTrainingArguments(
        output_dir=str(tmp_path),
        torch_compile=True,
        stage_recipe={"min_steps": 40},
        use_cpu=True,
        per_device_train_batch_size=4,
        num_train_epochs=2,
    )
    assert "32 optimizer steps" in why_not_compile(epochs, TokenDataset(n=64))  # 16 batches x 2 epochs
    assert why_not_compile(epochs, iter([])) is None  # unknown length: compile as asked
    from accelerate.utils import DynamoBackend
    from torch._dynamo.eval_frame import OptimizedModule

    mine = train_args(tmp_path / "run", torch_compile=True, stage_recipe={"min_steps": 100}, max_steps=2)
    with caplog.at_level("WARNING", logger="hf_apex"):
        trainer = ApexTrainer(tiny_model("gpt2").train(), mine, train_dataset=TokenDataset())  # (positional too)
    assert "not compiling: the run has 2 optimizer steps" in caplog.text and not trainer.args.torch_compile
    assert trainer.accelerator.state.dynamo_plugin.backend == DynamoBackend.NO  # accelerate will not compile
    assert mine.torch_compile and mine.torch_compile_backend == "inductor"  # your arguments are left as they were
    trainer.train()
    assert not isinstance(trainer.model_wrapped, OptimizedModule)
    metrics = json.loads((tmp_path / "run" / METRICS_FILENAME).read_text())
    assert not metrics["run"]["torch_compile"] and metrics["kernels"]["torch_compile"].startswith("not used: ")
    asked = ApexTrainer(tiny_model("gpt2").train(), train_args(tmp_path / "c", torch_compile=True, max_steps=2))
    assert asked.accelerator.state.dynamo_plugin.backend == DynamoBackend.INDUCTOR  # (what the check above sees)


def test_auto_without_a_gpu_runs_its_eager_kernels_as_they_are(tmp_path, caplog):
    # auto's CUDA graphs (the cudagraphs backend) need a GPU to record them on; a backend of yours compiles as asked
    args = train_args(tmp_path, stage="auto", max_steps=5000)
    assert args.torch_compile and args.torch_compile_backend == "cudagraphs"
    with caplog.at_level("WARNING", logger="hf_apex"):
        trainer = ApexTrainer(tiny_model("gpt2").train(), args, train_dataset=TokenDataset())
    assert "not compiling: no CUDA GPU to record stage 'auto'" in caplog.text and not trainer.args.torch_compile
    yours = train_args(tmp_path, stage="compiled", torch_compile_backend="cudagraphs", max_steps=5000)
    assert ApexTrainer(tiny_model("gpt2").train(), yours).compile_skipped is None


def _output_dtypes(model):
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append((out.logits.dtype, getattr(out.loss, "dtype", None))))
    return seen


@pytest.mark.parametrize("fp32_outputs", [False, True])
def test_training_outputs_stay_in_the_autocast_dtype_unless_asked(fp32_outputs, tmp_path):
    """accelerate converts a prepared model's outputs to FP32 under autocast (a full FP32 copy of the logits each
    step); ApexTrainer leaves that out, keeping the autocast and the FP32 loss the model computes."""
    model = tiny_model("gpt2").train()
    seen = _output_dtypes(model)
    args = train_args(tmp_path, stage="torch_fused", max_steps=2, stage_recipe={"fp32_outputs": fp32_outputs})
    trainer = ApexTrainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train()
    logits = torch.float32 if fp32_outputs else torch.bfloat16
    assert seen == [(logits, torch.float32)] * 2
    kernels = json.loads((tmp_path / METRICS_FILENAME).read_text())["kernels"]
    assert ("model_outputs" in kernels) is not fp32_outputs
    seen.clear()
    trainer.train()  # a second run of the same trainer: the model is prepared once, the dtype is kept and reported
    assert seen == [(logits, torch.float32)] * 2 and trainer.fp32_outputs_dropped is not fp32_outputs
    trainer.args.stage_recipe["fp32_outputs"] = not fp32_outputs  # and a later run that asks for the other gets it
    seen.clear()
    trainer.train()
    assert seen == [(torch.bfloat16 if fp32_outputs else torch.float32, torch.float32)] * 2


def test_a_loss_computed_from_the_outputs_gets_them_in_fp32(tmp_path):
    """Label smoothing (like a compute_loss_func or a subclass's compute_loss) computes the loss from the logits
    outside the forward (the model gets no labels): accelerate's FP32 conversion stays, so the loss is the stock
    Trainer's."""
    model = tiny_model("gpt2").train()
    seen = _output_dtypes(model)
    args = train_args(tmp_path, stage="torch_fused", max_steps=2, label_smoothing_factor=0.1)
    trainer = ApexTrainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train()
    assert [logits for logits, _ in seen] == [torch.float32] * 2 and not trainer.fp32_outputs_dropped
    kernels = json.loads((tmp_path / METRICS_FILENAME).read_text())["kernels"]
    assert kernels["model_outputs"].startswith("FP32 (accelerate's conversion kept")
