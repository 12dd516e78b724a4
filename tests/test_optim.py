import copy
import logging
import types

import pytest
import torch

from hf_apex.kernels.apex import optim
from hf_apex.kernels.apex.norms import ApexKernelError
from hf_apex.kernels.apex.optim import FusedAdamFallback, apex_optimizer_cls_and_kwargs


def _apex_reference_step(p, g, m, v, step, lr, betas, eps, wd, adam_w_mode=True):
    """apex csrc/multi_tensor_adam.cu AdamFunctor, written out in float64."""
    b1, b2 = betas
    if not adam_w_mode:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**step), v / (1 - b2**step)
    update = m_hat / (v_hat.sqrt() + eps)
    if adam_w_mode:
        update = update + wd * p
    return p - lr * update, m, v


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fallback_matches_apex_formula(adam_w_mode):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50, dtype=torch.float64))
    ref_p, m, v = p.detach().clone(), torch.zeros(50, dtype=torch.float64), torch.zeros(50, dtype=torch.float64)
    opt = FusedAdamFallback([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, adam_w_mode=adam_w_mode)
    for step in range(1, 11):
        g = torch.randn(50, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        ref_p, m, v = _apex_reference_step(ref_p, g, m, v, step, 1e-2, (0.9, 0.99), 1e-8, 0.1, adam_w_mode)
    torch.testing.assert_close(p.detach(), ref_p, rtol=1e-6, atol=1e-7)


def test_fallback_tracks_torch_adamw_over_20_steps():
    torch.manual_seed(0)
    a = torch.nn.Linear(16, 16)
    b = torch.nn.Linear(16, 16)
    b.load_state_dict(a.state_dict())
    opt_a = FusedAdamFallback(a.parameters(), lr=1e-3, weight_decay=0.01)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(20):
        x = torch.randn(8, 16)
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_fallback_state_layout_is_apexs():
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.randn(3))
    opt = FusedAdamFallback([{"params": [p]}, {"params": [q], "weight_decay": 0.0}], lr=1e-3)
    p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
    opt.step()
    opt.step()
    assert [g["step"] for g in opt.param_groups] == [2, 2]  # per group, a Python int, like apex
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and "step" not in opt.state[p]
    assert p.dtype == torch.bfloat16


def test_state_dict_round_trip_continues_the_same_trajectory():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(10))
    grads = [torch.randn(10) for _ in range(6)]
    opt = FusedAdamFallback([w], lr=1e-2, weight_decay=0.1)
    for g in grads[:3]:
        w.grad = g.clone()
        opt.step()
    saved_w, saved_state = w.detach().clone(), copy.deepcopy(opt.state_dict())
    for g in grads[3:]:
        w.grad = g.clone()
        opt.step()
    straight = w.detach().clone()

    w2 = torch.nn.Parameter(saved_w.clone())
    opt2 = FusedAdamFallback([w2], lr=1e-2, weight_decay=0.1)
    opt2.load_state_dict(saved_state)
    assert opt2.param_groups[0]["step"] == 3
    for g in grads[3:]:
        w2.grad = g.clone()
        opt2.step()
    torch.testing.assert_close(w2.detach(), straight, rtol=0, atol=0)


def test_fallback_refuses_what_apex_refuses():
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdamFallback([torch.nn.Parameter(torch.ones(1))], amsgrad=True)
    with pytest.raises(ValueError, match="apex"):
        FusedAdamFallback([torch.nn.Parameter(torch.ones(1))], capturable=True)


def _args(**kw):
    base = dict(
        apex_optimizer="fused_adam",
        learning_rate=1e-3,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        apex_optimizer_kwargs=None,
        apex_strict_kernels=False,
        max_grad_norm=1.0,
        device=torch.device("cpu"),
    )
    return types.SimpleNamespace(**{**base, **kw})


def test_cls_and_kwargs_without_kernels():
    cls, kwargs = apex_optimizer_cls_and_kwargs(_args(apex_optimizer_kwargs={"bias_correction": False}))
    assert cls is FusedAdamFallback
    assert kwargs == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "bias_correction": False}
    with pytest.raises(ApexKernelError, match="strict"):
        apex_optimizer_cls_and_kwargs(_args(apex_strict_kernels=True))
    # A decision that must be kept (a resumed checkpoint's) is honoured even where apex cannot run.
    cls, kwargs = apex_optimizer_cls_and_kwargs(_args(), choose=lambda kwargs, blocked: "torch")
    assert issubclass(cls, torch.optim.AdamW) and kwargs["fused"] is True
    with pytest.raises(ValueError, match="Unknown apex_optimizer"):
        apex_optimizer_cls_and_kwargs(_args(apex_optimizer="sgd"))


def test_lamb_warns_about_double_clipping_and_has_no_fallback(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_apex"), pytest.raises(ApexKernelError, match="no torch fallback"):
        apex_optimizer_cls_and_kwargs(_args(apex_optimizer="fused_lamb"))
    assert "clipped twice" in caplog.text


def test_fallback_counts_steps_per_group_like_apex_even_without_grads():
    frozen_this_step = torch.nn.Parameter(torch.randn(3))
    live = torch.nn.Parameter(torch.randn(3))
    opt = FusedAdamFallback([{"params": [frozen_this_step]}, {"params": [live]}], lr=1e-3)
    live.grad = torch.randn(3)
    opt.step()
    assert [g["step"] for g in opt.param_groups] == [1, 1]  # apex bumps every non-empty group
    assert not opt.state[frozen_this_step]
    assert opt.hf_apex_route.calls == 1 and opt.hf_apex_route.backend == "fallback"


def test_apex_subclass_takes_torch_zero_grad_arguments(monkeypatch):
    """apex's FusedAdam.zero_grad() takes no argument; torch and torch.distributed.checkpoint pass set_to_none."""
    import sys

    class ApexLike(optim.FusedAdamFallback):
        def zero_grad(self):  # apex's signature
            raise AssertionError("apex's own zero_grad cannot take set_to_none")

    fake = types.ModuleType("apex.optimizers")
    fake.FusedAdam = fake.FusedLAMB = ApexLike
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    monkeypatch.setitem(sys.modules, "apex.optimizers", fake)
    optim.apex_optimizer_class.cache_clear()
    try:
        p = torch.nn.Parameter(torch.ones(3))
        opt = optim.apex_optimizer_class("fused_adam")([p], lr=0.1)
        p.grad = torch.ones(3)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert p.grad is None and opt.hf_apex_route.backend == "apex"
        p.grad = torch.ones(3)
        opt.zero_grad(set_to_none=False)
        assert torch.equal(p.grad, torch.zeros(3))
    finally:
        optim.apex_optimizer_class.cache_clear()


@pytest.mark.parametrize("option", ["capturable", "master_weights"])
def test_an_apex_only_option_on_the_fallback_says_why_apex_cannot_run(option):
    with pytest.raises(ValueError, match=option.split("_")[0]) as raised:
        FusedAdamFallback([torch.nn.Parameter(torch.zeros(3))], **{option: True})
    assert "cpu tensors (apex kernels need CUDA tensors)" in str(raised.value)  # the reason, and what removes it
    assert str(raised.value).endswith("run on a CUDA machine, or leave the apex switches off.")
