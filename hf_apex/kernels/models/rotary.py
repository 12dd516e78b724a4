"""Rotary position embeddings computed once per forward under ``torch.compile``.

A transformers RoPE model (Llama, Mistral, Qwen, OLMo...) computes the cos and sin of its positions once per forward
(``model.model.rotary_emb``), and every attention layer rotates its queries and keys with them. Inductor does not
keep them: they come from two small inputs (the positions and ``inv_freq``), so it inlines their computation into
each layer's rotation kernels, and every element of the queries and keys evaluates a cos and a sin again, in the
forward and in the backward: several times the cost of reading and writing the queries and keys once.

:func:`compute_rotary_once` swaps the rotary embedding's class, on that instance only, for a subclass whose
compiled forward hands cos and sin through ``hf_apex::materialize``, a copy the compiler cannot see into: they are
computed once into a buffer, which the layers read and the backward keeps. The values are the same; the compiled
backward had recomputed them with its own vectorised routine, which on a CPU differed from the forward's in the
last bit of FP32. Eager forwards are the stock ones. ``print(model)`` shows the swap.
"""

from __future__ import annotations

import torch
from torch import nn

from ..swap import Swap, restore, swap


@torch.library.custom_op("hf_apex::materialize", mutates_args=())
def materialize(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x``: to a compiler, a buffer it must compute before and cannot recompute inside its readers."""
    return x.clone()


@materialize.register_fake
def _(x):
    return torch.empty_like(x)


materialize.register_autograd(lambda ctx, grad: grad)


class _RotaryOnce(Swap):
    """The forward of a rotary embedding whose outputs are materialised under torch.compile (mixed in first)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if not torch.compiler.is_compiling() or not isinstance(out, tuple):
            return out
        return tuple(materialize(t) if isinstance(t, torch.Tensor) else t for t in out)

    def extra_repr(self) -> str:
        stock = super().extra_repr()
        return (stock + ", " if stock else "") + "cos/sin computed once per compiled forward (hf_apex)"


def is_rotary_embedding(module: nn.Module) -> bool:
    """A transformers rotary embedding: a module named ``...RotaryEmbedding`` holding ``inv_freq``."""
    return type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq")


def compute_rotary_once(model: nn.Module) -> int:
    """Swap every rotary embedding of ``model`` (see the module's docstring); idempotent. Returns how many."""
    count = 0
    for module in model.modules():
        if is_rotary_embedding(module):
            swap(module, _RotaryOnce)
            count += 1
    return count


def restore_rotary(model: nn.Module) -> None:
    """Give every swapped rotary embedding of ``model`` its stock class back."""
    for module in model.modules():
        restore(module, _RotaryOnce)
