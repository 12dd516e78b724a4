"""The autotuner: for each component, the faster backend that matches torch's results, decided once per run.

:class:`Autotuner` consults the disk cache, else times the candidates a probe builds, in turns, keeping each one's
fastest round; the decisions are reported per run and kept in checkpoints, so a resumed run keeps its optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from collections.abc import Callable

import torch

from .. import distributed
from ..internals import attn_implementation
from ..kernels.apex import norms
from ..kernels.apex.norms import stock_class
from ..kernels.models import attention
from ..kernels.trace import APEX, TORCH
from .cache import DecisionCache, environment_key
from .probes import attention_probe, cuda_timer, norm_probe, optimizer_probe, passes_probe
from .trial import TRIAL_TIE, NormTrial

logger = logging.getLogger("hf_apex")

AUTOTUNE_PARAM_BYTES = 2**29  # time the optimizer on at most 512 MiB of the model's parameters (a sample)
TIMING_ROUNDS = 3  # candidates are timed in turns, this many rounds each


def _named(fn: Callable, backend: str) -> Callable:
    call = functools.partial(fn)
    call.backend = backend  # which candidate a timer is timing
    return call


@dataclasses.dataclass
class Decision:
    component: str
    key: dict
    backend: str | None  # None: nothing was decided (reason says why)
    times_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    parity_ok: dict[str, bool] = dataclasses.field(default_factory=dict)
    cached: bool = False
    reason: str = ""


class Autotuner:
    """Chooses between backends by timing them; one per trainer, decisions reported per run.

    Args:
        cache (`DecisionCache`, *optional*): the disk cache (default file: `$HF_APEX_CACHE` or
            `~/.cache/hf_apex/autotune.json`).
        timer (`callable`, *optional*): `timer(fn, budget_s) -> ms` (`fn.backend` names the candidate); CUDA events
            by default.
        budget_s (`float`, *optional*, defaults to 1.0): timing budget per decision, shared by its candidates.
        clock (`callable`, *optional*): `clock() -> seconds` that times the norms' trial on whole steps
            (:class:`NormTrial`); CUDA events on a GPU and `time.perf_counter` otherwise by default. Read when a
            trial starts: set the attribute before then to time a trainer's trial with another clock.
    """

    def __init__(
        self,
        cache: DecisionCache | None = None,
        timer=None,
        budget_s: float = 1.0,
        clock: Callable[[], float] | None = None,
    ):
        self.cache = cache or DecisionCache()
        self.timer = timer or cuda_timer
        self.budget_s = budget_s
        self.clock = clock
        self.begin_run()

    def begin_run(self, pinned: dict[str, str] | None = None) -> None:
        """A training run starts: it reports only its own decisions; ``pinned`` (from a checkpoint) are kept."""
        self.decisions: list[Decision] = []
        self.memo: dict[str, str] = dict(pinned or {})  # decision name -> backend, for this run
        self._pinned = set(self.memo)
        self._forced_norm: str | None = None  # the backend every norm takes while choose_norms times one
        self.trial: NormTrial | None = None  # the norms' trial on whole steps, while it runs
        self._step: int | None = None  # the optimizer step of the last at_step call

    def state(self) -> dict[str, str]:
        """The decisions a resumed run must keep (what :meth:`begin_run` takes back as ``pinned``); during the
        norms' trial, the passes' choice."""
        return {**self.memo, **({"norms": self.trial.passes.backend} if self.trial else {})}

    def report(self) -> list[dict]:
        return [dataclasses.asdict(d) for d in self.decisions]

    def choose(
        self,
        component: str,
        key: dict,
        prepare: Callable[[], tuple[dict, Callable]],
        same_on_all_ranks=False,
        checked_later: bool = False,
    ):
        """Pick the faster backend for ``component`` at ``key``.

        ``prepare()`` is called only when the cache has no answer; it returns ``(candidates, parity)``:
        candidates map a backend name to one timed call (TORCH is the reference and always eligible), and
        ``parity(name)`` says whether a non-reference backend matches torch. With ``same_on_all_ranks`` rank 0
        decides and the other ranks take its decision (a collective: every rank must call it), as the optimizer
        needs under DDP, where replicas that round their updates differently would drift apart. With
        ``checked_later``, a choice between two timed backends stays out of the disk cache: a later check (the
        norms' trial on whole steps) caches its own verdict, unless it is a tie.
        """
        decision = None
        if not same_on_all_ranks or distributed.rank() == 0:
            try:
                decision = self._decide(component, key, prepare, checked_later)
            except Exception as exc:
                if not (same_on_all_ranks and distributed.is_distributed()):
                    raise
                distributed.broadcast_object(f"{type(exc).__name__}: {exc}")  # the waiting ranks stop too
                raise
        if same_on_all_ranks:
            decision = distributed.broadcast_object(decision)
            if isinstance(decision, str):
                raise RuntimeError(f"hf_apex autotune: rank 0 failed deciding {component}: {decision}")
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

    @staticmethod
    def _cache_parts(component: str, key: dict) -> dict:
        return {"component": component, **environment_key(), **key}

    def _decide(self, component: str, key: dict, prepare, checked_later: bool = False) -> Decision:
        parts = self._cache_parts(component, key)
        hit = self.cache.get(parts)
        if hit is not None and hit.get("backend") in (APEX, TORCH, *attention.BACKENDS):
            return Decision(
                component, key, hit["backend"], hit.get("times_ms", {}), hit.get("parity_ok", {}), True, "cache"
            )
        candidates, parity = prepare()
        parity_ok = {name: name == TORCH or bool(parity(name)) for name in candidates}
        eligible = [name for name in candidates if parity_ok[name]]
        # In turns (A B, B A, A B), keeping each candidate's fastest round: a burst of host noise (another
        # tenant, a clock change) that slows one round cannot decide.
        rounds = {name: [] for name in eligible}
        budget = self.budget_s / (len(eligible) * TIMING_ROUNDS)
        out_of_memory = []
        for r in range(TIMING_ROUNDS):
            for name in eligible if r % 2 == 0 else eligible[::-1]:
                if name in out_of_memory:
                    continue
                try:
                    rounds[name].append(self.timer(_named(candidates[name], name), budget))
                except torch.OutOfMemoryError:
                    # (a whole pass with torch's norms holds FP32 activations: more than apex's BF16 ones)
                    if len(out_of_memory) + 1 == len(eligible):
                        raise  # nothing fits: training would not either
                    out_of_memory.append(name)
                    torch.cuda.empty_cache()
        times = {name: min(ms) for name, ms in rounds.items() if name not in out_of_memory}
        backend = min(times, key=times.get)
        reason = "faster" if len(times) > 1 else f"{out_of_memory[0]}: out of memory" if out_of_memory else "parity"
        if not out_of_memory and not (checked_later and len(times) > 1):  # (memory: what else the process holds)
            self.cache.put(parts, {"backend": backend, "times_ms": times, "parity_ok": parity_ok})
        return Decision(component, key, backend, times, parity_ok, reason=reason)

    def _pinned_decision(self, name: str, component: str, key: dict) -> str | None:
        backend = self.memo.get(name)
        if backend is not None and name in self._pinned:
            self._pinned.discard(name)  # reported once, at its first use in the run
            self.decisions.append(Decision(component, key, backend, cached=True, reason="resumed checkpoint"))
        return backend

    # -- the optimizer ---------------------------------------------------------------------------------------
    def choose_optimizer(self, model: torch.nn.Module, kwargs: dict, blocked: str | None) -> str:
        """apex FusedAdam or torch AdamW(fused=True) for ``model``, timed on its real parameter shapes.

        ``blocked`` (why apex cannot run here) skips the timing. Only the AdamW hyper-parameters both implement
        are compared; other apex options keep apex. The cache is consulted before any parameter is copied.
        """
        pinned = self._pinned_decision("optimizer", "optimizer", {})
        if pinned is not None:
            return pinned
        apex_only = sorted(set(kwargs) - {"lr", "betas", "eps", "weight_decay"})
        why_not = []
        if blocked:
            why_not.append(f"apex cannot run here ({blocked})")
        if apex_only:
            why_not.append(f"apex-only options {apex_only}")
        if why_not:
            self.decisions.append(Decision("optimizer", {}, None, reason="not timed: " + "; ".join(why_not)))
            return APEX
        from torch.distributed.tensor import DTensor

        params, total = [], 0
        for param in filter(lambda q: q.requires_grad, model.parameters()):
            # FSDP2: time this rank's shards, the tensors the optimizer will step; rank 0 times alone, so nothing
            # here may run a collective (DTensor ops would)
            p = param.to_local() if isinstance(param, DTensor) else param
            if p.numel() and total + p.numel() * p.element_size() <= AUTOTUNE_PARAM_BYTES:
                params.append(p)
                total += p.numel() * p.element_size()
        shapes = sorted((tuple(p.shape), str(p.dtype)) for p in params)
        key = {
            "tensors": len(params),
            "numel": sum(p.numel() for p in params),
            "shapes": hashlib.sha1(repr(shapes).encode()).hexdigest()[:16],
        }

        backend = self.choose(
            "optimizer", key, lambda: optimizer_probe(params, kwargs), same_on_all_ranks=True
        ).backend
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give back the timing copies of the parameters
        self.memo["optimizer"] = backend
        return backend

    # -- the attention backend -------------------------------------------------------------------------------
    def choose_attention(self, call: attention.AttentionCall | None, blocked: str | None = None) -> str:
        """The fastest SDPA backend for the model's attention ``call`` (see :func:`attention.capture`), timed on
        its shapes, memory layout, mask, dropout and scale; ``"torch"`` (PyTorch's own choice) when there is no call
        to time, ``blocked`` says why not to time, or nothing beats it. Rank 0 decides for all ranks (every rank
        calls)."""
        pinned = self._pinned_decision("attention", "attention", {})
        if pinned is not None:
            return pinned
        if blocked is None and call is None:
            blocked = "not timed: no SDPA call in the model's forward"
        if blocked is None and call.device.type != "cuda" and self.timer is cuda_timer:
            blocked = "not timed: CUDA events time CUDA only"
        if blocked is not None:
            self.decisions.append(Decision("attention", {}, attention.TORCH, reason=blocked))
            backend = attention.TORCH
        else:  # (a collective under DDP: every rank reaches its first training step)
            key = {**call.describe(), "cudnn": torch.backends.cudnn.version() if call.device.type == "cuda" else None}
            # The probe's dropout draws stay out of the run's random streams (rank 0 times alone: it keeps in step).
            with torch.random.fork_rng(devices=[call.device] if call.device.type == "cuda" else []):
                backend = self.choose("attention", key, lambda: attention_probe(call), same_on_all_ranks=True).backend
        self.memo["attention"] = backend
        return backend

    # -- the norms -------------------------------------------------------------------------------------------
    def choose_norms(
        self,
        model: torch.nn.Module,
        run_step: Callable[[], None],
        batch_shape: tuple[int, ...],
        amp: torch.dtype | None,
        trial: bool = False,
    ) -> str | None:
        """apex or torch for every swapped norm of ``model``, by timing ``run_step`` (forward and backward of a
        real batch of ``batch_shape`` under autocast ``amp``; it must leave the parameters' ``.grad`` alone, see
        :func:`training_pass`) with each backend, in turns. apex is eligible only where each norm type's kernel
        matches torch's op on that type's own input in the batch. Rank 0 decides for all ranks; the others do not
        run ``run_step``. Returns the backend, or None when the model has no swapped norm.

        With ``trial`` (a run of at least :data:`TRIAL_MIN_STEPS` steps), when both backends were timed, the
        training steps that follow check the choice (:class:`NormTrial`; the caller calls :meth:`at_step` at each
        micro-batch), and only their verdict goes into the disk cache, unless it is a tie (:meth:`NormTrial.tied`).
        """
        swapped = [m for m in model.modules() if norms.is_swapped(m)]
        if not swapped:
            return None
        pinned = self._pinned_decision("norms", "norms", {})
        if pinned is not None:
            return pinned
        device = next(model.parameters()).device
        blocked = [norms.blocker(m.hf_apex_component, device) for m in swapped]
        if all(blocked):  # every norm falls back to torch anyway: nothing to time
            self.decisions.append(
                Decision("norms", {}, None, reason=f"not timed: apex cannot run here ({blocked[0]})")
            )
            return None
        key = {
            "model": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "dtype": str(next(model.parameters()).dtype),
            "attention": str(attn_implementation(model)),
            "norms": sorted({stock_class(m).__name__ for m in swapped}),
            "batch": list(batch_shape),
            "autocast": str(amp),
            "decided_on": "whole steps" if trial else "passes",
        }

        def force(backend: str | None) -> None:
            self._forced_norm = backend

        prepare = functools.partial(passes_probe, swapped, run_step, force)
        passes = self.choose("norms", key, prepare, same_on_all_ranks=True, checked_later=trial)
        for m in swapped:
            m.hf_apex_reset()  # the timing's routes and counts go; the next call takes the decision
        self.memo["norms"] = passes.backend
        if trial and not passes.cached and len(passes.times_ms) == 2:
            switch = functools.partial(self._use_norms, swapped)
            self.trial = NormTrial(key, passes, switch, device.type == "cuda", after=self._step, clock=self.clock)
        return passes.backend

    def _use_norms(self, swapped: list, backend: str) -> None:
        self.memo["norms"] = backend
        for m in swapped:
            m.hf_apex_reroute()  # the next call takes ``backend``; the calls so far stay counted

    def at_step(self, step: int) -> None:
        """A training micro-batch starts, ``step`` optimizer steps into the run: the norms' trial switches backends
        at its blocks' edges and decides once its steps have run (under DDP rank 0 decides: a collective, so every
        rank calls this at every micro-batch)."""
        self._step = step
        if self.trial is None or not self.trial.begin(step):
            return
        trial, self.trial = self.trial, None
        medians = trial.medians()
        both = len(medians) == 2  # (else evaluation or saving took every step of a backend)
        backend, tied = distributed.broadcast_object(
            (min(medians, key=medians.get), trial.tied()) if both else (trial.passes.backend, False)
        )
        trial.switch(backend)
        if not both:
            reason = "whole steps: too few uninterrupted steps, the passes' choice stays"
        elif tied:
            reason = (
                f"whole steps: a tie (medians within {TRIAL_TIE:.0%} or the steps' spread); the lower median for this "
                "run only, not cached: the next run checks again"
            )
        else:
            reason = "whole steps: the median step of each, after the passes"
        decision = Decision("norms", trial.key, backend, medians, trial.passes.parity_ok, reason=reason)
        self.decisions.append(decision)
        if both and not tied:
            entry = {"backend": backend, "times_ms": medians, "parity_ok": decision.parity_ok}
            self.cache.put(self._cache_parts("norms", trial.key), {**entry, "passes_ms": trial.passes.times_ms})
        logger.info(
            "hf_apex autotune: norms on whole steps -> %s (ms per step %s; the passes had chosen %s)%s",
            backend,
            {k: round(v, 3) for k, v in medians.items()},
            trial.passes.backend,
            "; a tie, not cached" if tied else "",
        )

    def interrupt(self) -> None:
        """Evaluation or a checkpoint runs between training steps: the norms' trial leaves that step out."""
        if self.trial is not None:
            self.trial.interrupt()

    def end_run(self) -> None:
        """Training stopped: a trial that has not finished gives way to the passes' choice, which nothing caches."""
        trial, self.trial = self.trial, None
        if trial is not None:
            trial.switch(trial.passes.backend)
            logger.info("hf_apex autotune: the norms' trial on whole steps did not finish; the passes' choice stays.")

    def choose_norm(self, module: torch.nn.Module, x: torch.Tensor, amp: torch.dtype | None) -> str:
        """apex or torch for this norm: the whole model's decision when :meth:`choose_norms` made one; else timed
        alone, once per run for this norm type, hidden size and dtype, on the first training call (rank 0 deciding
        for all ranks). An evaluation that runs before the first training call takes apex's kernel without
        deciding, and keeps it for the run's evaluations."""
        if self._forced_norm is not None:
            return self._forced_norm
        if "norms" in self.memo:
            return self.memo["norms"]
        key = {
            "norm": stock_class(module).__name__,
            "hidden": x.shape[-1],
            "dtype": str(x.dtype),
            "autocast": str(amp),
        }
        name = "norm:" + json.dumps(key, sort_keys=True)
        pinned = self._pinned_decision(name, module.hf_apex_component, key)
        if pinned is not None:
            return pinned
        if not module.training:
            return APEX
        tokens = x.numel() // x.shape[-1]

        def prepare():
            fwd_bwd, parity = norm_probe(module, x, amp)
            return {backend: (lambda backend=backend: fwd_bwd(backend)) for backend in (APEX, TORCH)}, parity

        bucket = 1 << max(tokens - 1, 0).bit_length()
        # Every rank reaches its first training call of this norm type at the same point: rank 0 decides for all,
        # so that replicas compute the same numerics (under autocast apex returns bf16 where torch returns fp32).
        backend = self.choose(
            module.hf_apex_component, key | {"tokens": bucket}, prepare, same_on_all_ranks=True
        ).backend
        self.memo[name] = backend
        return backend
