"""The autotuner's measurements: a timer for one candidate, and the probes that build each component's candidates
(one timed call per backend) and its parity check against torch's op.

A probe leaves the training run as it found it: it moves no RNG of the run and touches no ``.grad``.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Callable

import torch
from torch.nn.attention import sdpa_kernel

from ..kernels.apex import norms
from ..kernels.apex.norms import stock_class
from ..kernels.models import attention
from ..kernels.trace import APEX, TORCH


def cuda_timer(
    fn: Callable[[], None], budget_s: float, max_reps: int = 50, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Median milliseconds of ``fn`` over repetitions that fit in ``budget_s`` (after 3 warm-up calls), timed with
    CUDA events; ``clock`` (seconds) only bounds how many repetitions run."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times, deadline = [], clock() + budget_s
    while len(times) < max_reps and (len(times) < 5 or clock() < deadline):
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


def passes_probe(
    swapped: list[torch.nn.Module], run_step: Callable[[], None], force: Callable[[str | None], None]
) -> tuple[dict[str, Callable[[], None]], Callable[[str], bool]]:
    """``(candidates, parity)`` for the norms of a whole model: ``run_step`` (a forward and backward of a real
    batch) with every norm in ``swapped`` taking one backend (``force(backend)``, ``force(None)`` after), and whether
    apex's kernel matches torch's op on the input of each kind of norm in the model (class, hidden size, dtype,
    autocast), captured in that backend's own pass."""

    def run(backend):
        force(backend)
        try:
            for m in swapped:
                m.hf_apex_reset()
            with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
                run_step()  # the same dropout masks for both backends, the training RNG untouched
        finally:
            force(None)

    def parity(backend):
        # Per kind of norm, not the model's outputs: a whole model's loss and gradients drift apart in BF16 with
        # depth whichever kernel is right.
        inputs: dict = {}
        hooks = [m.register_forward_pre_hook(functools.partial(_capture, inputs)) for m in swapped]
        try:
            run(backend)
            return all(norm_probe(m, x, amp)[1](backend) for m, x, amp in inputs.values())
        except torch.OutOfMemoryError:
            return False  # left out as if it failed: an answer that does not fit is no answer
        finally:
            for h in hooks:
                h.remove()

    return {backend: (lambda backend=backend: run(backend)) for backend in (APEX, TORCH)}, parity


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


def optimizer_probe(params: list[torch.Tensor], kwargs: dict) -> tuple[dict[str, Callable[[], None]], Callable]:
    """``(candidates, parity)`` for the optimizer: one step of apex FusedAdam or torch AdamW(fused=True) on copies
    of ``params`` with random gradients, and whether three of apex's steps match torch's within FP32's tolerance.
    Only the AdamW hyper-parameters both implement are used (``lr``, ``betas``, ``eps``)."""
    from ..kernels.apex.optim import apex_optimizer_class

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
