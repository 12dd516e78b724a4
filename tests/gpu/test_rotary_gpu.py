"""compile_rotary_once on CUDA: Triton's code for a compiled Llama step evaluates cos and sin in one kernel of the
forward and none of the backward (without it: in every layer's rotation kernels), with the same training maths
(BF16 autocast)."""

import pytest
import torch

from tests.test_rotary import LAYERS, TRANSCENDENTAL, compiled_step, kernel_calls_with
from tests.testing_utils import require_cuda

pytestmark = [pytest.mark.gpu, require_cuda]


def test_compiled_rope_on_cuda_computes_cos_and_sin_once():
    loss, grads, (forward, backward) = compiled_step(once=False, device="cuda")
    assert kernel_calls_with(forward, "cos") == LAYERS and TRANSCENDENTAL.search(backward)  # what it is for
    loss_once, grads_once, (forward, backward) = compiled_step(once=True, device="cuda")
    assert kernel_calls_with(forward, "cos") == 1 and "hf_apex.materialize" in forward
    assert not TRANSCENDENTAL.search(backward)
    torch.testing.assert_close(loss_once, loss, rtol=1e-3, atol=0)  # BF16 matmuls; cos/sin rounded to BF16 alike
    for g_once, g in zip(grads_once, grads):
        torch.testing.assert_close(g_once, g, rtol=2e-2, atol=1e-3)
