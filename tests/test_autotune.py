"""auto: the faster backend is chosen, parity failures are excluded, decisions are cached by GPU/version/shape/dtype,
and a corrupt cache is ignored with a warning. Timings are injected; the norm path runs for real on CPU with a
stand-in for apex's kernel."""

import json
import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from hf_apex import ApexTrainer, ApexTrainingArguments, autotune, norms, rewire
from hf_apex.autotune import APEX, TORCH, Autotuner, DecisionCache
from hf_apex.counters import KERNEL_COUNTER
from hf_apex.metrics import METRICS_FILENAME
from tests.testing_utils import TokenDataset, tiny_model


class FakeTimer:
    """Returns preset milliseconds per candidate name and counts calls."""

    def __init__(self, times):
        self.times, self.calls = times, []

    def __call__(self, fn, budget_s):
        name = fn.__name__
        self.calls.append(name)
        return self.times[name]


def candidates():
    def apex():
        pass

    def torch_():
        pass

    torch_.__name__ = "torch"
    return {APEX: apex, TORCH: torch_}


@pytest.fixture
def tuner(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "environment_key", lambda: {"gpu": "GPU-A", "torch": "2.11", "apex": "abc"})

    def make(times):
        return Autotuner(DecisionCache(tmp_path / "cache.json"), timer=FakeTimer(times))

    return make


@pytest.mark.parametrize(
    "times, expected", [({"apex": 1.0, "torch": 2.0}, APEX), ({"apex": 3.0, "torch": 2.0}, TORCH)]
)
def test_the_faster_backend_is_chosen(tuner, times, expected):
    decision = tuner(times).choose("layer_norm", {"hidden": 768}, candidates(), parity=lambda name: True)
    assert decision.backend == expected and decision.times_ms == times and not decision.cached


def test_a_backend_failing_parity_is_never_chosen(tuner):
    t = tuner({"apex": 0.1, "torch": 5.0})
    decision = t.choose("layer_norm", {"hidden": 768}, candidates(), parity=lambda name: False)
    assert decision.backend == TORCH and decision.parity_ok == {APEX: False, TORCH: True}
    assert t.timer.calls == ["torch"]  # the failed backend is not even timed


def test_decisions_are_cached_and_reused(tuner, tmp_path):
    first = tuner({"apex": 1.0, "torch": 2.0})
    first.choose("optimizer", {"numel": 10}, candidates(), parity=lambda name: True)
    second = tuner({"apex": 9.0, "torch": 2.0})  # a new process: timings would now say torch
    decision = second.choose("optimizer", {"numel": 10}, candidates(), parity=lambda name: True)
    assert decision.backend == APEX and decision.cached and second.timer.calls == []
    assert len(json.loads((tmp_path / "cache.json").read_text())) == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda mp: mp.setattr(autotune, "environment_key", lambda: {"gpu": "GPU-B", "torch": "2.11", "apex": "abc"}),
        lambda mp: mp.setattr(autotune, "environment_key", lambda: {"gpu": "GPU-A", "torch": "2.12", "apex": "abc"}),
        lambda mp: mp.setattr(autotune, "environment_key", lambda: {"gpu": "GPU-A", "torch": "2.11", "apex": "def"}),
    ],
    ids=["gpu", "torch-version", "apex-commit"],
)
def test_cache_key_changes_with_gpu_and_versions(tuner, monkeypatch, change):
    tuner({"apex": 1.0, "torch": 2.0}).choose("layer_norm", {"hidden": 768}, candidates(), parity=lambda n: True)
    change(monkeypatch)
    again = tuner({"apex": 3.0, "torch": 2.0})
    assert again.choose("layer_norm", {"hidden": 768}, candidates(), parity=lambda n: True).backend == TORCH
    assert again.timer.calls  # re-timed, not served from the cache


@pytest.mark.parametrize("other", [{"hidden": 1024, "dtype": "bf16"}, {"hidden": 768, "dtype": "fp32"}])
def test_cache_key_changes_with_shape_and_dtype(tuner, other):
    tuner({"apex": 1.0, "torch": 2.0}).choose(
        "rms_norm", {"hidden": 768, "dtype": "bf16"}, candidates(), parity=lambda n: True
    )
    again = tuner({"apex": 3.0, "torch": 2.0})
    assert again.choose("rms_norm", other, candidates(), parity=lambda n: True).backend == TORCH


@pytest.mark.parametrize("content", ["{not json", "[1, 2, 3]", ""])
def test_a_corrupt_cache_is_ignored_with_a_warning(tuner, tmp_path, caplog, content):
    (tmp_path / "cache.json").write_text(content)
    with caplog.at_level(logging.WARNING, logger="hf_apex"):
        decision = tuner({"apex": 1.0, "torch": 2.0}).choose(
            "layer_norm", {"h": 1}, candidates(), parity=lambda n: True
        )
    assert decision.backend == APEX
    assert "ignoring unreadable autotune cache" in caplog.text
    assert isinstance(json.loads((tmp_path / "cache.json").read_text()), dict)  # rewritten, valid


@pytest.fixture
def fake_apex_kernel(monkeypatch, tmp_path):
    """Let the swapped norm believe apex can run on CPU; `_apex_forward` is a torch stand-in we control."""
    monkeypatch.setattr(norms, "_fallback_reason", lambda x, w: None)
    monkeypatch.setattr(autotune, "_AUTOTUNER", None)
    monkeypatch.setenv("HF_APEX_CACHE", str(tmp_path / "cache.json"))

    def use(apex_forward, times):
        monkeypatch.setattr(norms.ApexFusedLayerNorm, "_apex_forward", apex_forward)
        tuner = autotune.configure_autotuner()

        def timer(fn, budget_s):  # candidate lambdas close over `name`; time by calling them for real
            fn()
            return times[fn.__defaults__[0]]

        tuner.timer = timer
        return tuner

    return use


def _correct(self, x):
    return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def _wrong(self, x):
    return 2 * F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


@pytest.mark.parametrize(
    "apex_forward, times, chosen",
    [
        (_correct, {"apex": 1.0, "torch": 2.0}, "apex"),
        (_correct, {"apex": 2.0, "torch": 1.0}, "torch"),
        (_wrong, {"apex": 0.1, "torch": 1.0}, "torch"),
    ],
    ids=["apex-faster", "torch-faster", "apex-wrong"],
)
def test_swapped_norm_uses_the_autotuned_backend(fake_apex_kernel, apex_forward, times, chosen):
    tuner = fake_apex_kernel(apex_forward, times)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.LayerNorm(16))
    rewire(model, autotune=True)
    weight_grad_before = model[1].weight.grad
    x = torch.randn(4, 8)
    model(x).sum().backward()
    model(x)
    assert len(tuner.decisions) == 1  # one decision per norm type and shape, reused by both modules and calls
    assert tuner.decisions[0].backend == chosen and tuner.decisions[0].key["tokens"] == 4
    assert weight_grad_before is None and model[1].weight.grad is not None  # tuning did not touch .grad
    counts = KERNEL_COUNTER.since(__import__("collections").Counter())["layer_norm"]
    assert counts.get("apex" if chosen == "apex" else "torch") == 4 and counts["fallback"] == 0
    with torch.no_grad():  # evaluation at another shape reuses the training decision, no new timing
        model(torch.randn(64, 8))
    assert len(tuner.decisions) == 1


def test_autotune_copes_with_frozen_norm_weights(fake_apex_kernel):
    tuner = fake_apex_kernel(_correct, {"apex": 1.0, "torch": 2.0})
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    model[1].weight.requires_grad_(False)
    rewire(model, autotune=True)
    model(torch.randn(4, 8)).sum().backward()
    assert tuner.decisions[0].backend == "apex"


def test_each_training_run_reports_its_own_decisions(fake_apex_kernel, tmp_path):
    fake_apex_kernel(_correct, {"apex": 1.0, "torch": 2.0})

    def decisions(stage):
        args = ApexTrainingArguments(
            output_dir=str(tmp_path / stage),
            stage=stage,
            use_cpu=True,
            report_to="none",
            max_steps=3,
            per_device_train_batch_size=4,
            save_strategy="no",
            metrics_warmup_steps=1,
            disable_tqdm=True,
        )
        ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset()).train()
        report = json.loads((tmp_path / stage / METRICS_FILENAME).read_text())["autotune"]
        return [(d["component"], d["backend"], d["cached"]) for d in report]

    assert decisions("auto") == [("layer_norm", "apex", False)]
    shutil.move(tmp_path / "auto", tmp_path / "first")
    assert decisions("auto") == [("layer_norm", "apex", True)]  # taken again, from the disk cache
    assert decisions("baseline") == []  # no autotune in this run: nothing from the earlier ones
