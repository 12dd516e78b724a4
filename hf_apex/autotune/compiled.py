"""Compiled work reused between runs: torch's compile-cache artifacts (``torch.compiler.save_cache_artifacts``) in
one file per environment, model, stage and compile settings, in a ``compiled/`` folder beside the autotune cache.

A run that compiles loads its file, when there is one, before anything is compiled
(``torch.compiler.load_cache_artifacts``, on every rank): AOTAutograd's and Inductor's FX graph caches then hold its
graphs, and the run is *warm*; without one it is *cold*. Dynamo still traces the model on a warm run; what the file
spares is AOTAutograd's partitioning and Inductor's code generation and build. Once the compiled steps are in place
(the end of the metrics warm-up, or the last step of a shorter run) and again when the run ends, where more was
compiled since (an evaluation), the main process writes the artifacts this run compiled or found in the caches to the
file (a temporary file, then ``os.replace``). A file that cannot be read or written is a warning, never a crash.

torch's caches key each graph by its own content and settings, so a file holds what fits this key and is only ever
reused where torch's keys match: the file's key picks which artifacts are worth loading.

Whether compiling repays itself (:func:`compile_payback`): a run of the recipe's ``min_steps`` or more compiles; a
shorter one runs eager, unless this GPU has measured both ways for the same key and batch: each run that keeps its
stage metrics records, in the autotune cache, its median step and what its first ten steps cost beyond ten such steps
(compiled: per compile-cache state, cold or warm; eager: as it ran when it did not compile). From those the break-even
step count replaces the recipe's prior.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
import transformers
from transformers import TrainerCallback

from .. import distributed
from ..internals import cache_artifacts_new, dynamo_counters, fresh_cache_artifacts
from ..kernels.apex.availability import portable_path
from .cache import DecisionCache, default_cache_path, environment_key

logger = logging.getLogger("hf_apex")

# The metrics' name for each of torch's caches -> (counters' group, prefix of its hit/miss/bypass counters)
CACHES = {"fxgraph_cache": ("inductor", "fxgraph_cache_"), "aot_autograd_cache": ("aot_autograd", "autograd_cache_")}
OUTCOMES = ("hit", "miss", "bypass")


def compiled_dir() -> Path:
    """The ``compiled/`` folder beside the autotune cache (``$HF_APEX_CACHE``, else
    ``~/.cache/hf_apex/autotune.json``)."""
    return default_cache_path().parent / "compiled"


def config_hash(model) -> str | None:
    """A hash of the model's config (None without one); its name or path left out: two checkpoints of one
    architecture compile the same graphs. ``use_cache`` too: the Trainer sets it from its own arguments."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    left_out = ("_name_or_path", "transformers_version", "use_cache")
    entries = {k: v for k, v in config.to_dict().items() if k not in left_out}
    return hashlib.sha1(json.dumps(entries, sort_keys=True, default=str).encode()).hexdigest()


def key_parts(args, model) -> dict:
    """What a run's compiled graphs depend on, beyond torch's own keys: the environment (GPU, torch, CUDA, hf_apex,
    apex), transformers, the model's class and config, the stage, the recipe's compiled entries (``min_steps`` and
    ``compile_cache`` aside: they decide whether to compile and whether to keep the work, not what is compiled),
    precision, and torch.compile's mode and backend."""
    aside = ("min_steps", "compile_cache")
    recipe = {k: v for k, v in args.recipe.compiled_entries().items() if k not in aside}
    return {
        **environment_key(),
        "transformers": transformers.__version__,
        "model": type(getattr(model, "module", model)).__name__,
        "config": config_hash(getattr(model, "module", model)),
        "stage": args.stage,
        "recipe": recipe,
        "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        "mode": args.torch_compile_mode,
        "backend": args.torch_compile_backend or "inductor",
    }


def artifacts_path(args, model) -> Path:
    """The file of compile-cache artifacts for this run's key (:func:`key_parts`)."""
    return compiled_dir() / f"{DecisionCache.key(key_parts(args, model))[:20]}.bin"


def cache_counters() -> dict[str, dict[str, int]]:
    """torch's process-wide hit/miss/bypass counts of its FX graph and AOTAutograd caches."""
    counters = dynamo_counters()
    return {name: {o: int(counters[group][prefix + o]) for o in OUTCOMES} for name, (group, prefix) in CACHES.items()}


class CompileCache(TrainerCallback):
    """One run's file of compile-cache artifacts: :meth:`begin` sets torch's record of artifacts apart for the run,
    the callback loads the file at the start of training (the model is built by then, and nothing is compiled yet)
    and saves it at step ``save_at`` (or the run's last step, if sooner), and :meth:`save` again when the run ends.

    Args:
        args (`ApexTrainingArguments`): the run's arguments (the key's stage, recipe, precision, mode, backend).
        save_at (`int`): the optimizer step after which the compiled steps are in place (the metrics warm-up).
    """

    def __init__(self, args, save_at: int):
        self.args = args
        self.save_at = max(save_at, 1)
        self.path: Path | None = None
        self.state = "cold"
        self.loaded_s: float | None = None
        self.saved_bytes: int | None = None
        self._counters_at_start: dict = {}

    @classmethod
    def for_run(cls, trainer, run: contextlib.ExitStack) -> CompileCache | None:
        """The cache of a trainer's run that compiles with ``compile_cache`` on (None otherwise): it loads at the start
        of training, saves after the metrics warm-up and again when ``run`` ends, and leaves the trainer then."""
        args = trainer.args
        if not (args.torch_compile and args.recipe.compile_cache):
            return None
        cache = cls(args, save_at=args.metrics_warmup_steps)
        cache.begin(run)
        trainer.add_callback(cache)
        run.callback(trainer.remove_callback, cache)
        run.callback(cache.save)  # (first: what an evaluation at the end compiled)
        return cache

    def begin(self, run: contextlib.ExitStack) -> None:
        """Record this run's artifacts apart from the process's (torch's record is put back when ``run`` ends)."""
        run.enter_context(fresh_cache_artifacts())
        self._counters_at_start = cache_counters()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.path = artifacts_path(self.args, model)
        self.load()

    def load(self) -> None:
        """Load the file into torch's caches, when there is one: the run is warm."""
        if not self.path.is_file():
            return
        started = time.perf_counter()
        try:
            info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
        except Exception as exc:  # (an unreadable or foreign file: compile as if there were none)
            info, why = None, str(exc)
        else:
            why = "not torch's compile-cache artifacts"
        if info is None:
            logger.warning("hf_apex: ignoring the compile cache %s (%s); this run compiles cold.", self.path, why)
            return
        self.loaded_s = time.perf_counter() - started
        self.state = "warm"
        logger.info("hf_apex: compile cache %s loaded in %.2f s.", portable_path(self.path), self.loaded_s)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == min(self.save_at, state.max_steps):
            self.save()

    def save(self) -> None:
        """Write what this run compiled or found in torch's caches so far, when anything is new since the last save
        (the main process; the others keep nothing)."""
        if self.path is None or distributed.rank() != 0 or not cache_artifacts_new():
            return
        try:
            saved = torch.compiler.save_cache_artifacts()
            if saved is None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(saved[0])
            os.replace(tmp, self.path)
        except Exception as exc:
            logger.warning("hf_apex: could not write the compile cache %s (%s).", self.path, exc)
            return
        self.saved_bytes = len(saved[0])

    def report(self) -> dict:
        """The metrics JSON's ``compile_cache`` section: warm or cold, the file, its load time and size, and this run's
        hits and misses in torch's caches."""
        now = cache_counters()
        return {
            "state": self.state,
            "file": portable_path(self.path) if self.path is not None else None,
            "loaded_s": round(self.loaded_s, 3) if self.loaded_s is not None else None,
            "saved_bytes": self.saved_bytes,
            **{
                name: {o: now[name][o] - self._counters_at_start.get(name, {}).get(o, 0) for o in OUTCOMES}
                for name in CACHES
            },
        }


def payback_key(args, model) -> dict | None:
    """What a run's step times depend on: :func:`key_parts` (for a run that compiles, whatever it ends up doing) and
    the batch; None without a model to key by (``model_init``)."""
    if model is None:
        return None
    return {
        "kind": "compile_payback",
        **key_parts(args, model),
        "batch": args.per_device_train_batch_size,
        "accumulation": args.gradient_accumulation_steps,
        "world_size": args.world_size,
    }


def compile_payback(args, model) -> dict:
    """How many optimizer steps a run must have for compiling to repay itself: ``min_steps``, and ``source``:
    ``"measured"`` (with the measured ``eager_step_ms``, ``compiled_step_ms``, ``warmup_s`` it follows from and the
    compile-cache ``state`` it expects) or ``"recipe"`` (the recipe's prior, until this GPU has measured both)."""
    prior = {"min_steps": args.recipe.min_steps, "source": "recipe"}
    key = payback_key(args, model)
    if not args.recipe.min_steps or key is None:
        return prior
    record = DecisionCache().get(key) or {}
    state = "warm" if args.recipe.compile_cache and artifacts_path(args, model).is_file() else "cold"
    eager = record.get("eager")
    compiled = record.get(state) or record.get("cold")  # (no warm measure yet: the cold one, the dearer)
    if not (eager and compiled):
        return prior
    gain_ms = eager["step_ms"] - compiled["step_ms"]
    warmup_s = max(compiled["overhead_s"] - eager["overhead_s"], 0.0)
    steps = math.ceil(1e3 * warmup_s / gain_ms) if gain_ms > 0 else math.inf
    return {
        # a compiled step no faster than an eager one never repays: a bound no run reaches
        "min_steps": steps if steps != math.inf else 2**62,
        "source": "measured",
        "state": state,
        "eager_step_ms": eager["step_ms"],
        "compiled_step_ms": compiled["step_ms"],
        "warmup_s": round(warmup_s, 2),
    }


def record_payback(args, key: dict | None, summary: dict | None, state: str | None) -> None:
    """Note a finished run's median step and the cost of its first steps beyond as many median steps, under its
    :func:`payback_key`: as ``state`` (``"cold"``/``"warm"``) where it compiled, as ``"eager"`` where it did not."""
    run = (summary or {}).get("run", {})
    step_ms = ((summary or {}).get("step_time_ms") or {}).get("p50")
    if key is None or not step_ms or run.get("to_step_10_s") is None or not run.get("timed_steps"):
        return
    overhead_s = run["to_step_10_s"] - run["to_step_10_of"] * step_ms / 1e3
    cache = DecisionCache()
    record = {k: v for k, v in (cache.get(key) or {}).items() if k != "key"}
    record[state or "eager"] = {"step_ms": round(step_ms, 3), "overhead_s": round(overhead_s, 3)}
    cache.put(key, record)
