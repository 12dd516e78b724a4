"""A causal-LM loss that never holds FP32 logits: the LM head's matmul and cross-entropy, chunk by chunk.

A Hugging Face causal LM computes ``logits = lm_head(hidden)`` for every position, upcasts them to FP32 and takes
the cross-entropy (``ForCausalLMLoss``). For GPT-2 124M at 16 × 1024 tokens that is 16,384 × 50,257 logits: 1.6 GB
in BF16 and 3.3 GB in FP32, written and read several times, and their gradient as large again.
:class:`LinearCrossEntropy` takes the positions in chunks instead: for each chunk it computes the chunk's logits (in
the autocast dtype, as the LM head does), the FP32 log-sum-exp and loss, and at once the chunk's gradients with
respect to the hidden states and the head's weight, then drops the logits (at most 2 GiB of them at a time, in the
matmul's dtype, under the row kernel below). The backward only scales those gradients. The maths is the stock
loss's: the same shift of the labels, the same ignored index, the same mean (or sum divided by
``num_items_in_batch``, as the Trainer asks under gradient accumulation), the logits rounded to the autocast dtype
before the FP32 softmax. The head's weight is padded to a multiple of 64 rows for the matmuls (50,257 → 50,304:
shapes the tensor cores take whole) and the padded logits are masked out of the softmax, so the loss and the
gradients are those of the unpadded head.

Between a chunk's matmuls, on a CUDA GPU with Triton, one kernel of hf_apex's (:func:`_rows_kernel`) does the
softmax's work: it reads the chunk's BF16 logits once for the log-sum-exp (an online max and sum) and once more to
write the gradient in their place. Elsewhere (a CPU) torch's ops do it, fused by Inductor under torch.compile.

:mod:`hf_apex.kernels.models.loss` gives a model this loss.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..apex.availability import has_mm_out_dtype, has_triton_ops

PAD_MULTIPLE = 64  # rows of the head's weight in the matmuls: 50,257 -> 50,304
CHUNK_ELEMENTS = 2**27  # logits per chunk at most in torch's ops (FP32: 512 MiB): 1, 2, 4... chunks
# Bytes of logits per chunk under the row kernel, which holds a chunk's logits in the matmul's dtype only and writes
# their gradient in their place: 2 GiB, GPT-2's 16 x 1024 positions in one chunk in BF16, two in FP32 (fewer, larger
# matmuls; each chunk adds its part of the head's gradient into an FP32 buffer).
ROW_CHUNK_BYTES = 2**31
# The head's gradient written in FP32 by its matmul on CUDA (_matmul_fp32); False: a BF16 matmul and a cast.
FP32_HEAD_GRAD = True
_MM_OUT_DTYPE = has_mm_out_dtype()  # (read as a constant under torch.compile)


# The row kernel's columns per load and warps per row, the fastest timed on an H200 (benchmarks/scripts/row_kernel.py
# times them).
ROW_BLOCK, ROW_WARPS = 2048, 4


@functools.cache
def _rows_kernel():
    """The Triton kernel of one program per row of a chunk's logits: the FP32 log-sum-exp over the first ``vocab``
    columns (an online max and sum: one read), the row's loss, and then, with ``GRAD``, the gradient
    ``(softmax - one_hot(target)) * scale`` (``scale``: a one-element FP32 tensor, the loss's 1 / divisor; zero in
    the padding columns and in rows whose target is ``ignore_index``) written over the logits in their dtype (a
    second read and one write), rounded once, as the stock loss's FP32 gradient is rounded to the logits' dtype.
    The loads are masked at ``cols`` (a multiple of 64), the columns past ``vocab`` set to -inf in registers: a mask
    at ``vocab`` (50,257) would make them 2-byte loads, 0.396 ms against 0.349 for a chunk above.
    torch's ops, even fused by Inductor, hold FP32 logits or read them a third time."""
    import triton
    import triton.language as tl

    @triton.jit
    def softmax_xent_rows(
        logits, row_stride, targets, losses, scale, vocab, cols, ignore_index, GRAD: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = logits + tl.program_id(0).to(tl.int64) * row_stride
        target = tl.load(targets + tl.program_id(0))
        counted = target != ignore_index
        target = tl.where(counted, target, 0)
        offsets = tl.arange(0, BLOCK)
        top = float("-inf")
        total = 0.0
        for start in range(0, vocab, BLOCK):
            c = start + offsets
            x = tl.where(c < vocab, tl.load(row + c, mask=c < cols, other=0.0).to(tl.float32), float("-inf"))
            new_top = tl.maximum(top, tl.max(x, 0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), 0)
            top = new_top
        lse = top + tl.log(total)
        picked = tl.load(row + target).to(tl.float32)
        tl.store(losses + tl.program_id(0), tl.where(counted, lse - picked, 0.0))
        if GRAD:
            s = tl.where(counted, tl.load(scale), 0.0)  # d loss / d (this row's summed loss)
            for start in range(0, cols, BLOCK):
                c = start + offsets
                x = tl.where(c < vocab, tl.load(row + c, mask=c < cols, other=0.0).to(tl.float32), float("-inf"))
                g = (tl.exp(x - lse) - tl.where(c == target, 1.0, 0.0)) * s
                g = g.to(row.dtype.element_ty, fp_downcast_rounding="rtne")  # as torch rounds
                tl.store(row + c, g, mask=c < cols)

    return softmax_xent_rows


@functools.cache
def _rows_op():
    """``hf_apex::softmax_xent_rows_(logits, targets, scale, vocab, ignore_index, grad) -> losses``: the row kernel
    as a `torch.library.triton_op`, which Inductor compiles into the graph around it."""
    from torch.library import triton_op, wrap_triton

    @triton_op("hf_apex::softmax_xent_rows_", mutates_args={"logits"})
    def softmax_xent_rows_(
        logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, vocab: int, ignore_index: int, grad: bool
    ) -> torch.Tensor:
        assert logits.stride(1) == 1 and targets.is_contiguous(), "rows of contiguous columns, contiguous targets"
        losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        wrap_triton(_rows_kernel())[(logits.shape[0],)](
            logits,
            logits.stride(0),
            targets,
            losses,
            scale,
            vocab,
            logits.shape[1],
            ignore_index,
            GRAD=grad,
            BLOCK=ROW_BLOCK,
            num_warps=ROW_WARPS,
        )
        return losses

    return softmax_xent_rows_


_ROWS = None  # the row kernel's op, once registered (_register_row_kernel)


def _register_row_kernel() -> bool:
    """Register the row kernel's op where Triton can run it; whether it is registered. Not in compiled code: the
    fused model's setup does it (:func:`fuse_linear_cross_entropy`), and so does an eager call of the loss."""
    global _ROWS
    if _ROWS is None and has_triton_ops():
        _ROWS = _rows_op()
    return _ROWS is not None


def _row_op(hidden: torch.Tensor):
    """The row kernel's op for chunks of ``hidden``, or None where torch's ops take them (a CPU, no Triton). Under
    torch.compile it only reads whether the op is registered, so that Dynamo traces the loss, its backward
    included, in one piece."""
    if not hidden.is_cuda:
        return None
    if not torch.compiler.is_compiling():
        _register_row_kernel()
    return _ROWS


class LinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T, targets)`` chunk by chunk, with gradients computed in the forward.

    ``hidden`` is (positions, d), ``targets`` (positions,) with ``ignore_index`` where no loss is taken; the sum of
    the per-position losses is divided by ``divisor`` (the number of targets for a mean). ``amp`` is the autocast
    dtype of the matmuls (None: the inputs' own dtype); ``grad_hidden`` / ``grad_weight``: which gradients to
    compute (a training step; a frozen head needs none of its own).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, divisor, ignore_index, amp, grad_hidden: bool, grad_weight: bool):
        dtype = amp or hidden.dtype
        vocab = weight.shape[0]
        h = hidden.to(dtype)
        w = nn.functional.pad(weight.to(dtype), (0, 0, 0, -vocab % PAD_MULTIPLE))
        rows = _row_op(h)
        # A power-of-two number of chunks: under torch.compile, positions of any count within a bucket share a graph.
        budget = ROW_CHUNK_BYTES // h.element_size() if rows is not None else CHUNK_ELEMENTS
        chunks = 1
        while chunks * budget < h.shape[0] * w.shape[0]:
            chunks *= 2
        grads = grad_hidden or grad_weight
        # d loss / d (summed loss), as the stock loss's division gives it: the chunks' gradients come out scaled, and
        # rounded to the matmul's dtype after it, as the stock loss rounds them. Not in FP16, where the stock loss's
        # gradient is scaled by the GradScaler before it is rounded: there they are divided in FP32 after the matmuls.
        divisor = divisor.to(h.device, torch.float32) if torch.is_tensor(divisor) else float(divisor)
        scaled = dtype != torch.float16
        scale = torch.as_tensor(divisor if scaled else 1.0, dtype=torch.float32, device=h.device).reciprocal()
        grad_h, grad_w = [], None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        cols = torch.arange(w.shape[0], device=h.device) if torch.compiler.is_compiling() else None
        for hc, yc in zip(h.tensor_split(chunks), targets.tensor_split(chunks)):
            if rows is not None:  # one kernel reads the chunk's logits twice and leaves their gradient in their place
                g = hc @ w.T
                loss = rows(g, yc, scale, vocab, ignore_index, grads).sum()
            else:
                loss, g = _chunk_in_torch(hc, w, yc, scale, vocab, ignore_index, cols, grads)
            total += loss
            if grad_hidden:
                grad_h.append(g @ w)  # in the matmul's dtype, as the stock head's backward gives it
            if grad_weight:
                part = _matmul_fp32(g.T, hc)
                grad_w = part if grad_w is None else grad_w.add_(part)
        if grad_hidden:
            grad_h = grad_h[0] if chunks == 1 else torch.cat(grad_h)
            grad_h = grad_h if scaled else grad_h.float() / divisor
        if grad_weight:
            grad_w = grad_w[:vocab] if scaled else grad_w[:vocab] / divisor
        if grads:
            ctx.save_for_backward(grad_h if grad_hidden else None, grad_w if grad_weight else None)
            ctx.dtypes = hidden.dtype, weight.dtype
        return total / divisor

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        dh, dw = ctx.dtypes
        return (
            (grad_h.float() * grad_loss).to(dh) if grad_h is not None else None,
            (grad_w * grad_loss).to(dw) if grad_w is not None else None,
            *[None] * 6,
        )


def _matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in FP32. With BF16/FP16 operands on CUDA, cuBLAS writes its FP32 accumulator as it is
    (``torch.mm(..., out_dtype=torch.float32)``), where a half-precision matmul would round the result to BF16 and a
    cast would read it and write it again: the head's gradient is a single (vocabulary x d) matmul over all the
    chunk's positions, so this is one write of the FP32 gradient instead of three passes. Elsewhere (a CPU, an older
    torch) the half-precision matmul and a cast."""
    if FP32_HEAD_GRAD and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def _chunk_in_torch(hc, w, yc, scale, vocab, ignore_index, cols, grad):
    """One chunk's summed loss and, where ``grad``, its gradient (d summed loss / d logits, times ``scale``) in the
    matmul's dtype (else None), in torch ops: where the row kernel does not run (a CPU, no Triton). ``cols``: the
    columns' indices under torch.compile."""
    logits = (hc @ w.T).float()  # rounded to the matmul's dtype first, as the stock head's output is
    # the padding rows take no part in the softmax
    if cols is not None:
        logits = logits.masked_fill(cols >= vocab, float("-inf"))
    else:
        logits[:, vocab:] = float("-inf")
    lse = torch.logsumexp(logits, dim=-1)
    valid = yc != ignore_index
    target = yc.where(valid, 0)
    picked = logits.gather(1, target[:, None]).squeeze(1)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    if not grad:
        return loss, None
    # d summed loss / d logits = softmax - one_hot(target), where a target counts
    if cols is not None:  # compiled: one pointwise expression, which Inductor fuses into the softmax's kernel
        onehot = (cols == target[:, None]).to(torch.float32)
        return loss, (((logits - lse[:, None]).exp() - onehot) * torch.where(valid, scale, 0.0)[:, None]).to(hc.dtype)
    probs = logits.sub_(lse[:, None]).exp_()  # eager: in place, no second chunk-sized buffer
    probs[torch.arange(yc.shape[0], device=yc.device), target] -= valid.to(probs.dtype)
    return loss, probs.mul_(torch.where(valid, scale, 0.0)[:, None]).to(hc.dtype)


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on ``hidden @ weight.T`` without the logits: position t predicts label
    t + 1, ``ignore_index`` labels count for nothing, the mean over the counted positions (or their sum divided by
    ``num_items_in_batch``). Under autocast the matmuls run in its dtype and the softmax in FP32."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    divisor = (targets != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
    amp = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else None
    grads = torch.is_grad_enabled()
    with torch.autocast(hidden.device.type, enabled=False):
        flat = hidden.reshape(-1, hidden.shape[-1])
        return LinearCrossEntropy.apply(
            flat,
            weight,
            targets,
            divisor,
            ignore_index,
            amp,
            grads and hidden.requires_grad,
            grads and weight.requires_grad,
        )
