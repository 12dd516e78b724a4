"""apex fused norms (through hf_apex's swapped modules) against the stock torch/HF modules, forward and backward,
with the profiler showing which kernels ran: apex's in eager mode, Inductor's own under torch.compile."""

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_apex import rewire
from hf_apex.kernels import trace
from tests.testing_utils import require_apex, require_cuda

pytestmark = [pytest.mark.gpu, require_cuda, require_apex]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def _run(module, x, grad_out, amp):
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
        y = module(x)
    y.backward(grad_out.to(y.dtype))
    grads = [x.grad] + [p.grad for p in module.parameters()]
    for p in module.parameters():
        p.grad = None
    return y.detach(), [g.detach() for g in grads]


# Tolerances on ||apex - ref|| / ||ref||, the reference being the stock module in float64.
# FP32: both compute in fp32 with different reduction orders, so ~1e-6 is expected.
# Autocast: apex casts input *and* weight to the autocast dtype and returns it (bf16: 8 mantissa bits, ~4e-3 per
# value; fp16: 11 bits).
TOLERANCE = {None: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("amp", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("hidden", [768, 1024, 4096])
def test_fused_norm_matches_torch_and_runs_apex_kernels(kind, hidden, amp):
    torch.manual_seed(0)
    stock = torch.nn.LayerNorm(hidden) if kind == "layer_norm" else LlamaRMSNorm(hidden, eps=1e-6)
    with torch.no_grad():  # non-trivial affine parameters
        stock.weight.normal_(1.0, 0.2)
        if kind == "layer_norm":
            stock.bias.normal_(0.0, 0.2)
    stock = stock.cuda()
    x = torch.randn(8, 512, hidden, device="cuda") * 3 + 1
    grad_out = torch.randn_like(x)
    want_y, want_grads = _run(copy.deepcopy(stock).double(), x.double(), grad_out.double(), amp=None)

    rewire(stock, strict_kernels=True)
    profile = trace.KernelProfile().start()
    got_y, got_grads = _run(stock, x, grad_out, amp)
    seen = profile.stop()["apex"]
    profile.close()
    assert kind in seen, seen  # apex's kernels ran, not torch's (which would pass the tolerance too)
    calls = trace.calls_since(trace.collect(stock), {})[kind]
    assert calls["apex"] == 1 and calls["fallback"] == 0
    if amp is not None:
        assert got_y.dtype == amp  # apex runs the norm in the autocast dtype

    tol = TOLERANCE[amp]
    assert rel_err(got_y, want_y) < tol
    for got, want in zip(got_grads, want_grads):
        assert rel_err(got, want) < tol


def test_under_compile_the_graph_runs_inductors_norm_not_apexs():
    norm = torch.nn.LayerNorm(256).cuda()
    rewire(norm)
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    eager = trace.KernelProfile().start()
    norm(x).sum().backward()
    assert "layer_norm" in eager.stop()["apex"]  # the same module, outside a graph, runs apex's kernel
    eager.close()
    compiled = torch.compile(norm)
    compiled(x).sum().backward()  # compile first, then profile a warm call
    profile = trace.KernelProfile().start()
    y = compiled(x)
    y.sum().backward()
    seen = profile.stop()
    profile.close()
    assert seen["apex"] == {} and seen["cuda_kernels"] > 0, seen
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (256,), norm.weight, norm.bias))
