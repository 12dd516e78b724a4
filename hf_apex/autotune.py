"""``auto``: time apex against torch for each component on this GPU, and use the faster.

A decision is made once per component and key (optimizer: the parameter shapes and dtypes; norms: the norm
class, hidden size, token bucket, input dtype and autocast dtype), within a bounded time budget, and cached on
disk keyed by GPU and versions as well, so the next run starts with the answer. torch's op is the reference:
a backend whose results differ from it beyond the tolerance of the dtype is never chosen. Every decision
(times, parity, whether it came from the cache) is logged and lands in the run's metrics JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger("hf_apex")

APEX, TORCH = "apex", "torch"


def default_cache_path() -> Path:
    return Path(os.environ.get("HF_APEX_CACHE") or Path.home() / ".cache" / "hf_apex" / "autotune.json")


def environment_key() -> dict:
    """What makes a timing valid elsewhere: the GPU and the software that runs the kernels."""
    from .metrics import _version, apex_build_info

    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "apex": str(apex_build_info().get("commit") or _version("apex")),
        "hf_apex": _version("hf_apex"),
    }


def cuda_timer(fn: Callable[[], None], budget_s: float, max_reps: int = 50) -> float:
    """Median milliseconds of ``fn`` over repetitions that fit in ``budget_s`` (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times, deadline = [], time.perf_counter() + budget_s
    while len(times) < max_reps and (len(times) < 5 or time.perf_counter() < deadline):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@dataclasses.dataclass
class Decision:
    component: str
    key: dict
    backend: str
    times_ms: dict[str, float]
    parity_ok: dict[str, bool]
    cached: bool = False
    reason: str = ""


class DecisionCache:
    """A JSON file of decisions; a corrupt or unreadable file is ignored with a warning, never a crash."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else default_cache_path()
        self._entries: dict[str, dict] | None = None

    @staticmethod
    def key(parts: dict) -> str:
        return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()

    def _load(self) -> dict[str, dict]:
        if self._entries is None:
            self._entries = {}
            if self.path.is_file():
                try:
                    data = json.loads(self.path.read_text())
                    if not isinstance(data, dict):
                        raise ValueError("not a JSON object")
                    self._entries = data
                except (OSError, ValueError) as exc:
                    logger.warning(
                        "hf_apex: ignoring unreadable autotune cache %s (%s); it will be rewritten.", self.path, exc
                    )
        return self._entries

    def get(self, parts: dict) -> dict | None:
        return self._load().get(self.key(parts))

    def put(self, parts: dict, value: dict) -> None:
        entries = self._load()
        entries[self.key(parts)] = {**value, "key": parts}
        if _rank() != 0:  # one writer per job; every rank keeps the entry in memory
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=1, default=str))
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("hf_apex: could not write the autotune cache %s (%s).", self.path, exc)


class Autotuner:
    """Chooses between backends by timing them; decisions are cached on disk and kept for the metrics."""

    def __init__(self, cache: DecisionCache | None = None, timer=cuda_timer, budget_s: float = 1.0):
        self.cache = cache or DecisionCache()
        self.timer = timer
        self.budget_s = budget_s
        self.decisions: list[Decision] = []  # every decision of this process, in order
        # In-process answers for hot paths (a swapped norm asks on every forward): key -> backend. Emptied by
        # begin_run(), so each training run takes its decisions again (from the disk cache, cheaply) and reports them.
        self.memo: dict = {}
        self._run_start = 0

    def choose(
        self,
        component: str,
        key: dict,
        candidates: dict[str, Callable[[], None]],
        parity: Callable[[str], bool],
        same_on_all_ranks: bool = False,
    ) -> Decision:
        """Pick among ``candidates`` (name -> one timed call; TORCH is the reference and always eligible).

        ``parity(name)`` says whether that backend matches torch; it is only asked of non-reference backends.
        ``same_on_all_ranks``: under torch.distributed, rank 0 decides and the others take its decision (a
        collective: every rank must call it). Needed where ranks must agree, e.g. the optimizer under DDP, whose
        replicas would drift apart if their updates rounded differently.
        """
        if same_on_all_ranks and _world() > 1:
            mine = [self._decide(component, key, candidates, parity) if _rank() == 0 else None]
            torch.distributed.broadcast_object_list(mine, src=0)
            decision = mine[0]
            if _rank() != 0:
                self.decisions.append(decision)
            return decision
        return self._decide(component, key, candidates, parity)

    def _decide(self, component, key, candidates, parity) -> Decision:
        parts = {"component": component, **environment_key(), **key}
        hit = self.cache.get(parts)
        if hit is not None and hit.get("backend") in candidates:
            decision = Decision(
                component,
                key,
                hit["backend"],
                hit.get("times_ms", {}),
                hit.get("parity_ok", {}),
                cached=True,
                reason="cache",
            )
        else:
            parity_ok = {name: name == TORCH or bool(parity(name)) for name in candidates}
            eligible = [name for name in candidates if parity_ok[name]]
            times = {name: self.timer(candidates[name], self.budget_s / len(eligible)) for name in eligible}
            backend = min(times, key=times.get)
            reason = "faster" if len(times) > 1 else "only backend that passed parity"
            decision = Decision(component, key, backend, times, parity_ok, reason=reason)
            self.cache.put(parts, {"backend": backend, "times_ms": times, "parity_ok": parity_ok})
        self.decisions.append(decision)
        logger.info(
            "hf_apex autotune: %s %s -> %s (%s; ms %s; parity %s)",
            component,
            key,
            decision.backend,
            decision.reason,
            {k: round(v, 4) for k, v in decision.times_ms.items()},
            decision.parity_ok,
        )
        return decision

    def begin_run(self) -> None:
        """A training run starts: its report holds only the decisions taken from here on."""
        self.memo.clear()
        self._run_start = len(self.decisions)

    def report(self) -> list[dict]:
        """The decisions of the current run (all of them when begin_run was never called)."""
        return [dataclasses.asdict(d) for d in self.decisions[self._run_start :]]


_AUTOTUNER: Autotuner | None = None


def configure_autotuner(cache_path: str | os.PathLike | None = None) -> Autotuner:
    """Start the process-wide autotuner with this cache file (a trainer with ``autotune`` calls this)."""
    global _AUTOTUNER
    wanted = Path(cache_path) if cache_path else default_cache_path()
    if _AUTOTUNER is None or _AUTOTUNER.cache.path != wanted:
        _AUTOTUNER = Autotuner(DecisionCache(wanted))
    return _AUTOTUNER


def get_autotuner() -> Autotuner:
    """The process-wide autotuner (with the default cache when none was configured)."""
    return _AUTOTUNER or configure_autotuner()


def autotune_report() -> list[dict]:
    """The decisions of the current run (empty when autotune never ran)."""
    return _AUTOTUNER.report() if _AUTOTUNER is not None else []


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref64 = ref.detach().double()
    return float((got.detach().double() - ref64).norm() / ref64.norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    """Relative-error bound for parity: fp32 rounding vs bf16/fp16's 8/11-bit mantissas."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2
