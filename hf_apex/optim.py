"""apex FusedAdam / FusedLAMB for the Trainer, and a torch-op fallback with FusedAdam's exact layout.

transformers >= 5.8 has no ``adamw_apex_fused``: :func:`apex_optimizer_cls_and_kwargs` is what
``ApexTrainer.get_optimizer_cls_and_kwargs`` returns instead, so HF's decay/no-decay groups, scheduler,
clipping and checkpointing stay as they are.

:class:`FusedAdamFallback` runs when apex's ``amp_C`` kernels cannot (not built, CPU parameters). It computes
apex's update formula with torch ``_foreach`` ops and keeps apex's state layout (``exp_avg``/``exp_avg_sq`` in
fp32 per parameter, ``step`` per *param group*), so checkpoints move between the two. Every step of either
records which one ran.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Any

import torch

from .counters import APEX, FALLBACK, KERNEL_COUNTER
from .import_utils import APEX_BUILD_HINT, is_fused_adam_available
from .norms import ApexKernelError

logger = logging.getLogger("hf_apex")

APEX_OPTIMIZERS = ("none", "fused_adam", "fused_lamb")


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
        if capturable or master_weights:
            raise ValueError(f"capturable/master_weights need apex's kernels. {APEX_BUILD_HINT}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        first = next((p for g in self.param_groups for p in g["params"]), None)
        self.fallback_reason = (
            _kernel_blocker(first.device if first is not None else None) or "FusedAdamFallback constructed directly"
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        KERNEL_COUNTER.record("optimizer", FALLBACK, self.fallback_reason)
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
        return loss


@functools.lru_cache
def _apex_classes() -> dict[str, type]:
    """Subclasses of apex's optimizers that record each step (defined on first use: needs apex)."""
    from apex.optimizers import FusedAdam, FusedLAMB

    class ApexFusedAdam(FusedAdam):
        def step(self, *args, **kwargs):
            KERNEL_COUNTER.record("optimizer", APEX)
            return super().step(*args, **kwargs)

    class ApexFusedLAMB(FusedLAMB):
        def step(self, *args, **kwargs):
            KERNEL_COUNTER.record("optimizer", APEX)
            return super().step(*args, **kwargs)

    return {"fused_adam": ApexFusedAdam, "fused_lamb": ApexFusedLAMB}


def _kernel_blocker(device: torch.device | None) -> str | None:
    """Why apex's optimizer kernels cannot run for parameters on ``device``, or None when they can."""
    if not is_fused_adam_available():
        return "apex amp_C extension not available"
    if device is not None and device.type != "cuda":
        return f"{device.type} parameters"
    return None


def apex_optimizer_cls_and_kwargs(args: Any, model: torch.nn.Module | None = None) -> tuple[type, dict[str, Any]]:
    """``(optimizer class, kwargs)`` for ``args.apex_optimizer``, in the shape the Trainer's hook returns."""
    name = args.apex_optimizer
    if name not in APEX_OPTIMIZERS[1:]:
        raise ValueError(f"Unknown apex_optimizer {name!r}; choose one of {APEX_OPTIMIZERS}")
    kwargs: dict[str, Any] = {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
    }
    kwargs.update(args.apex_optimizer_kwargs or {})
    param = next(model.parameters(), None) if model is not None else None
    blocker = _kernel_blocker(param.device if param is not None else getattr(args, "device", None))
    if name == "fused_lamb":
        if kwargs.get("max_grad_norm", 1.0) > 0 and args.max_grad_norm > 0:
            logger.warning(
                "hf_apex: FusedLAMB clips the global gradient norm itself (max_grad_norm=%s) and the Trainer clips "
                "too (max_grad_norm=%s): gradients are clipped twice. Set one of them to 0.",
                kwargs.get("max_grad_norm", 1.0),
                args.max_grad_norm,
            )
        if blocker is not None:
            raise ApexKernelError(
                f"FusedLAMB has no torch fallback and cannot run here ({blocker}). {APEX_BUILD_HINT}"
            )
        return _apex_classes()["fused_lamb"], kwargs
    if blocker is None:
        if getattr(args, "autotune", False) and model is not None:
            backend = autotune_adam(model, kwargs)
            torch.cuda.empty_cache()  # give back the timing copies of the parameters
            if backend == "torch":
                return torch.optim.AdamW, {k: kwargs[k] for k in ("lr", "betas", "eps")} | {"fused": True}
        return _apex_classes()["fused_adam"], kwargs
    if getattr(args, "apex_strict_kernels", False):
        raise ApexKernelError(
            f"FusedAdam: strict kernels are on but apex cannot run here ({blocker}). {APEX_BUILD_HINT}"
        )
    return FusedAdamFallback, kwargs


AUTOTUNE_PARAM_BYTES = 2**29  # time the optimizer on at most 512 MiB of the model's parameters (a sample)


def autotune_adam(model: torch.nn.Module, kwargs: dict[str, Any]) -> str:
    """ "apex" or "torch": apex FusedAdam against torch AdamW(fused=True) on copies of the model's parameters.

    Only the AdamW hyper-parameters both implement are compared; other apex options keep apex.
    """
    from apex.optimizers import FusedAdam  # the raw class: timing steps are not counted as training steps

    from .autotune import APEX, TORCH, get_autotuner, rel_err, tolerance

    if set(kwargs) - {"lr", "betas", "eps", "weight_decay"}:
        return APEX
    params, total = [], 0
    for p in model.parameters():
        if p.requires_grad and total + p.numel() * p.element_size() <= AUTOTUNE_PARAM_BYTES:
            params.append(p)
            total += p.numel() * p.element_size()
    shapes = sorted((tuple(p.shape), str(p.dtype)) for p in params)
    key = {
        "tensors": len(params),
        "numel": sum(p.numel() for p in params),
        "shapes": hashlib.sha1(repr(shapes).encode()).hexdigest()[:16],
    }
    common = {"lr": kwargs["lr"], "betas": kwargs["betas"], "eps": kwargs["eps"], "weight_decay": 0.01}
    with torch.random.fork_rng(devices=[params[0].device] if params and params[0].is_cuda else []):
        grads = [torch.randn_like(p) * 1e-3 for p in params]  # without moving the training RNG

    def build(name):
        copies = [p.detach().clone() for p in params]
        for c, g in zip(copies, grads):
            c.grad = g
        opt = FusedAdam(copies, **common) if name == APEX else torch.optim.AdamW(copies, fused=True, **common)
        return copies, opt

    def parity(name):
        (mine, opt), (ref, ref_opt) = build(name), build(TORCH)
        for _ in range(3):
            opt.step()
            ref_opt.step()
        return all(rel_err(a, b) < tolerance(torch.float32) for a, b in zip(mine, ref))

    steppers = {name: build(name)[1].step for name in (APEX, TORCH)}
    # All ranks must step with the same implementation, or DDP replicas drift apart.
    return get_autotuner().choose("optimizer", key, steppers, parity, same_on_all_ranks=True).backend
