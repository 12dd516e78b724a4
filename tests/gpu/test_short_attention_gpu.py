"""hf_apex's short-sequence attention kernel on the GPU: SDPA's results at BERT-base's attention shape in BF16,
dropout's rate and fresh draws, and a BERT compiled by Inductor (CUDA graphs included) with the kernel inside."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_apex.autotune import rel_err, tolerance
from hf_apex.kernels import attention
from hf_apex.kernels import short_attention as sa
from tests.testing_utils import require_cuda

pytestmark = [pytest.mark.gpu, require_cuda]


def bert_call(b=16, h=12, n=128, d=64, seed=0):
    """BERT's call: views of (batch, tokens, 768) projections, a padding mask, the output's gradient in
    (batch, tokens, heads, dim) order."""
    g = torch.Generator("cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, n, h * d, device="cuda", generator=g).bfloat16() for _ in range(3))
    q, k, v = (t.view(b, n, h, d).transpose(1, 2).requires_grad_() for t in (q, k, v))
    lengths = torch.randint(n // 4, n + 1, (b,), device="cuda", generator=g)
    mask = (torch.arange(n, device="cuda") < lengths[:, None])[:, None, None, :].expand(b, 1, n, n)
    grad = torch.randn(b, n, h, d, device="cuda", generator=g).bfloat16()
    return q, k, v, mask, grad


@pytest.mark.parametrize("causal", [False, True])
def test_the_kernel_gives_sdpas_attention_within_bf16_rounding(causal):
    assert sa.register()
    q, k, v, mask, grad = bert_call()
    mask = None if causal else mask
    out = sa.short_attention(q, k, v, mask, 0.0, None, causal)
    got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask, is_causal=causal).transpose(1, 2)
    refs = [ref, *torch.autograd.grad(ref, ref_in, grad.float())]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # what BERT ran before
        cudnn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal).transpose(1, 2)
    cudnn = [cudnn, *torch.autograd.grad(cudnn, (q, k, v), grad)]
    for a, c, r in zip(got, cudnn, refs):
        # within the BF16 parity bound, and no further from FP32 than SDPA's own BF16 kernels (plus a rounding)
        assert rel_err(a, r) < tolerance(torch.bfloat16)
        assert rel_err(a, r) < 1.5 * rel_err(c, r) + 2e-3


def test_dropout_keeps_one_minus_p_of_the_probabilities_and_draws_anew_each_call():
    assert sa.register()
    b, h, n, d = 32, 12, 128, 64
    q, k = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    eye = torch.eye(n, d, device="cuda", dtype=torch.bfloat16).expand(b, h, n, d)  # output = the kept probabilities
    first = sa.short_attention(q, k, eye, None, 0.1).transpose(1, 2)[..., :d] != 0
    second = sa.short_attention(q, k, eye, None, 0.1).transpose(1, 2)[..., :d] != 0
    assert abs(first.float().mean().item() - 0.9) < 0.002  # 3.1M draws: the rate within 10 standard errors
    assert (first != second).float().mean() > 0.1


def test_a_compiled_bert_runs_the_kernel_in_its_graphs_with_sdpas_losses():
    """BERT with the kernel, compiled by Inductor and replayed as CUDA graphs (no dropout): the losses of the same
    BERT on transformers' SDPA attention, within BF16 rounding, one graph, the kernel's names in the profile."""
    assert sa.register()
    config = transformers.BertConfig(num_hidden_layers=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).cuda().train()
    ids = torch.randint(0, config.vocab_size, (8, 128), device="cuda")
    padding = (
        torch.arange(128, device="cuda") < torch.tensor([128, 100, 64, 128, 9, 128, 128, 77], device="cuda")[:, None]
    ).long()
    labels = torch.randint(0, 2, (8,), device="cuda")

    def losses(compiled):
        out = []
        for _ in range(4):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(input_ids=ids, attention_mask=padding, labels=labels).loss
            loss.backward()
            out.append(loss.item())
            model.zero_grad()
        return out

    attention.use_static_masks(model)
    ref = losses(model)
    attention.use_static_masks(model, kernel=True)
    assert model.config._attn_implementation == attention.SHORT_KERNEL
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, mode="reduce-overhead")
    got = losses(compiled)
    assert (
        torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1 and not torch._dynamo.utils.counters["graph_break"]
    )
    assert got == pytest.approx(ref, rel=2e-2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        losses(compiled)
    names = {e.name for e in prof.events()}
    assert any("short_attention_forward" in n for n in names) and any("short_attention_backward" in n for n in names)
    torch._dynamo.reset()
