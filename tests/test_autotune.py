"""auto: the faster backend is chosen, parity failures are excluded, the cache is consulted before anything is
measured, decisions are per trainer and per run, and a resumed run keeps its checkpoint's optimizer. Timings are
injected (a fake timer for the candidates, a fake clock for the trial on whole steps), so no verdict depends on how
busy the machine is; the norm and optimizer paths run for real on CPU with torch stand-ins for apex's kernels."""

import dataclasses
import functools
import json
import logging
import os
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from hf_apex import ApexTrainer, ApexTrainingArguments, StageMetricsCallback, autotune, rewire
from hf_apex.autotune import APEX, TORCH, Autotuner, DecisionCache
from hf_apex.autotune import tuner as autotuner_module
from hf_apex.kernels import trace
from hf_apex.kernels.apex import norms, optim
from hf_apex.kernels.apex.optim import FusedAdamFallback
from hf_apex.measure.report import METRICS_FILENAME
from tests.test_recipe import generated_data, word_tokenizer  # noqa: F401  (fixtures)
from tests.testing_utils import TokenDataset, tiny_model

# Each test its own autotune cache: a decision cached by one test would change what the next one runs.
pytestmark = pytest.mark.usefixtures("own_hf_apex_cache")


class FakeTimer:
    """Returns preset milliseconds per candidate (called for real first) and records which were timed."""

    def __init__(self, times):
        self.times, self.calls = times, []

    def __call__(self, fn, budget_s):
        fn()
        name = fn.backend
        self.calls.append(name)
        return self.times[name]


class FakeClock:
    """A clock for the norms' trial (``Autotuner(clock=...)``, seconds): time moves only when a test moves it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def prepare_counting(calls, parity=True):
    """A `prepare` for Autotuner.choose that records that it was called."""

    def prepare():
        calls.append("prepare")
        return {APEX: lambda: None, TORCH: lambda: None}, lambda name: parity

    return prepare


@pytest.fixture
def env(monkeypatch):
    key = {"gpu": "GPU-A", "torch": "2.11", "cuda": "13.0", "hf_apex": "0.1", "apex": "abc"}
    monkeypatch.setattr(autotuner_module, "environment_key", lambda: dict(key))
    return key


def tuner(tmp_path, times):
    return Autotuner(DecisionCache(tmp_path / "cache.json"), timer=FakeTimer(times))


@pytest.mark.parametrize(
    "times, expected", [({"apex": 1.0, "torch": 2.0}, APEX), ({"apex": 3.0, "torch": 2.0}, TORCH)]
)
def test_the_faster_backend_is_chosen(env, tmp_path, times, expected):
    decision = tuner(tmp_path, times).choose("layer_norm", {"hidden": 768}, prepare_counting([]))
    assert decision.backend == expected and decision.times_ms == times and not decision.cached


def test_a_backend_failing_parity_is_never_chosen(env, tmp_path):
    t = tuner(tmp_path, {"apex": 0.1, "torch": 5.0})
    decision = t.choose("layer_norm", {"hidden": 768}, prepare_counting([], parity=False))
    assert decision.backend == TORCH and decision.parity_ok == {APEX: False, TORCH: True}
    assert set(t.timer.calls) == {"torch"}  # the failed backend is not even timed


def test_candidates_are_timed_in_turns_and_a_burst_cannot_decide(env, tmp_path):
    class Burst(FakeTimer):  # apex's first round lands in a burst of host noise
        def __call__(self, fn, budget_s):
            self.calls.append(fn.backend)
            return 5.0 if self.calls == ["apex"] else self.times[fn.backend]

    t = Autotuner(DecisionCache(tmp_path / "cache.json"), timer=Burst({"apex": 1.0, "torch": 1.5}))
    decision = t.choose("layer_norm", {"hidden": 768}, prepare_counting([]))
    assert t.timer.calls == ["apex", "torch", "torch", "apex", "apex", "torch"]
    assert decision.backend == APEX and decision.times_ms == {"apex": 1.0, "torch": 1.5}


def test_a_backend_that_runs_out_of_memory_is_left_out(env, tmp_path):
    class OOM(FakeTimer):
        def __call__(self, fn, budget_s):
            self.calls.append(fn.backend)
            if fn.backend == TORCH:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return self.times[fn.backend]

    t = Autotuner(DecisionCache(tmp_path / "cache.json"), timer=OOM({"apex": 5.0}))
    decision = t.choose("norms", {"batch": [8, 1024]}, prepare_counting([]))
    assert decision.backend == APEX and decision.reason == "torch: out of memory" and t.timer.calls.count(TORCH) == 1
    assert not (tmp_path / "cache.json").exists()  # memory depends on the process: decided again next time
    with pytest.raises(torch.OutOfMemoryError):  # nothing fits: the error is the user's to see
        Autotuner(DecisionCache(tmp_path / "c2.json"), timer=OOM({})).choose("n", {}, prepare_counting([], False))


def test_the_cache_is_consulted_before_anything_is_prepared(env, tmp_path):
    first = tuner(tmp_path, {"apex": 1.0, "torch": 2.0})
    first.choose("optimizer", {"numel": 10}, prepare_counting([]))
    prepared = []
    second = tuner(tmp_path, {"apex": 9.0, "torch": 2.0})  # a new process: timings would now say torch
    decision = second.choose("optimizer", {"numel": 10}, prepare_counting(prepared))
    assert decision.backend == APEX and decision.cached and prepared == [] and second.timer.calls == []
    assert len(json.loads((tmp_path / "cache.json").read_text())) == 1


@pytest.mark.parametrize("field, value", [("gpu", "GPU-B"), ("torch", "2.12"), ("apex", "def")])
def test_cache_key_changes_with_gpu_and_versions(env, tmp_path, field, value):
    tuner(tmp_path, {"apex": 1.0, "torch": 2.0}).choose("layer_norm", {"hidden": 768}, prepare_counting([]))
    env[field] = value
    again = tuner(tmp_path, {"apex": 3.0, "torch": 2.0})
    assert again.choose("layer_norm", {"hidden": 768}, prepare_counting([])).backend == TORCH
    assert again.timer.calls  # re-timed, not served from the cache


@pytest.mark.parametrize("content", ["{not json", "[1, 2, 3]", ""])
def test_a_corrupt_cache_is_ignored_with_a_warning(env, tmp_path, caplog, content):
    (tmp_path / "cache.json").write_text(content)
    with caplog.at_level(logging.WARNING, logger="hf_apex"):
        decision = tuner(tmp_path, {"apex": 1.0, "torch": 2.0}).choose("layer_norm", {"h": 1}, prepare_counting([]))
    assert decision.backend == APEX
    assert "ignoring unreadable autotune cache" in caplog.text
    assert isinstance(json.loads((tmp_path / "cache.json").read_text()), dict)  # rewritten, valid


def test_a_cache_path_that_is_a_directory_warns(env, tmp_path, caplog):
    (tmp_path / "cache.json").mkdir()
    with caplog.at_level(logging.WARNING, logger="hf_apex"):
        decision = tuner(tmp_path, {"apex": 1.0, "torch": 2.0}).choose("layer_norm", {"h": 1}, prepare_counting([]))
    assert decision.backend == APEX and "is a directory" in caplog.text


# -- apex stand-ins on CPU ---------------------------------------------------------------------------------
def _correct(m, x):
    return F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)


def _wrong(m, x):
    return 2 * F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)


@pytest.fixture
def fake_apex(monkeypatch, env):
    """Let apex 'run' on CPU: the swapped LayerNorm's kernel and apex FusedAdam are torch stand-ins we control."""
    monkeypatch.setattr(norms, "blocker", lambda component, device=None: None)
    monkeypatch.setattr(norms, "_load_extension", lambda: None)
    monkeypatch.setattr(optim, "blocker", lambda component, device=None: None)
    monkeypatch.setattr(optim, "apex_optimizer_class", lambda name: FusedAdamFallback)

    def use(kernel):
        monkeypatch.setattr(norms._LayerNormKernel, "hf_apex_kernel", lambda self, amp: kernel)

    return use


def norm_tuner(tmp_path, times):
    return Autotuner(DecisionCache(tmp_path / "cache.json"), timer=FakeTimer(times))


@pytest.mark.parametrize(
    "kernel, times, chosen",
    [
        (_correct, {"apex": 1.0, "torch": 2.0}, "apex"),
        (_correct, {"apex": 2.0, "torch": 1.0}, "torch"),
        (_wrong, {"apex": 0.1, "torch": 1.0}, "torch"),
    ],
    ids=["apex-faster", "torch-faster", "apex-wrong"],
)
def test_swapped_norm_uses_the_autotuned_backend(fake_apex, tmp_path, kernel, times, chosen):
    fake_apex(kernel)
    t = norm_tuner(tmp_path, times)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.LayerNorm(16))
    rewire(model, chooser=t.choose_norm)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    model(x)
    assert len(t.decisions) == 1  # one decision per norm type and shape, reused by both modules and calls
    assert t.decisions[0].backend == chosen and t.decisions[0].key["tokens"] == 4
    counts = trace.calls_since(trace.collect(model), {})["layer_norm"]
    assert counts.get(chosen) == 4 and counts["fallback"] == 0
    with torch.no_grad():  # evaluation at another shape reuses the training decision, no new timing
        model.eval()(torch.randn(64, 8))
    assert len(t.decisions) == 1


def test_autotune_copes_with_frozen_norm_weights(fake_apex, tmp_path):
    fake_apex(_correct)
    t = norm_tuner(tmp_path, {"apex": 1.0, "torch": 2.0})
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    model[1].weight.requires_grad_(False)
    rewire(model, chooser=t.choose_norm)
    weight_grad = model[0].weight.grad
    model(torch.randn(4, 8)).sum().backward()
    assert t.decisions[0].backend == "apex" and weight_grad is None  # tuning did not touch .grad before


def auto_args(out, **kw):
    base = dict(
        output_dir=str(out),
        stage="auto",
        use_cpu=True,
        report_to="none",
        max_steps=3,
        per_device_train_batch_size=4,
        save_strategy="no",
        metrics_warmup_steps=1,
        disable_tqdm=True,
        learning_rate=1e-3,
        seed=0,
    )
    return ApexTrainingArguments(**{**base, **kw})


def fix_timings(monkeypatch, times):
    """The candidates' times of every Autotuner built from now on (the default timer, as a trainer builds one)."""
    monkeypatch.setattr(autotuner_module, "cuda_timer", FakeTimer(times))


def test_each_trainer_and_each_run_report_their_own_decisions(fake_apex, tmp_path, monkeypatch):
    fake_apex(_correct)
    fix_timings(monkeypatch, {"apex": 1.0, "torch": 2.0})

    def run(name, stage="auto"):
        args = auto_args(tmp_path / name, stage=stage)
        trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset())
        trainer.train()
        report = json.loads((tmp_path / name / METRICS_FILENAME).read_text())["autotune"]
        return trainer, [(d["component"], d["backend"], d["cached"]) for d in report]

    first, decided = run("first")
    assert decided == [("optimizer", "apex", False), ("norms", "apex", False)]
    second, again = run("second")
    assert again == [("optimizer", "apex", True), ("norms", "apex", True)]  # from the disk cache
    assert first.autotuner is not second.autotuner and len(first.autotuner.decisions) == 2
    assert run("third", stage="baseline")[1] == []  # no autotune in this run: nothing from the earlier ones


def test_torch_s_adamw_chosen_by_autotune_counts_its_steps_as_apex_s_do(fake_apex, tmp_path, monkeypatch):
    """Where torch's fused AdamW was timed faster, the metrics still say what stepped the model (before, such a run's
    calls had no optimizer at all, and its end-of-run line said "no apex component")."""
    fake_apex(_correct)
    fix_timings(monkeypatch, {"apex": 2.0, "torch": 1.0})
    args = auto_args(tmp_path / "run", max_steps=4)
    trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset())
    trainer.train()
    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True
    metrics = json.loads((tmp_path / "run" / METRICS_FILENAME).read_text())
    assert [(d["component"], d["backend"]) for d in metrics["autotune"]][0] == ("optimizer", "torch")
    assert metrics["kernels"]["calls"]["optimizer"] == {"apex": 0, "fallback": 0, "torch": 4, "fallback_reasons": {}}


def test_a_resumed_run_keeps_the_optimizer_of_its_checkpoint(fake_apex, tmp_path, monkeypatch):
    """The first run picks apex (FusedAdam's state layout); on resume the timings would pick torch AdamW, whose
    load of that state fails (KeyError 'step'). The decision stored in the checkpoint is kept instead."""
    fake_apex(_correct)
    fix_timings(monkeypatch, {"apex": 1.0, "torch": 2.0})
    args = auto_args(tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=2, logging_steps=1)
    straight = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset())
    straight.train()
    assert json.loads((tmp_path / "run" / "checkpoint-2" / autotune.STATE_FILE).read_text())["optimizer"] == "apex"

    Path(os.environ["HF_APEX_CACHE"]).unlink()
    fix_timings(monkeypatch, {"apex": 2.0, "torch": 1.0})  # another machine, where torch would win
    resumed = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert type(resumed.optimizer.optimizer) is FusedAdamFallback
    decision = resumed.autotuner.report()[0]
    assert (decision["component"], decision["backend"], decision["reason"]) == (
        "optimizer",
        "apex",
        "resumed checkpoint",
    )
    want = {h["step"]: h["loss"] for h in straight.state.log_history if "loss" in h}
    got = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
    assert got[4] == pytest.approx(want[4], rel=1e-6)


def test_on_cpu_auto_says_why_it_decided_nothing(tmp_path):
    trainer = ApexTrainer(
        model=tiny_model("llama").train(), args=auto_args(tmp_path / "cpu"), train_dataset=TokenDataset()
    )
    trainer.train()
    decisions = json.loads((tmp_path / "cpu" / METRICS_FILENAME).read_text())["autotune"]
    assert [d["component"] for d in decisions] == ["optimizer", "norms"]
    for decision in decisions:
        assert decision["backend"] is None and "not timed" in decision["reason"] and "CUDA" in decision["reason"]


@pytest.mark.skipif(
    "activation_checkpointing" not in {f.name for f in dataclasses.fields(transformers.TrainingArguments)},
    reason="this transformers has no TrainingArguments.activation_checkpointing (5.17 has not)",
)
def test_autotune_under_non_reentrant_activation_checkpointing(fake_apex, tmp_path, monkeypatch):
    """The probe runs inside the model's forward; an enclosing checkpoint must not capture its graph."""
    fake_apex(_correct)
    fix_timings(monkeypatch, {"apex": 1.0, "torch": 2.0})
    args = auto_args(tmp_path / "gc", bf16=False, max_steps=2, activation_checkpointing=True)
    trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset())
    trainer.train()
    assert [d["backend"] for d in trainer.autotuner.report()] == ["apex", "apex"]


@pytest.mark.parametrize(
    "kernel, times, chosen",
    [(_correct, {"apex": 1.0, "torch": 2.0}, "apex"), (_correct, {"apex": 2.0, "torch": 1.0}, "torch")],
    ids=["apex-faster", "torch-faster"],
)
def test_auto_decides_the_norms_on_whole_training_steps(fake_apex, tmp_path, monkeypatch, kernel, times, chosen):
    fake_apex(kernel)
    timed = []

    def timer(fn, budget_s):  # the candidates are whole forward + backward passes of the model
        fn()  # (each pass starts from fresh routes: what it leaves is its own calls)
        norm_calls = trace.calls_since(trace.collect(trainer.model), {}).get("layer_norm")
        if norm_calls is not None and fn.backend in norm_calls:  # (not the optimizer's candidates)
            timed.append((fn.backend, norm_calls[fn.backend]))
        return times[fn.backend]

    monkeypatch.setattr(autotuner_module, "cuda_timer", timer)
    trainer = ApexTrainer(
        model=tiny_model("gpt2").train(), args=auto_args(tmp_path / "run"), train_dataset=TokenDataset()
    )
    trainer.train()
    decisions = trainer.autotuner.report()
    assert [d["component"] for d in decisions][-1] == "norms" and "layer_norm" not in [
        d["component"] for d in decisions
    ]
    norms_decision = decisions[-1]
    assert norms_decision["backend"] == chosen and norms_decision["key"]["batch"] == [4, 16]
    n_norms = sum(1 for m in trainer.model.modules() if norms.is_swapped(m))
    assert sorted(set(timed)) == [("apex", n_norms), ("torch", n_norms)] and len(timed) == 6  # 3 rounds each
    counts = trace.calls_since(trace.collect(trainer.model), {})["layer_norm"]
    other = "torch" if chosen == "apex" else "apex"
    assert counts[chosen] == 3 * n_norms and counts.get(other, 0) == counts["fallback"] == 0  # the 3 steps only


def _ticking(forward, clock: FakeClock, seconds: float):
    def run(*args):
        clock.advance(seconds)  # per norm call: this backend's share of a step, on the trial's clock
        return forward(*args)

    return run


def _norms_on_the_clock(fake_apex, monkeypatch, clock: FakeClock, slow: str | None) -> None:
    """Each call of apex's stand-in or of torch's LayerNorm moves ``clock``: ``slow``'s by 1/16 s, the other's by
    1/64 s, as apex's path is slower on the host of a host-bound BERT step (both by 1/64 s where ``slow`` is None).
    Powers of two: the steps' times are exact, the medians' spread 0."""
    seconds = {APEX: 1 / 64, TORCH: 1 / 64} | ({slow: 1 / 16} if slow else {})
    fake_apex(_ticking(_correct, clock, seconds[APEX]))
    monkeypatch.setattr(torch.nn.LayerNorm, "forward", _ticking(torch.nn.LayerNorm.forward, clock, seconds[TORCH]))


@pytest.mark.parametrize("slow, accumulation", [(APEX, 1), (TORCH, 1), (APEX, 2)])
def test_a_long_run_checks_the_passes_choice_on_whole_steps(fake_apex, tmp_path, monkeypatch, slow, accumulation):
    """The passes (timed forward + backward) pick one backend; the training steps that follow are slower with it,
    which the trial measures on the steps themselves, so the other backend trains the rest of the run, and the disk
    cache keeps that verdict for the next run."""
    clock = FakeClock()
    _norms_on_the_clock(fake_apex, monkeypatch, clock, slow)
    faster = TORCH if slow == APEX else APEX
    fix_timings(monkeypatch, {slow: 1.0, faster: 2.0})  # the passes say the slow one is faster
    steps = autotune.TRIAL_MIN_STEPS

    def run(name):  # (FP32: faster than a CPU's BF16 autocast)
        args = auto_args(tmp_path / name, max_steps=steps, bf16=False, gradient_accumulation_steps=accumulation)
        trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset())
        trainer.autotuner.clock = clock  # the trial's steps on the fake clock
        trainer.train()
        return trainer, json.loads((tmp_path / name / METRICS_FILENAME).read_text())

    trainer, metrics = run("first")
    norm_decisions = [d for d in metrics["autotune"] if d["component"] == "norms"]
    assert [(d["backend"], d["cached"]) for d in norm_decisions] == [(slow, False), (faster, False)]
    steps_decision = norm_decisions[1]
    n_norms = sum(1 for m in trainer.model.modules() if norms.is_swapped(m))
    per_step = n_norms * accumulation  # norm calls per optimizer step
    assert steps_decision["reason"].startswith("whole steps")  # each backend's steps, as the fake clock timed them
    assert steps_decision["times_ms"] == {slow: per_step * 1e3 / 16, faster: per_step * 1e3 / 64}
    # Step 1 (the passes' step) and the trial's first and last blocks ran the passes' choice, its middle two the
    # other; the rest of the run the trial's verdict. Every call is counted, none lost in the switches.
    with_slow = 1 + 2 * autotune.TRIAL_BLOCK
    counts = metrics["kernels"]["calls"]["layer_norm"]
    assert counts[slow] == with_slow * per_step and counts[faster] == (steps - with_slow) * per_step
    assert "kernel=" + faster in repr(trainer.model)  # print(model) shows what runs now
    # The trial's steps and the one after it (profiled) are warm-up: the timed steps all ran the verdict.
    assert metrics["run"]["warmup_steps"] == autotune.TRIAL_WARMUP

    _, again = run("second")  # the cache holds the whole steps' verdict: no passes, no trial
    assert [(d["backend"], d["cached"]) for d in again["autotune"] if d["component"] == "norms"] == [(faster, True)]
    assert again["kernels"]["calls"]["layer_norm"][faster] == steps * per_step
    assert again["run"]["warmup_steps"] == 1  # no trial: the run's own warm-up


def _begin(trial, clock: FakeClock, step: int, ms: list[float]) -> bool:
    """``trial.begin(step)`` once the fake clock has moved by the planned step before it (``ms``, in order)."""
    if 1 < step <= len(ms) + 1:
        clock.advance(ms[step - 2] / 1e3)
    return trial.begin(step)


def test_the_trial_leaves_out_each_switch_and_every_interrupted_step():
    switched = []
    passes = autotune.Decision("norms", {}, APEX, {APEX: 1.0, TORCH: 2.0})
    clock = FakeClock()
    trial = autotune.NormTrial({}, passes, switched.append, cuda=False, after=0, clock=clock)
    assert trial.plan == [APEX] * 4 + [TORCH] * 8 + [APEX] * 4  # A B B A, blocks of TRIAL_BLOCK
    # apex's steps take 10 ms, torch's 12, each block's first (the switch) 50, and the three torch steps during which
    # an evaluation ran 100
    ms = [50.0 if i % 4 == 0 else (10.0 if b == APEX else 12.0) for i, b in enumerate(trial.plan)]
    ms[5] = ms[6] = ms[7] = 100.0
    assert not trial.begin(0)  # another micro-batch of the passes' step: nothing starts
    for step in range(1, len(trial.plan) + 1):
        assert not _begin(trial, clock, step, ms) and not trial.begin(step)  # (a second micro-batch of the step)
        if step in (6, 7, 8):
            trial.interrupt()
    assert _begin(trial, clock, len(trial.plan) + 1, ms)  # every planned step ran: ready to decide
    assert switched == [TORCH, APEX]  # at the two edges where the backend changes
    assert trial.medians() == pytest.approx({APEX: 10.0, TORCH: 12.0})
    trial._dropped = set(range(4, 12))  # had every torch step been interrupted, torch would have none left
    assert trial.medians() == pytest.approx({APEX: 10.0})


def _run_trial(ms, first=APEX):
    """A NormTrial whose planned steps took ``ms``, in order, run to its end."""
    passes = autotune.Decision("norms", {}, first, {APEX: 1.0, TORCH: 2.0})
    clock = FakeClock()
    trial = autotune.NormTrial({}, passes, lambda backend: None, cuda=False, after=0, clock=clock)
    assert not any(_begin(trial, clock, step, ms) for step in range(1, len(trial.plan) + 1))
    assert _begin(trial, clock, len(trial.plan) + 1, ms)
    return trial


def _steps(trial_plan, apex, torch_):
    """Step times for a plan: apex's steps from ``apex`` and torch's from ``torch_``, each in turn."""
    sources = {APEX: iter(apex), TORCH: iter(torch_)}
    return [next(sources[backend]) for backend in trial_plan]


def test_a_trial_that_cannot_tell_the_backends_apart_is_a_tie():
    plan = [APEX] * 4 + [TORCH] * 8 + [APEX] * 4
    # clearly apart: 10 against 12 ms, each within 0.1 ms
    apart = _run_trial(_steps(plan, [10.0, 10.1, 9.9] * 3, [12.0, 12.1, 11.9] * 3))
    assert apart.medians() == pytest.approx({APEX: 10.0, TORCH: 12.0}) and not apart.tied()
    # within 1 %: 10.00 against 10.05 ms, however steady
    assert _run_trial(_steps(plan, [10.0] * 8, [10.05] * 8)).tied()
    # 4 % apart, but each backend's steps spread by 3 ms around its median: a tie; 30 % apart with that spread: not
    noisy = [50.0, 45.0, 55.0, 44.0, 56.0, 45.0, 55.0, 50.0]
    assert _run_trial(_steps(plan, noisy, [x + 2.0 for x in noisy])).tied()
    assert not _run_trial(_steps(plan, noisy, [x + 15.0 for x in noisy])).tied()
    # An H200 trial (BERT-base 128 x 128, 46ca0e8:benchmarks/h200-2026-12-02-bert-rounds, run bert-auto: steps 2-17
    # as its metrics recorded them; the passes had chosen torch): every step in one slow stretch of the host
    h200 = [58.1, 61.4, 60.0, 59.1, 59.7, 56.1, 53.8, 62.5, 69.6, 65.6, 61.7, 58.9, 57.2, 60.3, 51.7, 92.9]
    slow_stretch = _run_trial(h200, first=TORCH)
    assert slow_stretch.medians()[TORCH] < slow_stretch.medians()[APEX] and slow_stretch.tied()


def test_a_tie_on_whole_steps_is_not_cached_and_the_next_run_checks_again(fake_apex, tmp_path, monkeypatch):
    clock = FakeClock()
    _norms_on_the_clock(fake_apex, monkeypatch, clock, slow=None)  # every step takes the same time on the clock
    fix_timings(monkeypatch, {APEX: 1.0, TORCH: 2.0})  # the passes say apex

    def run(name):
        args = auto_args(tmp_path / name, max_steps=autotune.TRIAL_MIN_STEPS, bf16=False)
        trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset())
        trainer.autotuner.clock = clock
        trainer.train()
        metrics = json.loads((tmp_path / name / METRICS_FILENAME).read_text())
        return [d for d in metrics["autotune"] if d["component"] == "norms"]

    for name in ("first", "second"):  # the second run times the passes and the steps again: nothing was cached
        passes, steps = run(name)
        assert (passes["backend"], passes["cached"], steps["cached"]) == (APEX, False, False)
        assert steps["times_ms"][APEX] == steps["times_ms"][TORCH] > 0 and "a tie" in steps["reason"]
        cached = _cache()
        assert not [e for e in cached.values() if e["key"].get("component") == "norms"]


def test_a_held_warm_up_lasts_one_run():
    callback = StageMetricsCallback(warmup_steps=3)
    args = types.SimpleNamespace(device=torch.device("cpu"), stage=None)
    callback.on_train_begin(args, None, None)
    callback.hold_warmup(autotune.TRIAL_WARMUP)  # a trial started in this run
    assert callback._profiled_index() == autotune.TRIAL_WARMUP
    callback.on_train_begin(args, None, None)  # the next run of the same trainer: its own warm-up again
    assert callback._profiled_index() == 3


def test_the_plain_loop_checks_the_norms_on_whole_steps_as_the_trainer_does(
    fake_apex,
    generated_data,  # noqa: F811
    word_tokenizer,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "recipes"))
    import bench
    import plain_loop

    clock = FakeClock()
    _norms_on_the_clock(fake_apex, monkeypatch, clock, slow=APEX)
    fix_timings(monkeypatch, {APEX: 1.0, TORCH: 2.0})  # the passes say apex; its steps are slower
    # the loop's plan builds its own Autotuner (as ApexTrainer's): this one times the trial's steps on the fake clock
    monkeypatch.setattr("hf_apex.plan.Autotuner", functools.partial(Autotuner, clock=clock))
    steps = autotune.TRIAL_MIN_STEPS
    opts = bench.parse_args(["--tiny", "--data_dir", str(generated_data), "--steps", str(steps - 1), "--warmup", "1"])
    flags = bench.finetune_args("gpt2", "auto", opts, tmp_path / "run", nproc=1)
    flags[flags.index("--tokenizer_name") + 1] = word_tokenizer
    flags[flags.index("--config_overrides") + 1] += ",vocab_size=128"  # (the word tokenizer's: no 50k-wide logits)
    flags += ["--bf16", "false"]
    result = plain_loop.main(str(tmp_path / "plain.json"), flags)
    assert len(result["steps_ms"]) == steps and result["warmup_steps"] == autotune.TRIAL_WARMUP
    (verdict,) = [e for e in _cache().values() if e["key"]["component"] == "norms"]
    assert verdict["key"]["decided_on"] == "whole steps" and verdict["backend"] == TORCH
    assert verdict["times_ms"][APEX] == 4 * verdict["times_ms"][TORCH] > 0  # the steps, as the fake clock timed them


def test_a_run_that_stops_during_the_trial_keeps_the_passes_choice(fake_apex, tmp_path, monkeypatch):
    fake_apex(_correct)
    fix_timings(monkeypatch, {"apex": 1.0, "torch": 2.0})

    class StopAt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 7  # inside the trial's torch blocks

    args = auto_args(tmp_path / "stop", max_steps=autotune.TRIAL_MIN_STEPS)
    trainer = ApexTrainer(
        model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset(), callbacks=[StopAt()]
    )
    trainer.train()
    assert trainer.state.global_step == 7 and trainer.autotuner.trial is None
    assert [d.backend for d in trainer.autotuner.decisions if d.component == "norms"] == [APEX]
    assert trainer.autotuner.memo["norms"] == APEX
    trainer.model(input_ids=TokenDataset()[0]["input_ids"][None])  # the next call takes the passes' choice
    assert "kernel=apex)" in repr(trainer.model) and "torch" not in repr(trainer.model)
    assert [e["key"]["component"] for e in _cache().values()] == ["optimizer"]  # nothing on the norms


def _cache() -> dict:
    path = Path(os.environ["HF_APEX_CACHE"])
    return json.loads(path.read_text()) if path.exists() else {}


def test_the_norm_timing_leaves_training_untouched(fake_apex, tmp_path, monkeypatch):
    """auto with apex winning everywhere trains exactly as fused_full does: the timed passes moved neither the
    RNG (dropout) nor the gradients."""
    fake_apex(_correct)
    fix_timings(monkeypatch, {"apex": 1.0, "torch": 2.0})

    def losses(name, stage):
        args = auto_args(tmp_path / name, stage=stage, logging_steps=1)
        trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset())
        trainer.train()
        return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    auto, auto_losses = losses("auto", "auto")
    assert [d["backend"] for d in auto.autotuner.report()] == ["apex", "apex"]
    assert auto_losses == losses("full", "fused_full")[1]


def test_a_wrong_norm_kernel_loses_the_whole_step_parity(fake_apex, tmp_path, monkeypatch):
    fake_apex(_wrong)
    fix_timings(monkeypatch, {"apex": 0.1, "torch": 2.0})
    trainer = ApexTrainer(
        model=tiny_model("gpt2").train(), args=auto_args(tmp_path / "w"), train_dataset=TokenDataset()
    )
    trainer.train()
    decision = trainer.autotuner.report()[-1]
    assert (decision["component"], decision["backend"], decision["parity_ok"]["apex"]) == ("norms", "torch", False)


def test_a_long_run_whose_passes_leave_one_backend_caches_it_without_a_trial(fake_apex, tmp_path, monkeypatch):
    fake_apex(_wrong)  # apex fails parity: only torch is timed, so there is nothing for whole steps to check
    fix_timings(monkeypatch, {"apex": 0.1, "torch": 2.0})
    args = auto_args(tmp_path / "w", max_steps=autotune.TRIAL_MIN_STEPS, bf16=False)
    trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset())
    trainer.train()
    assert [d.backend for d in trainer.autotuner.decisions if d.component == "norms"] == [TORCH]
    (entry,) = [e for e in _cache().values() if e["key"]["component"] == "norms"]
    assert entry["backend"] == TORCH and entry["key"]["decided_on"] == "whole steps"


def _wrong_at_32(m, x):  # right for one hidden size, wrong for another
    y = F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
    return 2 * y if x.shape[-1] == 32 else y


def test_whole_pass_parity_checks_every_size_of_norm(fake_apex, tmp_path, monkeypatch):
    fake_apex(_wrong_at_32)
    fix_timings(monkeypatch, {"apex": 0.1, "torch": 2.0})
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.LayerNorm(32)
    )
    t = norm_tuner(tmp_path, {"apex": 0.1, "torch": 2.0})
    rewire(model, chooser=t.choose_norm)
    x = torch.randn(4, 8)
    backend = t.choose_norms(model, autotune.training_pass(model, lambda: model(x).square().mean()), (4, 8), None)
    assert backend == TORCH and t.decisions[-1].parity_ok[APEX] is False


@pytest.mark.parametrize(
    "kw, prepare",
    [
        (dict(label_smoothing_factor=0.1), None),  # compute_loss pops the labels: each pass gets its own dict
        ({}, lambda model: model.gradient_checkpointing_enable()),  # on the model: the per-norm timing instead
    ],
    ids=["label-smoothing", "checkpointing-on-the-model"],
)
def test_auto_trains_with_what_changes_the_first_step(fake_apex, tmp_path, monkeypatch, kw, prepare):
    fake_apex(_correct)
    fix_timings(monkeypatch, {"apex": 1.0, "torch": 2.0})
    model = tiny_model("gpt2").train()
    if prepare:
        prepare(model)
    trainer = ApexTrainer(model=model, args=auto_args(tmp_path / "x", bf16=False, **kw), train_dataset=TokenDataset())
    trainer.train()
    components = [d["component"] for d in trainer.autotuner.report()]
    assert components[-1] == ("layer_norm" if prepare else "norms")


def test_a_failure_on_rank_0_stops_every_rank(tmp_path):
    import os
    import subprocess
    import sys

    worker = Path(__file__).with_name("autotune_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([*cmd, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert "rank 0 raised ValueError: no candidate can run" in out.stdout
    assert "rank 1 raised RuntimeError: hf_apex autotune: rank 0 failed deciding norms: ValueError" in out.stdout


def test_the_norm_probe_runs_under_the_pass_autocast(fake_apex):
    """Kernel parity is checked after the timed pass, outside its autocast: the probe must replay it (on CUDA,
    torch's LayerNorm refuses the bf16 input a previous apex norm handed on, next to fp32 weights, without it)."""
    seen = []

    def kernel(m, x):
        seen.append((torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type)))
        return _correct(m, x)

    fake_apex(kernel)
    model = torch.nn.Sequential(torch.nn.LayerNorm(16))
    rewire(model)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert autotune.norm_probe(model[0], x, torch.bfloat16)[1](APEX)
    assert seen == [(True, torch.bfloat16)]
    seen.clear()
    autotune.norm_probe(model[0], x.float(), None)[0](APEX)
    assert seen == [(False, torch.get_autocast_dtype("cpu"))]


def test_an_untimed_optimizer_decision_keeps_every_reason(tmp_path):
    tuner = Autotuner(DecisionCache(tmp_path / "cache.json"))
    kwargs = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "capturable": True}
    assert tuner.choose_optimizer(torch.nn.Linear(2, 2), kwargs, blocked="no CUDA GPU") == APEX
    (decision,) = tuner.decisions
    assert decision.reason == "not timed: apex cannot run here (no CUDA GPU); apex-only options ['capturable']"
