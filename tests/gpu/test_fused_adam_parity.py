"""apex FusedAdam (as hf_apex builds it) against torch AdamW and against hf_apex's torch-op fallback."""

import copy

import pytest
import torch

from hf_apex.kernels.apex.optim import FusedAdamFallback, apex_optimizer_class
from tests.testing_utils import require_apex, require_cuda

pytestmark = [pytest.mark.gpu, require_cuda, require_apex]


@pytest.fixture(autouse=True)
def strict_fp32():
    """These comparisons hold FP32 rounding only: with TF32 matmuls (which an earlier test in the same process
    can leave on) 20 steps drift by ~5e-5. tests/conftest.py restores the flags after each test."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()


def _train(model, optimizer, steps=20):
    g = torch.Generator("cuda").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(32, 256, device="cuda", generator=g)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_adam_follows_torch_adamw_for_20_steps(weight_decay):
    base = _mlp()
    apex_model, torch_model, fallback_model = base, copy.deepcopy(base), copy.deepcopy(base)
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    got = _train(apex_model, apex_optimizer_class("fused_adam")(apex_model.parameters(), **kw))
    want = _train(torch_model, torch.optim.AdamW(torch_model.parameters(), foreach=True, **kw))
    fallback = _train(fallback_model, FusedAdamFallback(fallback_model.parameters(), **kw))
    for a, t, f in zip(got, want, fallback):
        # Same update rule, different op order: differences stay at fp32 rounding level after 20 steps.
        torch.testing.assert_close(a, t, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, f, rtol=1e-5, atol=1e-6)


def test_fused_adam_state_dict_resume():
    model = _mlp()
    opt = apex_optimizer_class("fused_adam")(model.parameters(), lr=1e-3, weight_decay=0.1)
    _train(model, opt, steps=5)
    state = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(model.state_dict())
    straight = _train(model, opt, steps=5)

    model2 = _mlp()
    model2.load_state_dict(weights)
    opt2 = apex_optimizer_class("fused_adam")(model2.parameters(), lr=1e-3, weight_decay=0.1)
    opt2.load_state_dict(state)
    assert opt2.param_groups[0]["step"] == 5
    resumed = _train(model2, opt2, steps=5)
    for a, b in zip(straight, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
