"""The Triton kernels of :mod:`hf_apex.kernels.short_attention` (imported only where Triton is installed)."""

import triton
import triton.language as tl


@triton.jit
def scores(
    q, k, mask_ptr, rows, cols, n, seed, scale, drop_below,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The probabilities of rows ``rows`` against keys ``cols`` (FP32) and, with dropout, which are kept."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    valid = (cols[None, :] < n) & (rows[:, None] < n)
    if CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None])
    if HAS_MASK:
        m = tl.load(mask_ptr, mask=valid, other=0)
        if MASK_BOOL:
            valid = valid & (m != 0)
        else:
            s = s + m.to(tl.float32)
    s = tl.where(valid, s, float("-inf"))
    top = tl.max(s, 1)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row with every key masked out: zeros, not NaN
    p = tl.exp(s - top[:, None])
    total = tl.sum(p, 1)
    p = p / tl.where(total == 0.0, 1.0, total)[:, None]
    keep = valid
    if DROPOUT:
        # Philox gives four 32-bit draws per counter: one counter per (head, row, four keys), the backward's the same.
        # A key is kept where its draw's top 24 bits reach drop_below = p * 2**24.
        quarter = tl.arange(0, BLOCK_N // 4)
        r0, r1, r2, r3 = tl.randint4x(seed, (tl.program_id(1) * n + rows[:, None]) * (BLOCK_N // 4) + quarter[None, :])
        draws = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (BLOCK_M, BLOCK_N))
        keep = (draws.to(tl.uint32, bitcast=True) >> 8).to(tl.int32) >= drop_below
    return p, keep


@triton.jit
def short_attention_forward(
    Q, K, V, MASK, OUT, SEED, scale, p_drop, drop_below, heads, n,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, smb, smh, sms, sob, soh, sos,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    b, h = tl.program_id(1) // heads, tl.program_id(1) % heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=rows[:, None] < n, other=0.0)
    k = tl.load(K + b * skb + h * skh + cols[:, None] * sks + dims[None, :], mask=cols[:, None] < n, other=0.0)
    v = tl.load(V + b * svb + h * svh + cols[:, None] * svs + dims[None, :], mask=cols[:, None] < n, other=0.0)
    mask_ptr = MASK + b * smb + h * smh + rows[:, None] * sms + cols[None, :]
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    p, keep = scores(
        q, k, mask_ptr, rows, cols, n, seed, scale, drop_below,
        HAS_MASK, MASK_BOOL, CAUSAL, DROPOUT, IEEE, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    if DROPOUT:
        p = tl.where(keep, p / (1.0 - p_drop), 0.0)
    if IEEE:
        o = tl.dot(p, v, input_precision="ieee")
    else:
        o = tl.dot(p.to(v.dtype), v)
    out = OUT + b * sob + h * soh + rows[:, None] * sos + dims[None, :]
    tl.store(out, o.to(OUT.dtype.element_ty), mask=rows[:, None] < n)


@triton.jit
def short_attention_backward(
    Q, K, V, MASK, DO, DQ, DK, DV, SEED, scale, p_drop, drop_below, heads, n,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, smb, smh, sms, sdob, sdoh, sdos,
    sdqb, sdqh, sdqs, sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    b, h = tl.program_id(1) // heads, tl.program_id(1) % heads
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    k = tl.load(K + b * skb + h * skh + cols[:, None] * sks + dims[None, :], mask=cols[:, None] < n, other=0.0)
    v = tl.load(V + b * svb + h * svh + cols[:, None] * svs + dims[None, :], mask=cols[:, None] < n, other=0.0)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    dk = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    for start in range(0, n, BLOCK_M):  # the queries in blocks; the keys' gradients add up across them
        rows = start + tl.arange(0, BLOCK_M)
        inside = rows[:, None] < n
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=inside, other=0.0)
        do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdos + dims[None, :], mask=inside, other=0.0)
        mask_ptr = MASK + b * smb + h * smh + rows[:, None] * sms + cols[None, :]
        p, keep = scores(
            q, k, mask_ptr, rows, cols, n, seed, scale, drop_below,
            HAS_MASK, MASK_BOOL, CAUSAL, DROPOUT, IEEE, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        if IEEE:
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            dp = tl.dot(do, tl.trans(v))
        if DROPOUT:
            kept = tl.where(keep, p / (1.0 - p_drop), 0.0)
            dp = tl.where(keep, dp / (1.0 - p_drop), 0.0)
        else:
            kept = p
        # d softmax: p * (dp - sum(p * dp)) per row
        ds = p * (dp - tl.sum(p * dp, 1)[:, None])
        if IEEE:
            dv += tl.dot(tl.trans(kept), do, input_precision="ieee")
            dq = tl.dot(ds, k, input_precision="ieee") * scale
            dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
        else:
            dv += tl.dot(tl.trans(kept.to(do.dtype)), do)
            dq = tl.dot(ds.to(k.dtype), k) * scale
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        dq_ptr = DQ + b * sdqb + h * sdqh + rows[:, None] * sdqs + dims[None, :]
        tl.store(dq_ptr, dq.to(DQ.dtype.element_ty), mask=inside)
    inside = cols[:, None] < n
    dk_ptr = DK + b * sdkb + h * sdkh + cols[:, None] * sdks + dims[None, :]
    tl.store(dk_ptr, (dk * scale).to(DK.dtype.element_ty), mask=inside)
    dv_ptr = DV + b * sdvb + h * sdvh + cols[:, None] * sdvs + dims[None, :]
    tl.store(dv_ptr, dv.to(DV.dtype.element_ty), mask=inside)
