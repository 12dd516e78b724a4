"""Attention over short sequences (at most 128 tokens) in one Triton program per head: hf_apex's own kernel.

SDPA's fused kernels are built for long sequences: they stream keys past a tile of queries. At BERT-base's 128
tokens a head's queries, keys and values are 48 KiB, and on an H200 cuDNN's kernels spent 282 µs per layer of
BERT-base 128 x 128 (benchmarks/h200-2026-12-03-random) on a forward and backward that move ~300 MB by our count:
about a fifth of what the GPU's memory could carry. Here one program holds a whole head: the forward computes the
scores, the mask, the softmax, dropout and the product with the values, and writes the output in (batch, tokens,
heads, dim) order, the order transformers hands on to the output projection; the backward recomputes the softmax and
the dropout mask (no probabilities or mask are saved, only the seed) and writes the three gradients in their inputs'
layouts.

It has not paid yet: on an H200 its forward and backward of BERT-base's call took 0.79 ms against cuDNN's 0.60, and
BERT's compiled step with its first version (a Philox draw per probability, 64 rows a program) 81 ms against 26, for
reasons not yet found (benchmarks/h200-2026-12-03-short). So it runs only where ``attention_backend="short"`` names
it.

The maths is SDPA's: ``softmax(q @ k.T * scale + mask)`` in FP32 from the inputs' dtype, dropout with
probability ``p`` and scaling by ``1 / (1 - p)``, the probabilities rounded to the inputs' dtype before the
product with the values (as FlashAttention does). A boolean mask keeps the True positions; a floating mask is
added to the scores. A query row whose keys a boolean (or -inf) mask all masks out gives zeros; a floating mask
of finite minima gives what SDPA gives, a uniform row. Each call draws its own dropout masks, as every SDPA backend
draws its own.

:func:`attention_forward` is the transformers attention function that calls it (hf_apex's
``hf_apex_short`` attention, :func:`hf_apex.kernels.attention.use_static_masks`); calls it cannot take go to
transformers' SDPA attention unchanged.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from .availability import has_triton_ops

MAX_TOKENS = 128  # keys per program: the scores of a head stay in registers
# Query rows per program and warps, forward and backward (the backward's program takes every row of its head, this
# many at a time): on an H200 128 rows and 8 warps each way took 0.79 ms for BERT-base's call, 64 rows 0.89-1.01 ms
# (benchmarks/h200-2026-12-03-short).
FORWARD_ROWS, FORWARD_WARPS = 128, 8
BACKWARD_ROWS, BACKWARD_WARPS = 128, 8
NAME = "short"  # the ``attention_backend`` that runs it


@functools.cache
def _kernels():
    """The forward and backward kernels, wrapped for launching inside a `torch.library.triton_op`."""
    from torch.library import wrap_triton

    from . import short_attention_kernels as k

    return wrap_triton(k.short_attention_forward), wrap_triton(k.short_attention_backward)


def _drop_below(p: float) -> int:
    """Dropout's threshold on a draw's top 24 bits: a key is dropped with probability p."""
    return round(p * 2**24)


def _blocks(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())  # keys per program, a power of two (tl.dot takes 16 and up)


def _mask_args(mask: torch.Tensor | None, query: torch.Tensor):
    """The mask as the kernels read it: a tensor (a dummy without one) and its (batch, head, row) strides, 0 where
    it broadcasts."""
    if mask is None:
        return query, (0, 0, 0), False, False
    b, h, n = query.shape[0], query.shape[1], query.shape[2]
    full = mask.expand(b, h, n, n)
    assert full.stride(3) == 1, "mask keys must be contiguous"
    return full, full.stride()[:3], True, mask.dtype == torch.bool


def _forward_impl(query, key, value, mask, seed, scale, dropout_p, causal):
    b, h, n, d = query.shape
    out = torch.empty(b, n, h, d, dtype=query.dtype, device=query.device)  # heads inside tokens, transformers' order
    m, mstrides, has_mask, mask_bool = _mask_args(mask, query)
    block_n = _blocks(n)
    block_m = min(block_n, FORWARD_ROWS)
    forward, _ = _kernels()
    forward[(-(-n // block_m), b * h)](
        query, key, value, m, out, seed if seed is not None else query, scale, dropout_p, _drop_below(dropout_p), h, n,
        *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *mstrides,
        out.stride(0), out.stride(2), out.stride(1),
        HAS_MASK=has_mask, MASK_BOOL=mask_bool, CAUSAL=causal, DROPOUT=seed is not None,
        IEEE=query.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, D=d, num_warps=FORWARD_WARPS,
    )  # fmt: skip
    return out


def _backward_impl(grad_out, query, key, value, mask, seed, scale, dropout_p, causal):
    b, h, n, d = query.shape
    if grad_out.stride(-1) != 1:  # (the kernel reads each row of the head dim in one piece)
        grad_out = grad_out.contiguous()
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    m, mstrides, has_mask, mask_bool = _mask_args(mask, query)
    block_n = _blocks(n)
    _, backward = _kernels()
    backward[(1, b * h)](
        query, key, value, m, grad_out, dq, dk, dv, seed if seed is not None else query, scale, dropout_p,
        _drop_below(dropout_p), h, n,
        *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *mstrides,
        grad_out.stride(0), grad_out.stride(2), grad_out.stride(1),
        *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        HAS_MASK=has_mask, MASK_BOOL=mask_bool, CAUSAL=causal, DROPOUT=seed is not None,
        IEEE=query.dtype == torch.float32, BLOCK_M=min(block_n, BACKWARD_ROWS), BLOCK_N=block_n, D=d,
        num_warps=BACKWARD_WARPS,
    )  # fmt: skip
    return dq, dk, dv


@functools.cache
def _ops():
    """The forward as ``hf_apex::short_attention`` (a `torch.library.triton_op`, compiled into Inductor's graphs),
    its backward as ``hf_apex::short_attention_backward``, and the autograd formula between them."""
    from torch.library import triton_op

    @triton_op("hf_apex::short_attention", mutates_args=())
    def short_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        seed: torch.Tensor | None,
        scale: float,
        dropout_p: float,
        causal: bool,
    ) -> torch.Tensor:
        return _forward_impl(query, key, value, mask, seed, scale, dropout_p, causal)

    @triton_op("hf_apex::short_attention_backward", mutates_args=())
    def short_attention_backward(
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        seed: torch.Tensor | None,
        scale: float,
        dropout_p: float,
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward_impl(grad_out, query, key, value, mask, seed, scale, dropout_p, causal)

    @short_attention.register_fake
    def _(query, key, value, mask, seed, scale, dropout_p, causal):
        b, h, n, d = query.shape
        return query.new_empty(b, n, h, d)

    @short_attention_backward.register_fake
    def _(grad_out, query, key, value, mask, seed, scale, dropout_p, causal):
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)

    def setup_context(ctx, inputs, output):
        query, key, value, mask, seed, scale, dropout_p, causal = inputs
        ctx.save_for_backward(query, key, value, mask, seed)
        ctx.settings = scale, dropout_p, causal

    def backward(ctx, grad_out):
        query, key, value, mask, seed = ctx.saved_tensors
        dq, dk, dv = short_attention_backward(grad_out, query, key, value, mask, seed, *ctx.settings)
        return dq, dk, dv, None, None, None, None, None

    short_attention.register_autograd(backward, setup_context=setup_context)
    return short_attention


_OP = None  # the forward's op, once registered (register); compiled code only reads it


def register() -> bool:
    """Register the ops where Triton can run them; whether they are registered. Call it outside compiled code (the
    trainer does, before a run's first step)."""
    global _OP
    if _OP is None and has_triton_ops():
        _OP = _ops()
    return _OP is not None


def runs_on(tensor: torch.Tensor) -> bool:
    """Whether the kernels can take this tensor: a CUDA one, or any under Triton's CPU interpreter (tests)."""
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def unfit(query, key, value, mask=None, enable_gqa: bool = False) -> str | None:
    """Why the kernel cannot take this call (None: it can)."""
    if query.dim() != 4 or key.shape != query.shape or value.shape != query.shape or enable_gqa:
        return "queries, keys and values of one (batch, heads, tokens, dim) shape only (no grouped heads)"
    b, h, n, d = query.shape
    if n > MAX_TOKENS:
        return f"{n} tokens: the kernel holds at most {MAX_TOKENS} keys"
    if d not in (16, 32, 64, 128):
        return f"head dim {d}: 16, 32, 64 or 128 only"
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in (torch.bfloat16, torch.float16):
        if not (query.dtype == key.dtype == value.dtype == torch.float32 and not query.is_cuda):
            return f"{query.dtype}: BF16 or FP16 inputs only"
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return "the head dim must be contiguous"
    if mask is not None:
        if mask.dim() > 4 or any(s not in (1, t) for s, t in zip(mask.shape[::-1], (n, n, h, b))):
            return f"a mask of shape {tuple(mask.shape)} does not broadcast to {(b, h, n, n)}"
        if mask.shape[-1] > 1 and mask.stride(-1) != 1:
            return "the mask's keys must be contiguous"
    if b * h * n * n >= 2**31:
        return "more than 2**31 scores: the dropout's counters would wrap"
    if b * h > 65535:
        return f"{b} x {h} heads: more programs than a CUDA grid's second axis takes (65,535)"
    return None


def short_attention(query, key, value, mask=None, dropout_p: float = 0.0, scale=None, is_causal: bool = False):
    """``scaled_dot_product_attention(query, key, value, mask, dropout_p, is_causal, scale)`` by hf_apex's kernel,
    returned as (batch, tokens, heads, dim): the call must fit (:func:`unfit`) and :func:`register` have run."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if mask is not None and mask.dim() < 4:
        mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if mask is not None and mask.shape[-1] == 1:  # (a mask broadcast over the keys: the kernel reads it densely)
        mask = mask.expand(*mask.shape[:-1], query.shape[2]).contiguous()
    if mask is not None and mask.is_floating_point() and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)  # (SDPA takes a floating mask in the queries' dtype too)
    seed = None
    if dropout_p > 0.0:
        seed = torch.randint(0, 2**31 - 1, (1,), device=query.device, dtype=torch.int64)
    op = _OP if _OP is not None else _ops()  # (_ops: a CPU test through Triton's interpreter)
    return op(query, key, value, mask, seed, float(scale), float(dropout_p), bool(is_causal))


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' attention function for ``hf_apex_short``: this module's kernel where the call fits and the
    kernel is registered, transformers' SDPA attention otherwise (with its own handling of grouped heads, position
    biases and the rest)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if _OP is None or grouped or not plain or not runs_on(query) or unfit(query, key, value, attention_mask):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # transformers' rule for SDPA's is_causal: the module's (or the call's) causality, for a square without a mask
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    return short_attention(query, key, value, attention_mask, dropout, scaling, is_causal), None
