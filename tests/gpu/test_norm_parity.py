"""apex fused norms (through hf_apex's swapped modules) against the stock torch/HF modules, forward and backward."""

import copy
from collections import Counter

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_apex import rewire
from hf_apex.counters import KERNEL_COUNTER
from tests.testing_utils import require_apex, require_cuda

pytestmark = [pytest.mark.gpu, require_cuda, require_apex]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def _run(module, x, grad_out, autocast):
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = module(x)
    y.backward(grad_out.to(y.dtype))
    grads = [x.grad] + [p.grad for p in module.parameters()]
    for p in module.parameters():
        p.grad = None
    return y.detach(), [g.detach() for g in grads]


# Tolerances on ||apex - ref|| / ||ref||, the reference being the stock module in float64.
# FP32: both compute in fp32 with different reduction orders, so ~1e-6 is expected.
# BF16 autocast: apex casts input *and* weight to bf16 and returns bf16 (8 mantissa bits, ~4e-3 per value).
TOLERANCE = {False: 1e-5, True: 1.6e-2}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("hidden", [768, 1024, 4096])
def test_fused_norm_matches_torch(kind, hidden, autocast):
    torch.manual_seed(0)
    stock = torch.nn.LayerNorm(hidden) if kind == "layer_norm" else LlamaRMSNorm(hidden, eps=1e-6)
    with torch.no_grad():  # non-trivial affine parameters
        stock.weight.normal_(1.0, 0.2)
        if kind == "layer_norm":
            stock.bias.normal_(0.0, 0.2)
    stock = stock.cuda()
    x = torch.randn(8, 512, hidden, device="cuda") * 3 + 1
    grad_out = torch.randn_like(x)
    want_y, want_grads = _run(copy.deepcopy(stock).double(), x.double(), grad_out.double(), autocast=False)

    rewire(stock, strict_kernels=True)
    before = KERNEL_COUNTER.snapshot()
    got_y, got_grads = _run(stock, x, grad_out, autocast)
    calls = KERNEL_COUNTER.since(before)[kind]
    assert calls["apex"] == 1 and calls["fallback"] == 0
    if autocast:
        assert got_y.dtype == torch.bfloat16  # apex runs the norm in bf16 under autocast

    tol = TOLERANCE[autocast]
    assert rel_err(got_y, want_y) < tol
    for got, want in zip(got_grads, want_grads):
        assert rel_err(got, want) < tol


def test_compile_falls_back_to_the_torch_op():
    norm = torch.nn.LayerNorm(256).cuda()
    rewire(norm)
    compiled = torch.compile(norm)
    x = torch.randn(4, 256, device="cuda")
    torch.testing.assert_close(compiled(x), torch.nn.functional.layer_norm(x, (256,), norm.weight, norm.bias))
    assert KERNEL_COUNTER.since(Counter()).get("layer_norm", {}).get("apex", 0) == 0
