"""apex FusedAdam / FusedLAMB for the Trainer, and a torch-op fallback with FusedAdam's exact layout.

transformers >= 5.8 has no ``adamw_apex_fused``: :func:`apex_optimizer_cls_and_kwargs` is what
``ApexTrainer.get_optimizer_cls_and_kwargs`` returns instead, so HF's decay/no-decay groups, scheduler,
clipping and checkpointing stay as they are.

:class:`FusedAdamFallback` runs when apex's ``amp_C`` kernels cannot (not built, CPU parameters). It computes
apex's update formula with torch ``_foreach`` ops and keeps apex's state layout (``exp_avg``/``exp_avg_sq`` in
fp32 per parameter, ``step`` per *param group*), so checkpoints move between the two. Each optimizer counts the
steps it ran in its :class:`~hf_apex.kernels.trace.KernelRoute` (``hf_apex_route``).

Under FSDP2 the parameters are DTensor shards, which apex's kernels cannot take: both optimizers step each
rank's local shards (:func:`step_local_shards`) and keep their state as DTensors sharded like the parameters, so
torch.distributed.checkpoint (what accelerate saves FSDP2 runs with) saves and restores it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from ...internals import local_tensor
from ...stages import APEX_OPTIMIZERS
from ..trace import APEX, FALLBACK, TORCH, KernelRoute
from .availability import blocker, fix_for
from .norms import ApexKernelError

logger = logging.getLogger("hf_apex")


def step_local_shards(optimizer: torch.optim.Optimizer, step: Callable[[Any], Any], closure=None):
    """``step(closure)`` with every DTensor parameter of ``optimizer`` replaced by its local shard (gradient and
    state too) for the duration of the call, then put back, the new state wrapped as DTensors again. Parameters
    without DTensors are untouched; a rank whose shard of a parameter is empty skips it but keeps its (empty)
    state, so that every rank's optimizer state has the same keys."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return step(closure)  # no DTensor without a process group: nothing to walk on one GPU
    from torch.distributed.tensor import DTensor

    swapped, moved, empty = [], [], []
    try:
        for group in optimizer.param_groups:
            params = group["params"]
            if not any(isinstance(p, DTensor) for p in params):
                continue
            local_params = []
            for p in params:
                if not isinstance(p, DTensor):
                    local_params.append(p)
                    continue
                local = local_tensor(p)
                if local.numel() == 0:
                    empty.append(p)
                    continue
                local.grad = local_tensor(p.grad) if p.grad is not None else None
                state = optimizer.state.pop(p, None)
                if state:
                    optimizer.state[local] = {
                        k: local_tensor(v) if isinstance(v, DTensor) else v for k, v in state.items()
                    }
                moved.append((p, local))
                local_params.append(local)
            swapped.append((group, params))
            group["params"] = local_params
        return step(closure)
    finally:
        for group, params in swapped:
            group["params"] = params
        for p, local in moved:
            local.grad = None
            state = optimizer.state.pop(local, None)
            if state:
                optimizer.state[p] = {k: _as_shard_of(p, v, local) for k, v in state.items()}
        for p in empty:
            if p.grad is not None and p not in optimizer.state:
                zeros = torch.zeros_like(p, dtype=torch.float32)
                optimizer.state[p] = {"exp_avg": zeros, "exp_avg_sq": zeros.clone()}


def _as_shard_of(param, value, local):
    from torch.distributed.tensor import DTensor

    if not torch.is_tensor(value) or value.shape != local.shape or value.dim() == 0:
        return value
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


class FusedAdamFallback(torch.optim.Optimizer):
    """apex ``FusedAdam``'s maths in torch ops (fallback: *not* an apex kernel).

    Same constructor as ``apex.optimizers.FusedAdam``; AdamW (decoupled decay) when ``adam_w_mode=True``.
    Update: ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        first = next((p for g in self.param_groups for p in g["params"]), None)
        reason = blocker("fused_adam", first.device if first is not None else None)
        if capturable or master_weights:
            why = f"apex cannot run here: {reason}" if reason else "this fallback was chosen directly"
            raise ValueError(
                f"capturable/master_weights need apex's FusedAdam kernel ({why}). {fix_for(reason or '')}".rstrip()
            )
        self.hf_apex_route = KernelRoute("optimizer", FALLBACK, reason=reason or "FusedAdamFallback chosen directly")

    @torch.no_grad()
    def step(self, closure=None):
        return step_local_shards(self, self._step, closure)

    def _step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1  # like apex: per non-empty group, grads or not
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            step, lr, wd = group["step"], group["lr"], group["weight_decay"]
            bc1 = 1 - beta1**step if group["bias_correction"] else 1.0
            bc2 = 1 - beta2**step if group["bias_correction"] else 1.0
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            p32 = [p.float() for p in params]  # the parameter itself when it is fp32
            grads = [p.grad.float() for p in params]
            if not self.adam_w_mode and wd != 0:
                grads = torch._foreach_add(grads, p32, alpha=wd)  # L2 mode: decay folded into the gradient
            m = [self.state[p]["exp_avg"] for p in params]
            v = [self.state[p]["exp_avg_sq"] for p in params]
            torch._foreach_lerp_(m, grads, 1 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
            denom = torch._foreach_div(v, bc2)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div(m, bc1)
            torch._foreach_div_(update, denom)
            if self.adam_w_mode and wd != 0:
                torch._foreach_add_(update, p32, alpha=wd)
            torch._foreach_add_(p32, update, alpha=-lr)
            for p, q in zip(params, p32):
                if p is not q:
                    p.copy_(q)
        self.hf_apex_route.calls += 1
        return loss


class TorchFusedAdamW(torch.optim.AdamW):
    """torch's ``AdamW(fused=True)`` where autotune timed it faster than apex's FusedAdam. Its steps are counted (the
    metrics' ``calls["optimizer"]["torch"]``) by a step post-hook, so ``AdamW.step`` runs unchanged. Under FP16 the
    fused AdamW takes the GradScaler's scale and skips an overflowed step itself, so such a step counts too, where
    the scaler never calls apex's ``step``."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.hf_apex_route = KernelRoute("optimizer", TORCH)
        self.register_step_post_hook(_count_step)


def _count_step(optimizer, args, kwargs) -> None:
    optimizer.hf_apex_route.calls += 1


@functools.cache
def apex_optimizer_class(name: str) -> type:
    """apex's ``FusedAdam`` or ``FusedLAMB``, subclassed to count the steps that ran (needs apex)."""
    from apex.optimizers import FusedAdam, FusedLAMB

    base = {"fused_adam": FusedAdam, "fused_lamb": FusedLAMB}[name]

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        self.hf_apex_route = KernelRoute("optimizer", APEX)

    def step(self, closure=None):
        out = step_local_shards(self, functools.partial(base.step, self), closure)
        self.hf_apex_route.calls += 1
        return out

    def zero_grad(self, set_to_none: bool = True):  # apex's takes no argument; torch (and DCP) pass one
        if not set_to_none:
            return torch.optim.Optimizer.zero_grad(self, set_to_none=False)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    members = {"__init__": __init__, "step": step, "zero_grad": zero_grad, "__module__": __name__}
    return type(f"Apex{base.__name__}", (base,), members)


def apex_optimizer_cls_and_kwargs(
    args: Any, model: torch.nn.Module | None = None, choose: Callable[[dict, str | None], str] | None = None
) -> tuple[type, dict[str, Any]]:
    """``(optimizer class, kwargs)`` for ``args.apex_optimizer``, in the shape the Trainer's hook returns.

    ``choose(kwargs, blocker) -> "apex" | "torch"`` is autotune (or a decision restored from a checkpoint);
    ``blocker`` says why apex cannot run here (None when it can). ``"torch"`` means torch's ``AdamW(fused=True)``
    with the same hyper-parameters; ``"apex"`` means apex's kernel, or FusedAdamFallback (same state layout)
    where it cannot run.
    """
    name = args.apex_optimizer
    if name not in APEX_OPTIMIZERS[1:]:
        raise ValueError(f"Unknown apex_optimizer {name!r}; choose one of {APEX_OPTIMIZERS}")
    kwargs: dict[str, Any] = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2)}
    kwargs["eps"] = args.adam_epsilon
    kwargs.update(args.apex_optimizer_kwargs or {})
    param = next(model.parameters(), None) if model is not None else None
    reason = blocker("fused_adam", param.device if param is not None else getattr(args, "device", None))
    if name == "fused_lamb":
        if kwargs.get("max_grad_norm", 1.0) > 0 and args.max_grad_norm > 0:
            logger.warning(
                "hf_apex: FusedLAMB clips the global gradient norm itself (max_grad_norm=%s) and the Trainer clips "
                "too (max_grad_norm=%s): gradients are clipped twice. Set one of them to 0.",
                kwargs.get("max_grad_norm", 1.0),
                args.max_grad_norm,
            )
        if reason is not None:
            raise ApexKernelError(f"FusedLAMB has no torch fallback and cannot run here ({reason}). {fix_for(reason)}")
        return apex_optimizer_class("fused_lamb"), kwargs
    if choose is not None and choose(kwargs, reason) == TORCH:
        return TorchFusedAdamW, {k: kwargs[k] for k in ("lr", "betas", "eps")} | {"fused": True}
    if reason is None:
        return apex_optimizer_class("fused_adam"), kwargs
    if getattr(args, "apex_strict_kernels", False):
        raise ApexKernelError(
            f"FusedAdam: strict kernels are on but apex cannot run here ({reason}). {fix_for(reason)}"
        )
    return FusedAdamFallback, kwargs
