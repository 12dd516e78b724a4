"""``auto``: time apex against torch for each component on this GPU, and use the faster.

An :class:`Autotuner` belongs to one ``ApexTrainer``. It decides once per run for each component: the optimizer
(over the model's parameter shapes) and the norms. ``ApexTrainer`` decides the norms of the whole model at once, by
timing the forward and backward of the first training batch with each backend (:meth:`Autotuner.choose_norms`):
under autocast apex's norms return the autocast dtype where torch's return FP32, so the matmuls after them cast
less and the residual stream is half the bytes, which only a whole step shows (BERT-base 128 × 128 on an H200: a
single LayerNorm is faster in torch, the step faster with apex). A long run then checks that choice on whole training
steps (:class:`NormTrial`), where the host's share of a step shows. A norm that meets no such decision (``rewire``
with a chooser, outside the trainer) is timed alone on its first training call (class, hidden size, input dtype,
autocast dtype, token count). With ``attention_backend="fastest"`` it also chooses the SDPA backend of the model's
attention (:meth:`Autotuner.choose_attention`, :func:`attention_probe`): PyTorch's own choice is the reference there,
and the math backend in FP32 the parity check. The disk cache (:class:`DecisionCache`) is consulted before
anything is measured; its key adds the GPU and software versions and, for norms, the token count rounded up to a
power of two, so the next run with the same setup starts with the answer. torch's op is the reference: a backend
whose results differ from it beyond the tolerance of the dtype is never chosen. Every decision (times, parity,
whether it came from the cache or a checkpoint) is logged and lands in the run's metrics JSON, and
:meth:`Autotuner.state` goes into each checkpoint so that a resumed run keeps the optimizer whose state it loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel

from . import distributed
from .kernels import attention, norms
from .kernels.availability import environment
from .kernels.norms import stock_class
from .kernels.trace import APEX, TORCH
from .measure.steps import StepTimer

logger = logging.getLogger("hf_apex")

AUTOTUNE_PARAM_BYTES = 2**29  # time the optimizer on at most 512 MiB of the model's parameters (a sample)
STATE_FILE = "hf_apex_autotune.json"  # in each checkpoint: the decisions a resumed run must keep
TIMING_ROUNDS = 3  # candidates are timed in turns, this many rounds each
TRIAL_BLOCK = 4  # optimizer steps per block of the norms' trial on whole training steps (NormTrial)
TRIAL_ORDER = (0, 1, 1, 0)  # its blocks: the passes' choice, the other backend, the other, the passes' choice
TRIAL_MIN_STEPS = 64  # a run with fewer optimizer steps keeps the passes' choice (the trial would be too much of it)
TRIAL_STEPS = TRIAL_BLOCK * len(TRIAL_ORDER)
TRIAL_WARMUP = TRIAL_STEPS + 2  # warm-up of a run with a trial: the passes' step, the trial's, the profiled one after
# The trial's backends tie when their median steps differ by less than this fraction of the faster one's (or by less
# than the steps' own spread, NormTrial.tied): a tie decides this run only and is not cached.
TRIAL_TIE = 0.01


def default_cache_path() -> Path:
    return Path(os.environ.get("HF_APEX_CACHE") or Path.home() / ".cache" / "hf_apex" / "autotune.json")


def environment_key() -> dict:
    """What makes a timing valid elsewhere: the GPU and the software that runs the kernels."""
    env = environment()
    return {k: env[k] for k in ("gpu", "torch", "cuda", "hf_apex")} | {"apex": env["apex"].get("commit")}


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


def training_pass(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """A ``run_step`` for :meth:`Autotuner.choose_norms`: ``loss_fn()`` (forward, under the run's autocast) and
    the backward to every trainable parameter; the gradients are returned and dropped, ``.grad`` is not touched."""
    params = [p for p in model.parameters() if p.requires_grad]

    def run_step() -> None:
        model.train()
        torch.autograd.grad(loss_fn(), params, allow_unused=True)

    return run_step


def _capture(store: dict, module, args) -> None:
    """Forward pre-hook: the first input of each kind of norm whose route would run apex's kernel."""
    x = args[0]
    amp = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    kind = (stock_class(module), x.shape[-1], x.dtype, amp)
    blocked = norms.blocker(module.hf_apex_component, x.device) or module._hf_apex_input_blocker(x, amp)
    if kind not in store and not blocked:
        store[kind] = (module, x.detach(), amp)


def norm_probe(module: torch.nn.Module, x: torch.Tensor, amp: torch.dtype | None):
    """``(fwd_bwd(backend), parity(backend))`` for a swapped norm on its input ``x``: one forward and backward
    with apex's kernel or torch's op, and whether apex's outputs and gradients match torch's within the dtype's
    tolerance. Neither moves the training RNG or touches ``.grad``; both work under ``no_grad`` callers."""
    params = [p for p in module.parameters() if p.requires_grad]
    forwards = {APEX: module.hf_apex_kernel(amp), TORCH: stock_class(module).forward}
    probe = x.detach().clone().requires_grad_(True)
    with torch.random.fork_rng(devices=[x.device] if x.is_cuda else []):
        grad_out = torch.randn_like(x, dtype=amp or x.dtype)

    def fwd_bwd(backend):
        # Identity saved-tensor hooks: an enclosing non-reentrant activation checkpoint (or CPU offload) must not
        # capture the probe's own graph (it would try to recompute the layer mid-forward). The run's autocast again:
        # a probe made after the pass has none, and torch's op refuses a bf16 input with fp32 weights without it.
        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
            torch.autocast(x.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None),
        ):
            y = forwards[backend](module, probe)
            return y, torch.autograd.grad(y, [probe, *params], grad_out.to(y.dtype))

    def parity(backend):
        (y, grads), (ref_y, ref_grads) = fwd_bwd(backend), fwd_bwd(TORCH)
        tol = tolerance(amp or x.dtype)
        return all(rel_err(a, b) < tol for a, b in zip([y, *grads], [ref_y, *ref_grads]))

    return fwd_bwd, parity


def attention_probe(call: attention.AttentionCall) -> tuple[dict[str, Callable[[], None]], Callable[[str], bool]]:
    """``(candidates, parity)`` for the autotuner: one forward and backward of ``call``'s attention on random inputs
    per backend that can run it (TORCH, PyTorch's own choice, always), and whether a backend's output and gradients
    match the math backend's in FP32 within the tolerance of ``call``'s dtype (without dropout, whose masks differ
    by backend)."""
    strides = call.strides or (None, None, None)
    with torch.random.fork_rng(devices=[call.device] if call.device.type == "cuda" else []):
        q, k, v = (
            _random(shape, stride, call.dtype, call.device)
            for shape, stride in zip((call.query, call.key, call.value), strides)
        )
        # the output's gradient: dense, its dimensions in the query's memory order (heads inside tokens for a model
        # whose query is a view of a (batch, tokens, heads x dim) projection)
        grad_out = _random(call.query[:-1] + call.value[-1:], q.stride(), call.dtype, call.device, dense=True)

    def run(backend: str, dropout_p: float, dtype: torch.dtype | None = None):
        def cast(t: torch.Tensor) -> torch.Tensor:  # (the FP32 reference: contiguous, its values are what matters)
            if dtype is None or not t.is_floating_point():
                return t
            return t.to(dtype, memory_format=torch.contiguous_format)

        inputs = [cast(t).detach().requires_grad_(True) for t in (q, k, v)]
        mask = None if call.mask is None else cast(call.mask)
        only = contextlib.nullcontext() if backend == TORCH else sdpa_kernel([attention.BACKENDS[backend]])
        with torch.enable_grad(), only:
            out = torch.nn.functional.scaled_dot_product_attention(
                *inputs,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=call.is_causal,
                scale=call.scale,
                enable_gqa=call.enable_gqa,
            )
            return out, torch.autograd.grad(out, inputs, cast(grad_out))

    candidates = {TORCH: lambda: run(TORCH, call.dropout_p)}
    for name in attention.BACKENDS:
        try:
            with warnings.catch_warnings():  # (PyTorch warns why a backend cannot run before it raises)
                warnings.simplefilter("ignore", UserWarning)
                run(name, call.dropout_p)  # can it run this call at all (shape, mask, dtype, device)?
        except RuntimeError:
            continue
        candidates[name] = lambda name=name: run(name, call.dropout_p)

    def parity(name: str) -> bool:
        # The reference in FP32: two BF16 kernels can each be right and still differ by more than one rounding.
        # Without dropout (each backend draws its own masks): a backend's dropout path is not checked here.
        try:
            (out, grads), (ref, ref_grads) = run(name, 0.0), run("math", 0.0, torch.float32)
        except torch.OutOfMemoryError:  # the FP32 reference of a long sequence: leave the backend out
            return False
        return all(rel_err(a, b) < tolerance(call.dtype) for a, b in zip([out, *grads], [ref, *ref_grads]))

    return candidates, parity


def _random(shape, stride, dtype, device, dense: bool = False) -> torch.Tensor:
    """Standard-normal values of ``shape`` laid out in memory as ``stride`` says; ``dense``: no gaps, the dimensions
    in the order of ``stride``. Contiguous where ``stride`` is None or overlaps itself (an expanded tensor's 0s)."""
    if stride is None or any(st == 0 and n > 1 for n, st in zip(shape, stride)):
        return torch.randn(shape, dtype=dtype, device=device)
    if dense:
        order = sorted(range(len(shape)), key=lambda d: -stride[d])  # outermost dimension first
        return torch.empty_permuted(shape, order, dtype=dtype, device=device).normal_()
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).normal_()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref64 = ref.detach().double()
    return float((got.detach().double() - ref64).norm() / ref64.norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    """Relative-error bound for parity: fp32 rounding vs bf16/fp16's 8/11-bit mantissas."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


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


class DecisionCache:
    """A JSON file of decisions; a corrupt or unusable file is ignored with a warning, never a crash."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else default_cache_path()
        self._entries: dict[str, dict] | None = None

    @staticmethod
    def key(parts: dict) -> str:
        return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()

    def _load(self) -> dict[str, dict]:
        if self._entries is None:
            self._entries = {}
            if self.path.is_dir():
                logger.warning("hf_apex: autotune cache %s is a directory; decisions will not be cached.", self.path)
            elif self.path.is_file():
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
        if distributed.rank() != 0 or self.path.is_dir():  # one writer per job; every rank keeps it in memory
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=1, default=str))
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("hf_apex: could not write the autotune cache %s (%s).", self.path, exc)


class NormTrial:
    """The norms' decision checked on whole training steps, after :meth:`Autotuner.choose_norms` timed forward and
    backward alone.

    Those passes measure the device well, but not the host work of the rest of a step (optimizer, clipping, the
    Trainer's own), and where a step is host-bound that decides: the faster passes can make the slower steps. So the
    next optimizer steps run in blocks of
    :data:`TRIAL_BLOCK`, the passes' choice and the other backend in turns (:data:`TRIAL_ORDER`), timed as the stage
    metrics time steps (start to next start, CUDA events, one sync at the end). Each block's first step, the switch,
    is left out; the backend with the lower median step stays for the rest of the run. Where the steps cannot tell
    the two apart (:meth:`tied`), that choice holds for this run only: it is not cached, and the next run checks
    again.
    """

    def __init__(self, key: dict, passes, switch: Callable[[str], None], cuda: bool, after: int | None = None):
        self.key, self.passes, self.switch = key, passes, switch
        first = passes.backend
        pair = (first, TORCH if first == APEX else APEX)
        self.plan = [pair[i] for i in TRIAL_ORDER for _ in range(TRIAL_BLOCK)]  # TRIAL_STEPS long
        self.timer = StepTimer(cuda)
        self._begun = 0  # planned steps started
        self._step = after  # the optimizer step whose micro-batches run now (the passes' step, to begin with)
        self._dropped: set[int] = set()  # planned steps during which something else ran (evaluation, a save)
        self._times: list[float] | None = None  # the planned steps' milliseconds, read once (one sync)

    def interrupt(self) -> None:
        """Something that is not training runs now (evaluation, a checkpoint): the step in progress is left out."""
        if self._begun:
            self._dropped.add(self._begun - 1)

    def begin(self, step: int) -> bool:
        """A micro-batch of optimizer step ``step`` (the steps done before it) starts. True once every planned
        step has run: the trial is ready to decide."""
        if step == self._step:
            return False  # another micro-batch of the same optimizer step
        self._step = step
        if self._begun:
            self.timer.stop()
        if self._begun == len(self.plan):
            return True
        backend = self.plan[self._begun]
        if self._begun and backend != self.plan[self._begun - 1]:
            self.switch(backend)
        self._begun += 1
        self.timer.start()
        return False

    def kept(self) -> dict[str, list[float]]:
        """Each backend's steps in milliseconds, each block's first step and interrupted steps left out (one sync on
        a GPU, at the first call). A backend left with no step is left out."""
        if self._times is None:
            self._times = self.timer.drain(final=True)
        kept: dict[str, list[float]] = {name: [] for name in dict.fromkeys(self.plan)}
        for i, (backend, ms) in enumerate(zip(self.plan, self._times)):
            if i % TRIAL_BLOCK and i not in self._dropped:
                kept[backend].append(ms)
        return {name: times for name, times in kept.items() if times}

    def medians(self) -> dict[str, float]:
        """Each backend's median step in milliseconds (of :meth:`kept`)."""
        return {name: statistics.median(times) for name, times in self.kept().items()}

    def tied(self) -> bool:
        """Whether the steps cannot tell the two backends apart: their medians differ by less than
        :data:`TRIAL_TIE` of the faster one's, or by less than the steps' own spread (each backend's median
        absolute deviation from its median, the larger of the two). Where a step waits on a host whose speed
        changes for tens of steps at a time, all of the trial's steps can fall in one slow stretch, in which both
        backends take the same time."""
        kept, medians = self.kept(), self.medians()
        if len(kept) < 2:
            return False
        spread = max(statistics.median([abs(ms - medians[name]) for ms in times]) for name, times in kept.items())
        fast, slow = sorted(medians.values())
        return slow - fast < max(TRIAL_TIE * fast, spread)


class Autotuner:
    """Chooses between backends by timing them; one per trainer, decisions reported per run.

    Args:
        cache (`DecisionCache`, *optional*): the disk cache (default file: `$HF_APEX_CACHE` or
            `~/.cache/hf_apex/autotune.json`).
        timer (`callable`, *optional*): `timer(fn, budget_s) -> ms` (`fn.backend` names the candidate); CUDA events
            by default.
        budget_s (`float`, *optional*, defaults to 1.0): timing budget per decision, shared by its candidates.
    """

    def __init__(self, cache: DecisionCache | None = None, timer=None, budget_s: float = 1.0):
        self.cache = cache or DecisionCache()
        self.timer = timer or cuda_timer
        self.budget_s = budget_s
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

        def prepare():
            from .kernels.optim import apex_optimizer_class

            common = {"lr": kwargs["lr"], "betas": kwargs["betas"], "eps": kwargs["eps"], "weight_decay": 0.01}
            with torch.random.fork_rng(devices=[params[0].device] if params and params[0].is_cuda else []):
                grads = [torch.randn_like(p) * 1e-3 for p in params]  # without moving the training RNG

            def build(name):
                copies = [p.detach().clone() for p in params]
                for c, g in zip(copies, grads):
                    c.grad = g
                cls = apex_optimizer_class("fused_adam") if name == APEX else torch.optim.AdamW
                return copies, cls(copies, **common) if name == APEX else cls(copies, fused=True, **common)

            def parity(name):
                (mine, opt), (ref, ref_opt) = build(name), build(TORCH)
                for _ in range(3):
                    opt.step()
                    ref_opt.step()
                return all(rel_err(a, b) < tolerance(torch.float32) for a, b in zip(mine, ref))

            return {name: build(name)[1].step for name in (APEX, TORCH)}, parity

        backend = self.choose("optimizer", key, prepare, same_on_all_ranks=True).backend
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
            "attention": str(getattr(getattr(model, "config", None), "_attn_implementation", None)),
            "norms": sorted({stock_class(m).__name__ for m in swapped}),
            "batch": list(batch_shape),
            "autocast": str(amp),
            "decided_on": "whole steps" if trial else "passes",
        }

        def prepare():
            def run(backend):
                self._forced_norm = backend
                try:
                    for m in swapped:
                        m.hf_apex_reset()
                    with torch.random.fork_rng(
                        devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []
                    ):
                        run_step()  # the same dropout masks for both backends, the training RNG untouched
                finally:
                    self._forced_norm = None

            def parity(backend):
                # Kernel against op on the input of each kind of norm in the model (class, hidden size, dtype,
                # autocast), captured in this backend's own pass: a whole model's loss and gradients drift apart in
                # BF16 with depth whichever kernel is right.
                inputs: dict = {}
                hooks = [m.register_forward_pre_hook(functools.partial(_capture, inputs)) for m in swapped]
                try:
                    run(backend)
                    return all(norm_probe(m, x, amp_)[1](backend) for m, x, amp_ in inputs.values())
                except torch.OutOfMemoryError:
                    return False  # left out as if it failed: an answer that does not fit is no answer
                finally:
                    for h in hooks:
                        h.remove()

            return {backend: (lambda backend=backend: run(backend)) for backend in (APEX, TORCH)}, parity

        passes = self.choose("norms", key, prepare, same_on_all_ranks=True, checked_later=trial)
        for m in swapped:
            m.hf_apex_reset()  # the timing's routes and counts go; the next call takes the decision
        self.memo["norms"] = passes.backend
        if trial and not passes.cached and len(passes.times_ms) == 2:
            switch = functools.partial(self._use_norms, swapped)
            self.trial = NormTrial(key, passes, switch, device.type == "cuda", after=self._step)
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
