"""The causal-LM loss without logits on the GPU, at GPT-2 124M's real size (16 x 1024 positions, 50,257-token
vocabulary, BF16 autocast): the stock loss and gradients, in less memory, eager and under torch.compile."""

import pytest
import torch
import transformers

from hf_apex.kernels import trace
from hf_apex.kernels.apex.availability import has_triton_ops
from hf_apex.kernels.models.loss import fuse_linear_cross_entropy
from hf_apex.kernels.ops import lm_loss
from hf_apex.kernels.ops.lm_loss import causal_lm_loss
from tests.testing_utils import require_cuda

pytestmark = [pytest.mark.gpu, require_cuda]


def gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).cuda().train()


def step(model, ids):
    """Loss, gradients (on the CPU) and the peak memory of one forward and backward under BF16 autocast, with
    nothing else on the GPU but ``model`` and ``ids``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return loss.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()}, peak


def test_gpt2_loss_and_gradients_match_the_stock_head_in_less_memory():
    ids = torch.randint(0, 50257, (16, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    stock = gpt2()
    ref_loss, ref_grads, ref_peak = step(stock, ids)
    del stock
    torch.cuda.empty_cache()
    fused = gpt2()
    assert fuse_linear_cross_entropy(fused) is None
    loss, grads, peak = step(fused, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)  # the same BF16 logits, FP32 softmax
    for name, ref in ref_grads.items():
        rel = (grads[name] - ref).norm() / ref.norm().clamp_min(1e-12)
        assert rel < 1e-2, (name, float(rel))  # BF16 matmuls; the head's gradient summed over chunks in FP32
    assert peak < ref_peak - 2 * 2**30  # the FP32 logits (3.3 GB) and their gradient are never held


def test_under_torch_compile_the_same_loss():
    hidden = torch.randn(4096, 768, device="cuda", requires_grad=True)
    weight = torch.randn(50257, 768, device="cuda", requires_grad=True)
    labels = torch.randint(0, 50257, (4, 1024), device="cuda")

    def loss_fn(h, w):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return causal_lm_loss(h.view(4, 1024, 768), w, labels)

    eager = loss_fn(hidden, weight)
    (eager_h, eager_w) = torch.autograd.grad(eager, [hidden, weight])
    compiled = torch.compile(loss_fn)(hidden, weight)
    (h, w) = torch.autograd.grad(compiled, [hidden, weight])
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, eager_h, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(w, eager_w, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_row_kernel_runs_and_gives_the_loss_and_gradients_of_torchs_ops(compiled, monkeypatch):
    """Each chunk's softmax, loss and gradient come from hf_apex's Triton row kernel on a GPU, eager and inside a
    compiled graph, with the results of the same chunk in torch's ops (BF16 autocast, GPT-2's vocabulary)."""
    if not has_triton_ops():
        pytest.skip("Triton cannot run here: the chunks run in torch's ops")
    assert lm_loss._register_row_kernel()  # (as a fused model's setup does, before anything is compiled)
    g = torch.Generator("cuda").manual_seed(0)
    hidden = torch.randn(4096, 768, device="cuda", generator=g, requires_grad=True)
    weight = (0.02 * torch.randn(50257, 768, device="cuda", generator=g)).requires_grad_()
    labels = torch.randint(0, 50257, (4, 1024), device="cuda", generator=g)
    labels[:, :100] = -100

    def loss_fn(h, w):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return causal_lm_loss(h.view(4, 1024, 768), w, labels)

    def run(kernel: bool):
        if not kernel:
            monkeypatch.setattr(lm_loss, "_row_op", lambda h: None)
        torch._dynamo.reset()
        fn = torch.compile(loss_fn) if compiled else loss_fn
        # hf_apex's own profile, as the Trainer's: a plain CUDA profile before one that detaches CUPTI leaves that one
        # empty on torch 2.11 (hf_apex.kernels.trace.EMPTY_PROFILE), and the kernel proofs of later tests with it
        profile = trace.KernelProfile().start()
        loss = fn(hidden, weight)
        grads = torch.autograd.grad(loss, [hidden, weight])
        profile.stop()
        profile.close()
        ran = any("softmax_xent_rows" in name for name in profile.kernel_names)
        return loss, grads, ran

    loss, (gh, gw), ran = run(kernel=True)
    if compiled:  # Dynamo traces the loss, the kernel's op and the backward in one piece
        assert torch._dynamo.explain(loss_fn)(hidden, weight).graph_break_count == 0
    ref, (rh, rw), ref_ran = run(kernel=False)
    assert ran and not ref_ran
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)  # FP32 sums in another order
    for a, b in ((gh, rh), (gw, rw)):  # the same BF16 gradient of the logits but for rare roundings of exp
        assert float((a - b).norm() / b.norm()) < 2e-3
