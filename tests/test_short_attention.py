"""hf_apex's short-sequence attention kernel (hf_apex.kernels.short_attention), run on CPU tensors by Triton's
interpreter (tests/conftest.py chooses it on a machine without a GPU; tests/gpu/test_short_attention_gpu.py runs the
kernel on one)."""

import json
import math
import os

import pytest
import torch

from hf_apex import ApexTrainer
from hf_apex.kernels import attention
from hf_apex.kernels import short_attention as sa
from hf_apex.measure.report import METRICS_FILENAME
from tests.test_trainer import train_args
from tests.testing_utils import TokenDataset, tiny_inputs, tiny_model


@pytest.fixture
def kernel(monkeypatch):
    """The kernel's ops, registered as a GPU machine registers them, run by Triton's interpreter."""
    pytest.importorskip("triton", reason="Triton is not installed: the kernel's maths is checked in its interpreter")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off (a GPU machine): tests/gpu/test_short_attention_gpu.py runs it")

    def register():
        sa._OP = sa._ops()
        return True

    monkeypatch.setattr(sa, "_OP", None)
    monkeypatch.setattr(sa, "register", register)
    yield


def reference(q, k, v, mask=None, causal=False, kept=None, p=0.0):
    """Attention in float64 from its definition, (batch, tokens, heads, dim); ``kept``: dropout's kept positions.
    A row with every key masked out gives zeros, as the kernel documents."""
    q, k, v = (t.double() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    valid = torch.ones(n, n, dtype=torch.bool)
    if causal:
        valid = valid.tril()
    if mask is not None and mask.dtype == torch.bool:
        valid = valid & mask
    elif mask is not None:
        s = s + mask.double()
    probs = torch.softmax(s.masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0)
    if kept is not None:
        probs = probs * kept / (1 - p)
    return (probs @ v).transpose(1, 2)


def heads(b, h, n, d, seed=0):
    """Queries, keys and values as a model hands them over: views of (batch, tokens, heads x dim) projections."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, 3, h, d, generator=g)
    return [x[:, :, i].transpose(1, 2).requires_grad_() for i in range(3)]


def output_and_grads(fn, q, k, v, grad):
    out = fn(q, k, v)
    return [out, *torch.autograd.grad(out, (q, k, v), grad)]


@pytest.mark.parametrize(
    "shape, mask, causal, rows",
    [
        ((2, 3, 20, 16), None, False, None),  # 20 tokens in a block of 32
        ((2, 3, 20, 16), "bool", False, None),  # one row with every key masked out
        ((1, 2, 33, 32), "float", False, None),  # a padding mask built as transformers builds it, broadcast over rows
        ((2, 2, 17, 16), None, True, None),
        ((2, 2, 128, 64), "float", False, None),  # BERT-base's 128 tokens
        ((2, 2, 128, 64), "bool", True, 32),  # four blocks of query rows a program (the backward adds theirs up)
    ],
)
def test_the_kernel_computes_attention_and_its_gradients(kernel, monkeypatch, shape, mask, causal, rows):
    if rows is not None:
        monkeypatch.setattr(sa, "FORWARD_ROWS", rows)
        monkeypatch.setattr(sa, "BACKWARD_ROWS", rows)
    b, h, n, d = shape
    q, k, v = heads(*shape)
    g = torch.Generator().manual_seed(1)
    if mask == "bool":
        mask = torch.rand(b, 1, n, n, generator=g) > 0.3
        mask[0, 0, 3, :] = False
    elif mask == "float":
        keys = torch.rand(b, 1, 1, n, generator=g) > 0.3
        mask = torch.where(keys, 0.0, torch.finfo(torch.float32).min).expand(b, 1, n, n)
    grad = torch.randn(b, n, h, d, generator=g)
    got = output_and_grads(lambda *t: sa.short_attention(*t, mask, 0.0, None, causal), q, k, v, grad)
    ref = output_and_grads(lambda *t: reference(*t, mask, causal), q, k, v, grad.double())
    for a, r in zip(got, ref):
        torch.testing.assert_close(a.double(), r.double(), rtol=1e-5, atol=1e-5)
    # the gradients in their inputs' order (heads inside tokens): the views' backward copies nothing
    assert all(t.transpose(1, 2).is_contiguous() for t in got[1:])


def test_dropout_keeps_what_the_backward_sees_and_draws_anew_on_every_call(kernel):
    """A call's kept positions, read off an output whose values are the identity, are those its gradients and
    output obey; the next call keeps others."""
    b, h, n, d, p = 2, 2, 16, 16, 0.3
    q, k, v = heads(b, h, n, d)
    eye = torch.eye(n).expand(b, h, n, d)
    torch.manual_seed(5)
    kept = sa.short_attention(q.detach(), k.detach(), eye, None, p).transpose(1, 2) != 0
    assert 0.6 < kept.float().mean() < 0.8
    assert (kept[:, 0] != kept[:, 1]).float().mean() > 0.2 and (kept[0] != kept[1]).float().mean() > 0.2  # own draws
    grad = torch.randn(b, n, h, d)
    torch.manual_seed(5)  # the same seed: the same draws
    got = output_and_grads(lambda *t: sa.short_attention(*t, None, p), q, k, v, grad)
    ref = output_and_grads(lambda *t: reference(*t, kept=kept, p=p), q, k, v, grad.double())
    for a, r in zip(got, ref):
        torch.testing.assert_close(a.double(), r.double(), rtol=1e-5, atol=1e-5)
    again = sa.short_attention(q.detach(), k.detach(), eye, None, p).transpose(1, 2) != 0
    assert (again != kept).float().mean() > 0.2


def test_calls_the_kernel_cannot_take_are_named():
    q, k, v = heads(1, 2, 16, 16)
    assert sa.unfit(q, k, v) is None
    assert sa.unfit(q, k, v, torch.ones(1, 1, 16, 16, dtype=torch.bool)) is None
    assert "grouped" in sa.unfit(q, k[:, :1], v[:, :1])
    assert "129 tokens" in sa.unfit(*heads(1, 2, 129, 16))
    assert "head dim 24" in sa.unfit(*heads(1, 2, 16, 24))
    assert "broadcast" in sa.unfit(q, k, v, torch.ones(1, 3, 16, 16))
    assert "contiguous" in sa.unfit(q.transpose(2, 3), k.transpose(2, 3), v.transpose(2, 3))


def test_a_model_runs_the_kernel_as_hf_apex_short_with_its_own_results(kernel):
    """A BERT switched to the kernel gives the outputs and gradients of transformers' SDPA attention (eval mode:
    no dropout), and goes back to `sdpa` when asked."""
    batch = tiny_inputs("bert", batch=3, seq=20)
    batch["attention_mask"][1, 14:] = 0  # padding: a mask the kernel reads

    def loss_and_grads(model):
        model.zero_grad()
        loss = model(**batch, labels=torch.tensor([0, 1, 1])).loss
        loss.backward()
        return [loss, *(p.grad for p in model.parameters() if p.grad is not None)]

    model = tiny_model("bert")
    ref = loss_and_grads(model)
    assert attention.use_static_masks(model, kernel=True)
    assert model.config._attn_implementation == attention.SHORT_KERNEL
    for a, b in zip(loss_and_grads(model), ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    attention.use_static_masks(model, on=False)
    assert model.config._attn_implementation == "sdpa"


def test_dynamo_traces_the_kernel_into_the_graph_without_a_break(kernel):
    model = tiny_model("bert")
    attention.use_static_masks(model, kernel=True)
    batch = tiny_inputs("bert", batch=2, seq=16)
    ref = model(**batch).logits
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    got = torch.compile(model, backend=backend, fullgraph=True)(**batch).logits
    torch._dynamo.reset()
    assert any("short_attention" in op for op in ops) and not any("scaled_dot_product" in op for op in ops)
    torch.testing.assert_close(got, ref)


def test_the_trainer_trains_with_the_kernel_when_named(tmp_path, kernel):
    """`attention_backend="short"`: the steps run the kernel (the model is `hf_apex_short` meanwhile) with the losses
    of SDPA's attention (no dropout), and the model leaves train() on `sdpa`."""
    data = TokenDataset(n=32, seq=16, task="cls")
    seen = []

    def run(name, **kw):
        args = train_args(tmp_path / name, max_steps=3, **kw)
        model = tiny_model("bert", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).train()
        model.register_forward_pre_hook(lambda m, _: seen.append(m.config._attn_implementation))
        trainer = ApexTrainer(model=model, args=args, train_dataset=data)
        trainer.train()
        metrics = json.loads((tmp_path / name / METRICS_FILENAME).read_text())
        return trainer, [h["loss"] for h in metrics["loss_history"]], metrics

    _, losses, _ = run("default")
    assert attention.SHORT_KERNEL not in seen
    trainer, short, metrics = run("short", attention_backend="short")
    assert attention.SHORT_KERNEL in seen
    assert metrics["kernels"]["attention_backend"].startswith("short: hf_apex's Triton kernel")
    assert short == pytest.approx(losses, rel=1e-4)
    assert trainer.model.config._attn_implementation == "sdpa"  # (after train())
