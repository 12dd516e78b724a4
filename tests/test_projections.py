"""The recipe's fuse_projections: the linears that read one input run as one matmul under torch.compile, with the stock
loss and gradients (hf_apex.kernels.passes.projections). The pass runs here on the graphs Dynamo hands a backend, which
then runs them as they are; tests/test_trainer.py runs it inside Inductor, through ApexTrainer."""

import pytest
import torch
from torch import nn

from hf_apex.kernels.passes.projections import LINEAR, fuse_shared_input_linears
from tests.testing_utils import tiny_inputs, tiny_model


def linears(gm) -> int:
    return sum(n.op == "call_function" and n.target in LINEAR for n in gm.graph.nodes)


def run(model, inputs, fuse: bool):
    """Loss, gradients and (linears before, after) per graph of one compiled forward and backward of ``model``."""
    counts = []

    def backend(gm, example_inputs):
        before = linears(gm)
        if fuse:
            fuse_shared_input_linears(gm.graph)
            gm.recompile()
        counts.append((before, linears(gm)))
        return gm

    torch._dynamo.reset()
    loss = torch.compile(model, backend=backend)(**inputs).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    torch._dynamo.reset()
    return loss.detach(), grads, counts


@pytest.mark.parametrize(
    "family, fused",
    [
        ("bert", [(14, 10)]),  # per layer query, key, value -> one (and output, intermediate, output; pooler; head)
        ("llama", [(15, 9)]),  # per layer q, k, v -> one and gate, up -> one (and o, down; the LM head)
        ("gpt2", [(1, 1)]),  # its attention's projections are one Conv1D already; nothing shares an input
    ],
)
def test_linears_on_one_input_become_one_with_the_stock_loss_and_gradients(family, fused):
    inputs = tiny_inputs(family)
    inputs["labels"] = torch.tensor([0, 1]) if family == "bert" else inputs["input_ids"]
    ref_loss, ref_grads, counts = run(tiny_model(family).train(), inputs, fuse=False)
    loss, grads, fused_counts = run(tiny_model(family).train(), inputs, fuse=True)
    assert [c for c in fused_counts if c[0]] == fused
    assert [c[0] for c in counts if c[0]] == [f[0] for f in fused]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():  # (BERT's key bias has a gradient of 0 but for roundings, ~1e-13: atol)
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-8, msg=name)


def test_a_frozen_weight_beside_trained_ones_keeps_its_group_apart():
    """A frozen weight (a LoRA adapter's base layer, say) among trained ones: fusing would compute its gradient."""
    model = tiny_model("bert").train()
    for layer in model.bert.encoder.layer:
        layer.attention.self.key.weight.requires_grad_(False)
    inputs = {**tiny_inputs("bert"), "labels": torch.tensor([0, 1])}
    _, grads, counts = run(model, inputs, fuse=True)
    assert counts == [(14, 14)]
    assert not any(".key.weight" in name for name in grads)


class Projections(nn.Module):
    """Two linears on one input, whose outputs go on as ``use`` says."""

    def __init__(self, use):
        super().__init__()
        self.a, self.b, self.use = nn.Linear(8, 8), nn.Linear(8, 4), use

    def forward(self, x):
        return self.use(self.a(x), self.b(x))


@pytest.mark.parametrize(
    "use, fusable",
    [
        (lambda a, b: a.view(2, 3, 2, 4).sum() + b.sum(), True),  # splitting the last dimension: fine
        (lambda a, b: a.view(-1).sum() + b.sum(), False),  # merging it: a slice of the fused output cannot
        (lambda a, b: a.mul_(2).sum() + b.sum(), False),  # changed in place
    ],
)
def test_a_group_whose_outputs_a_split_cannot_stand_for_is_left_alone(use, fusable):
    model = Projections(use)
    x = torch.randn(2, 3, 8)
    counts = []

    def backend(gm, example_inputs):
        fuse_shared_input_linears(gm.graph)
        gm.recompile()
        counts.append(linears(gm))
        return gm

    torch._dynamo.reset()
    got = torch.compile(model, backend=backend)(x)
    torch._dynamo.reset()
    assert counts == [1 if fusable else 2]
    torch.testing.assert_close(got, model(x))
