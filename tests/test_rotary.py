import io
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from hf_apex.kernels.models.rotary import compute_rotary_once, restore_rotary
from tests.testing_utils import tiny_model

LAYERS = 4


def compiled_step(once: bool, device: str = "cpu"):
    """One compiled forward + backward of a tiny Llama through Inductor (its CPU code, or Triton's on CUDA under BF16
    autocast): the loss, the gradients, and the code of the forward and backward graphs."""
    model = tiny_model("llama", num_hidden_layers=LAYERS).to(device).train()
    if once:
        assert compute_rotary_once(model) == 1
    ids = torch.randint(3, 100, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(model)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    (loss, grads), code = run_and_get_code(step)
    torch._dynamo.reset()
    assert len(code) == 2  # the forward's graph and the backward's
    return loss, grads, code


def kernel_calls_with(code: str, op: str) -> int:
    """How many kernel calls in a graph's code run a kernel whose fused ops include ``op`` (Inductor names its
    kernels after them, e.g. cpp_fused_..._cos_mul_neg_sin_... on a CPU, triton_poi_fused_..._cos_... launched with
    ``.run(`` on CUDA)."""
    return len(re.findall(rf"^\s*\w*fused\w*_{op}_\w*(\.run)?\(", code, re.M))


TRANSCENDENTAL = re.compile(r"\b(std::|libdevice\.|tl_math\.|tl\.)?(cos|sin)\(|\.(cos|sin)\(\)")


def test_compiled_rope_computes_cos_and_sin_once_not_in_every_layer():
    """Inductor inlines the rotary embedding's cos and sin into every layer's rotation kernels, forward and backward;
    with compute_rotary_once they are computed by one kernel of the forward and the backward reads them."""
    loss, grads, (forward, backward) = compiled_step(once=False)
    assert kernel_calls_with(forward, "cos") == LAYERS  # (what the switch is for: one per layer)
    assert "sin()" in backward or "sin(" in backward

    loss_once, grads_once, (forward, backward) = compiled_step(once=True)
    assert kernel_calls_with(forward, "cos") == 1
    assert "hf_apex.materialize" in forward
    assert not TRANSCENDENTAL.search(backward)
    # The same values: the stock compiled backward recomputed cos and sin with another (vectorised) routine than
    # the forward, which differs in FP32's last bits
    assert torch.equal(loss_once, loss)
    for g_once, g in zip(grads_once, grads):
        torch.testing.assert_close(g_once, g, rtol=1e-5, atol=1e-7)


def test_rotary_swap_shows_in_print_and_round_trips():
    model = tiny_model("llama")
    stock = type(model.model.rotary_emb)
    ids = torch.randint(3, 100, (1, 8))
    before = model(input_ids=ids).logits
    assert compute_rotary_once(model) == 1 and compute_rotary_once(model) == 1  # idempotent
    rotary = model.model.rotary_emb
    assert isinstance(rotary, stock) and type(rotary).__name__ == stock.__name__
    assert "cos/sin computed once per compiled forward (hf_apex)" in repr(model)
    assert torch.equal(model(input_ids=ids).logits, before)  # eager: the stock forward
    buffer = io.BytesIO()
    torch.save(rotary, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is type(rotary) and torch.equal(loaded.inv_freq, rotary.inv_freq)
    restore_rotary(model)
    assert type(model.model.rotary_emb) is stock and "hf_apex" not in repr(model)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_models_without_rope_are_left_alone(family):
    model = tiny_model(family)
    assert compute_rotary_once(model) == 0
    assert "hf_apex" not in repr(model)
