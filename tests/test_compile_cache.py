"""Compiled work reused between runs (hf_apex.autotune.compiled): a cold run writes torch's compile-cache artifacts
beside the autotune cache, a later process with empty Inductor caches loads them and is warm (FX graph and AOTAutograd
caches hit, nothing bypassed); the recipe's compile_cache=False writes nothing; a corrupt file is a warning, never a
crash; the file's key follows the model and the stage. Also: fp32_matmul_precision under torch's per-backend API, and
run.to_step_10_s / to_step_10_of."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_apex import ApexTrainer
from hf_apex.autotune import DecisionCache, compiled
from hf_apex.autotune.compiled import artifacts_path, key_parts
from hf_apex.measure.report import METRICS_FILENAME, fp32_matmul_precision
from tests.test_trainer import train_args
from tests.testing_utils import TokenDataset, tiny_model

REPO = Path(__file__).resolve().parents[1]

# One tiny Llama (hidden 64, 2 layers: a rotary autocast region, hf_apex's fused loss) trained through ApexTrainer
# with Inductor on the CPU, in a process of its own. argv: output_dir, stage; $HF_APEX_CACHE: its autotune cache.
WORKER = """
import sys
import transformers
from hf_apex import ApexTrainer
from tests.test_trainer import train_args
from tests.testing_utils import TokenDataset, tiny_model

out, stage = sys.argv[1:3]
model = tiny_model("llama", hidden_size=64, intermediate_size=128, head_dim=32).train()
args = train_args(out, stage=stage, stage_recipe={"min_steps": 0}, max_steps=3)
ApexTrainer(model=model, args=args, train_dataset=TokenDataset()).train()
"""


def compiled_run(tmp: Path, name: str, autotune_cache: Path, stage: str = "fastest") -> tuple[dict, str]:
    """Run the worker with fresh, empty Inductor and Triton caches; its metrics' compile_cache section and stderr."""
    out, inductor = tmp / name, tmp / f"{name}-inductor"
    inductor.mkdir(parents=True)
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(inductor),
        "TRITON_CACHE_DIR": str(inductor / "triton"),
        "PYTHONPATH": str(REPO),
        "HF_APEX_CACHE": str(autotune_cache),
    }
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(out), stage],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / METRICS_FILENAME).read_text())["compile_cache"], done.stderr


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory):
    """One cold compiled run (tests below reuse it): its autotune cache, compile_cache section and artifacts file."""
    tmp = tmp_path_factory.mktemp("compile_cache")
    autotune_cache = tmp / "autotune" / "autotune.json"
    section, _ = compiled_run(tmp, "cold", autotune_cache)
    files = sorted((autotune_cache.parent / "compiled").glob("*.bin"))
    return SimpleNamespace(tmp=tmp, autotune_cache=autotune_cache, section=section, files=files)


def test_cold_then_warm_across_processes(cold_run):
    assert cold_run.section["state"] == "cold", cold_run.section
    assert len(cold_run.files) == 1 and cold_run.files[0].stat().st_size > 0
    assert cold_run.section["saved_bytes"] > 0

    warm, _ = compiled_run(cold_run.tmp, "warm", cold_run.autotune_cache)
    assert warm["state"] == "warm", warm
    assert warm["loaded_s"] is not None
    assert warm["fxgraph_cache"]["hit"] > 0 and warm["fxgraph_cache"]["miss"] == 0, warm
    # policy.compile_settings marks the rotary autocast region and the fused loss's autograd function cacheable:
    # without that AOTAutograd bypasses its cache and traces again.
    assert warm["aot_autograd_cache"]["hit"] > 0 and warm["aot_autograd_cache"]["bypass"] == 0, warm


def test_corrupt_artifacts_are_a_warning_and_rewritten(cold_run):
    autotune_cache = cold_run.tmp / "corrupt" / "autotune.json"
    bad = autotune_cache.parent / "compiled" / cold_run.files[0].name  # the same key, in another folder
    bad.parent.mkdir(parents=True)
    garbage = b"not torch's compile-cache artifacts" * 8
    bad.write_bytes(garbage)

    section, stderr = compiled_run(cold_run.tmp, "corrupt-run", autotune_cache)
    assert "ignoring the compile cache" in stderr, stderr[-4000:]
    assert section["state"] == "cold" and section["loaded_s"] is None, section
    assert section["saved_bytes"] > 0
    assert bad.read_bytes() != garbage and bad.stat().st_size == section["saved_bytes"]


def test_compile_cache_off_writes_nothing(tmp_path, monkeypatch):
    autotune_cache = tmp_path / "autotune" / "autotune.json"
    monkeypatch.setenv("HF_APEX_CACHE", str(autotune_cache))
    args = train_args(
        tmp_path / "out",
        stage="fastest",
        stage_recipe={"min_steps": 0, "compile_cache": False},
        torch_compile_backend="aot_eager",
        max_steps=3,
    )
    trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset())
    trainer.train()
    metrics = json.loads((tmp_path / "out" / METRICS_FILENAME).read_text())
    payback = {"min_steps": 0, "source": "recipe"}  # (min_steps 0: compiled whatever was measured)
    assert metrics["compile_cache"] == {"state": "off", "why": "stage_recipe compile_cache=False", "payback": payback}
    assert trainer.compile_cache is None
    assert not (autotune_cache.parent / "compiled").exists()


def test_artifacts_key_follows_model_and_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_APEX_CACHE", str(tmp_path / "autotune.json"))

    def path(stage="fastest", **config):
        settings = {k: config.pop(k) for k in ("stage_recipe", "torch_compile_mode") if k in config}
        args = train_args(tmp_path, stage=stage, **settings)
        return artifacts_path(args, tiny_model("llama", **config))

    base = path()
    assert base == path() and base.parent == tmp_path / "compiled" and base.suffix == ".bin"
    assert path(hidden_size=64) != base
    assert path(num_hidden_layers=3) != base
    assert path(stage="compiled") != base
    # the stage by itself: compiled with fastest's recipe entries and compile mode
    fastest = train_args(tmp_path, stage="fastest")
    same = {"stage_recipe": fastest.recipe.compiled_entries(), "torch_compile_mode": fastest.torch_compile_mode}
    assert path(stage="compiled", **same) != base
    # the checkpoint's name is not part of the key: two checkpoints of one architecture compile the same graphs
    model = tiny_model("llama")
    model.config._name_or_path = "somewhere/else"
    args = train_args(tmp_path, stage="fastest")
    assert key_parts(args, model) == key_parts(args, tiny_model("llama"))
    model.config.use_cache = False  # (as the Trainer sets it from its arguments, after a run's key is taken)
    assert key_parts(args, model) == key_parts(args, tiny_model("llama"))
    # nor whether the work is kept: a run with the cache off measures compiling's payback under the same key
    uncached = train_args(tmp_path, stage="fastest", stage_recipe={"compile_cache": False})
    assert key_parts(uncached, model) == key_parts(args, model)


@pytest.fixture
def matmul_precisions():
    """Leave torch's FP32 matmul precisions (legacy and per-backend) as found."""
    cuda, mkldnn = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
    before = (cuda.fp32_precision, mkldnn.fp32_precision)
    yield cuda, mkldnn
    cuda.fp32_precision, mkldnn.fp32_precision = before


def test_fp32_matmul_precision_under_the_per_backend_api(matmul_precisions):
    cuda, mkldnn = matmul_precisions
    cuda.fp32_precision = "tf32"
    mkldnn.fp32_precision = "ieee"
    with pytest.raises(RuntimeError):
        torch.get_float32_matmul_precision()  # the backends disagree: the legacy getter refuses
    assert fp32_matmul_precision() == "tf32"


@pytest.mark.parametrize("steps", [12, 3])
def test_to_step_10(steps, tmp_path):
    args = train_args(tmp_path, stage="baseline", max_steps=steps)
    ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=TokenDataset()).train()
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    run = metrics["run"]
    assert run["to_step_10_of"] == min(steps, 10)
    steps_ms = metrics["steps_ms"]
    assert len(steps_ms) == steps
    # the host's time before the first step, then the steps' own times (rounded in the JSON)
    assert run["to_step_10_s"] >= sum(steps_ms[:10]) / 1e3 - 1e-6
    assert run["to_step_10_s"] < run["wall_time_s"]


def test_runs_measure_when_compiling_repays_and_later_runs_decide_by_it(tmp_path, monkeypatch):
    """Each run records its median step and its first steps' extra cost in the autotune cache (eager where it did not
    compile, cold or warm where it did); a later run of the same key compiles only when its steps repay that."""
    cache = tmp_path / "autotune.json"
    monkeypatch.setenv("HF_APEX_CACHE", str(cache))
    model = tiny_model("gpt2").train()

    def trainer(steps: int, **recipe):
        args = train_args(
            tmp_path / "out",
            stage="fastest",
            stage_recipe=recipe,
            torch_compile_backend="aot_eager",
            max_steps=steps,
        )
        return ApexTrainer(model=model, args=args, train_dataset=TokenDataset())

    short = trainer(4)  # nothing measured yet: the recipe's prior (fastest's min_steps, 500)
    assert short.compile_payback == {"min_steps": 500, "source": "recipe"}
    assert "fewer than the stage recipe's min_steps=500" in short.compile_skipped
    short.train()
    trainer(4, min_steps=0).train()  # compiles: measured as cold (this run's compile-cache state)
    asked = train_args(tmp_path, stage="fastest", torch_compile_backend="aot_eager")
    key = compiled.payback_key(asked, model)  # (of what the runs asked for: the eager one's args are a copy)
    (record,) = [v for v in json.loads(cache.read_text()).values() if v.get("key") == key]
    assert set(record) == {"key", "eager", "cold"}
    assert all(record[s]["step_ms"] > 0 for s in ("eager", "cold"))
    metrics = json.loads((tmp_path / "out" / METRICS_FILENAME).read_text())
    assert metrics["compile_cache"]["payback"] == {"min_steps": 0, "source": "recipe"}

    def decide(eager, cold, warm=None, steps=40):
        entries = {"eager": eager, "cold": cold} | ({"warm": warm} if warm else {})
        DecisionCache(cache).put(key, {s: {"step_ms": v[0], "overhead_s": v[1]} for s, v in entries.items()})
        return trainer(steps)

    # a compiled step 4 ms faster, its first steps 20 s dearer: 5,000 steps to repay
    slow_to_repay = decide(eager=(10.0, 0.5), cold=(6.0, 20.5))
    assert slow_to_repay.compile_payback["min_steps"] == 5000
    assert slow_to_repay.compile_payback["source"] == "measured"
    assert "compiling repays itself after 5000 (measured here" in slow_to_repay.compile_skipped
    quick = decide(eager=(10.0, 0.5), cold=(6.0, 0.6))  # 0.1 s dearer: 25 steps, fewer than the run's 40
    assert quick.compile_payback["min_steps"] == 25 and quick.compile_skipped is None and quick.args.torch_compile
    never = decide(eager=(10.0, 0.5), cold=(11.0, 0.6), steps=10**6)  # no faster: never repays
    assert "compiling repays itself after" in never.compile_skipped
    # with the artifacts of an earlier run there, the warm measure: 2 s dearer, 500 steps
    warm = dict(eager=(10.0, 0.5), cold=(6.0, 20.5), warm=(6.0, 2.5))
    assert decide(**warm).compile_payback["state"] == "cold"  # (no artifacts file: the compile cache is cold)
    path = artifacts_path(asked, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    assert decide(**warm).compile_payback == {
        "min_steps": 500,
        "source": "measured",
        "state": "warm",
        "eager_step_ms": 10.0,
        "compiled_step_ms": 6.0,
        "warmup_s": 2.0,
    }
    assert compiled.compile_payback(train_args(tmp_path, stage="fastest", stage_recipe={"min_steps": 0}), model) == {
        "min_steps": 0,
        "source": "recipe",
    }  # 0 compiles whatever was measured
