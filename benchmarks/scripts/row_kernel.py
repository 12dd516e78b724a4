"""The loss's row kernel alone, against ways of writing it that read HBM less: where its 0.4 ms per chunk goes.

usage: python benchmarks/scripts/row_kernel.py [--out FILE.json] [--rows 4096] [--vocab 50257] [--rounds 10]
       [--calls 20]
       (needs a CUDA GPU; the shape is one of GPT-2's four chunks at the bench's 16 x 1024 tokens)

hf_apex's kernel (`hf_apex.kernels.ops.lm_loss._rows_kernel`) runs one program per row of a chunk's BF16 logits: a
first pass over the row for its log-sum-exp (an online max and sum, both reduced across the program at every load),
then a second pass that reads the row again and writes the gradient over it. At 4,096 rows of 50,304 columns a chunk is
412 MB; if the second pass misses L2, the kernel moves 1.24 GB. The variants here:

- `hf_apex`: hf_apex's op, as its loss calls it (its ROW_BLOCK and ROW_WARPS, or e.g. `hf_apex@block=8192,warps=16`);
- `lanes`: each lane keeps its own running sum, rescaled by the program's max at each load (one reduction across
  the program per load instead of two; the sum is reduced once at the end);
- `lanes@programs=K`: the same, with K programs per SM, each taking rows in turn (row = program, program + grid, ...),
  so that fewer rows are in flight and a row read by the first pass may still be in L2 for the second;
- `evict`: like `lanes`, the first pass asking L2 to keep the row (`evict_last`), the second to drop it;
- `whole` (`@wwarps=W`: its warps, 32 by default): the row held whole in registers, read once;
- `whole16`: the first version of that, masked at the vocabulary (2-byte loads), the row held in BF16.

Each variant's losses and gradient are checked against torch's FP32 cross-entropy on the same logits (the gradient to
BF16's rounding (the script exits non-zero if one is off), then timed: `--rounds` rounds over the variants in turn,
each `--calls` calls back to back between two CUDA events (the kernel writes over its input, so later calls read
gradients, not logits: the same bytes and the same exps). On an H200 (`git show
46ca0e8:benchmarks/h200-2026-12-03-bench/`, an earlier harness that timed single synchronised calls, launch included)
2,048 columns a load and 4 warps took 0.411 ms against 0.430 at 4,096 and 8; the rewrites, at 4,096 and 8, were all
slower. Later (`46ca0e8:benchmarks/h200-2026-12-03-vector/`, benchmarks/reports/h200-fastest.md) hf_apex's kernel
took 0.396 ms with its loads masked at the vocabulary (50,257 columns: Triton then loads 2 bytes at a time) and 0.349
masked at the padded width (16-byte loads); `whole` took 0.560 at 32 warps and 0.581 at 16 (its registers spill),
`whole16` 0.977.
"""

import argparse
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from hf_apex.kernels.ops import lm_loss as L  # noqa: E402

# hf_apex's settings, before a variant sets its own, and the whole-row variants' warps
DEFAULTS = {"block": L.ROW_BLOCK, "warps": L.ROW_WARPS, "wwarps": 32}


@triton.jit
def rows_lanes(
    logits,
    row_stride,
    targets,
    losses,
    n_rows,
    vocab,
    cols,
    ignore_index,
    BLOCK: tl.constexpr,
    PERSISTENT: tl.constexpr,
    EVICT: tl.constexpr,
):
    first = tl.program_id(0)
    step = tl.num_programs(0) if PERSISTENT else n_rows
    offsets = tl.arange(0, BLOCK)
    for r in range(first, n_rows, step):
        row = logits + tl.cast(r, tl.int64) * row_stride
        target = tl.load(targets + r)
        counted = target != ignore_index
        target = tl.where(counted, target, 0)
        top = float("-inf")
        lanes = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            if EVICT:
                x = tl.load(
                    row + start + offsets,
                    mask=start + offsets < vocab,
                    other=float("-inf"),
                    eviction_policy="evict_last",
                )
            else:
                x = tl.load(row + start + offsets, mask=start + offsets < vocab, other=float("-inf"))
            x = x.to(tl.float32)
            new_top = tl.maximum(top, tl.max(x, 0))
            lanes = lanes * tl.exp(top - new_top) + tl.exp(x - new_top)
            top = new_top
        lse = top + tl.log(tl.sum(lanes, 0))
        picked = tl.load(row + target).to(tl.float32)
        tl.store(losses + r, tl.where(counted, lse - picked, 0.0))
        for start in range(0, cols, BLOCK):
            c = start + offsets
            if EVICT:
                x = tl.load(row + c, mask=c < vocab, other=float("-inf"), eviction_policy="evict_first")
            else:
                x = tl.load(row + c, mask=c < vocab, other=float("-inf"))
            g = tl.exp(x.to(tl.float32) - lse) - tl.where(c == target, 1.0, 0.0)
            g = tl.where(counted, g, 0.0).to(row.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(row + c, g, mask=c < cols)


@triton.jit
def rows_whole(logits, row_stride, targets, losses, vocab, cols, ignore_index, BLOCK: tl.constexpr):
    """One read: the row held whole in registers (BLOCK, a power of two, at least its columns), 16-byte loads (the
    mask at ``cols``), the softmax written everywhere, then the target's column over it."""
    row = logits + tl.program_id(0).to(tl.int64) * row_stride
    target = tl.load(targets + tl.program_id(0))
    counted = target != ignore_index
    target = tl.where(counted, target, 0)
    s = tl.where(counted, 1.0, 0.0)
    offsets = tl.arange(0, BLOCK)
    x = tl.load(row + offsets, mask=offsets < cols, other=0.0)
    x = tl.where(offsets < vocab, x, float("-inf"))
    picked = tl.load(row + target).to(tl.float32)
    top = tl.max(x, 0).to(tl.float32)
    lse = top + tl.log(tl.sum(tl.exp(x.to(tl.float32) - top), 0))
    tl.store(losses + tl.program_id(0), tl.where(counted, lse - picked, 0.0))
    g = (tl.exp(x.to(tl.float32) - lse) * s).to(row.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(row + offsets, g, mask=offsets < cols)
    tl.debug_barrier()
    tl.store(row + target, ((tl.exp(picked - lse) - 1.0) * s).to(row.dtype.element_ty, fp_downcast_rounding="rtne"))


@triton.jit
def rows_whole16(logits, row_stride, targets, losses, vocab, cols, ignore_index, BLOCK: tl.constexpr):
    """The first whole-row kernel: masked at ``vocab`` (2-byte loads), the row held as loaded (BF16)."""
    row = logits + tl.program_id(0).to(tl.int64) * row_stride
    target = tl.load(targets + tl.program_id(0))
    counted = target != ignore_index
    target = tl.where(counted, target, 0)
    offsets = tl.arange(0, BLOCK)
    x = tl.load(row + offsets, mask=offsets < vocab, other=float("-inf"))
    top = tl.max(x.to(tl.float32), 0)
    lse = top + tl.log(tl.sum(tl.exp(x.to(tl.float32) - top), 0))
    picked = tl.sum(tl.where(offsets == target, x.to(tl.float32), 0.0), 0)
    tl.store(losses + tl.program_id(0), tl.where(counted, lse - picked, 0.0))
    g = tl.exp(x.to(tl.float32) - lse) - tl.where(offsets == target, 1.0, 0.0)
    g = tl.where(counted, g, 0.0).to(row.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(row + offsets, g, mask=offsets < cols)


def run_whole(logits, targets, vocab, settings, kernel=rows_whole):
    losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    block = triton.next_power_of_2(logits.shape[1])
    kernel[(logits.shape[0],)](
        logits,
        logits.stride(0),
        targets,
        losses,
        vocab,
        logits.shape[1],
        -100,
        BLOCK=block,
        num_warps=settings["wwarps"],
    )
    return losses


def run_hf_apex(logits, targets, vocab, settings):
    """hf_apex's own op (the path its loss takes), at the variant's settings."""
    L.ROW_BLOCK, L.ROW_WARPS = settings["block"], settings["warps"]  # (read by the op at each call)
    return L._rows_op()(logits, targets, torch.ones((), device=logits.device), vocab, -100, True)  # (scale 1)


def run_lanes(logits, targets, vocab, settings, evict=False):
    """``rows_lanes``: with ``programs``, that many programs per SM take the rows in turn."""
    losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    programs = settings["programs"]
    grid = min(logits.shape[0], programs * settings["sms"]) if programs else logits.shape[0]
    rows_lanes[(grid,)](
        logits,
        logits.stride(0),
        targets,
        losses,
        logits.shape[0],
        vocab,
        logits.shape[1],
        -100,
        BLOCK=settings["block"],
        PERSISTENT=bool(programs),
        EVICT=evict,
        num_warps=settings["warps"],
    )
    return losses


KINDS = {
    "hf_apex": run_hf_apex,
    "whole": run_whole,
    "whole16": lambda *a: run_whole(*a, kernel=rows_whole16),
    "lanes": run_lanes,
    "evict": lambda *a: run_lanes(*a, evict=True),
}


def parse(variant: str) -> tuple[str, dict]:
    """``kind@key=value,...`` -> (kind, every setting the kernel runs with: hf_apex's defaults where not given)."""
    kind, _, rest = variant.partition("@")
    given = {k: int(v) for k, v in (kv.split("=") for kv in rest.split(",") if kv)}
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return kind, DEFAULTS | {"programs": 0, "sms": sms} | given


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--rounds", type=int, default=10, help="rounds over the variants in turn")
    p.add_argument("--calls", type=int, default=20, help="calls back to back per variant and round")
    p.add_argument("--out")
    p.add_argument(
        "--variants",
        # 2026-12-03 ran hf_apex at 4096/8, 8192/16 and 2048/4 (the default since), lanes and evict with programs
        # (slower); later that day the whole-row kernels (one read) against hf_apex's, 16-byte loads since
        default="hf_apex;hf_apex@block=4096,warps=8;hf_apex@block=1024,warps=4;whole@wwarps=16;whole;whole16",
    )
    o = p.parse_args()
    torch.manual_seed(0)
    cols = o.vocab + (-o.vocab % L.PAD_MULTIPLE)
    base = (torch.randn(o.rows, cols, device="cuda") * 2).to(torch.bfloat16)
    targets = torch.randint(0, o.vocab, (o.rows,), device="cuda")
    targets[:7] = -100
    ref_x = base[:, : o.vocab].float()
    ref_loss = torch.nn.functional.cross_entropy(ref_x, targets, reduction="none", ignore_index=-100)
    ref_grad = torch.softmax(ref_x, -1) - torch.nn.functional.one_hot(targets.clamp(min=0), o.vocab)
    ref_grad = (ref_grad * (targets != -100)[:, None]).to(torch.bfloat16)
    gbytes = base.numel() * base.element_size() / 1e9
    variants, results, failed = [], {}, False
    for variant in filter(None, o.variants.split(";")):
        kind, settings = parse(variant)
        x = base.clone()
        try:
            losses = KINDS[kind](x, targets, o.vocab, settings)
            torch.cuda.synchronize()
        except Exception as e:  # a setting Triton cannot compile (registers, shared memory): say so, go on
            print(f"{variant:45s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            results[variant] = {"variant": variant, "settings": settings, "error": f"{type(e).__name__}: {e}"[:500]}
            continue
        loss_err = (losses - ref_loss).abs().max().item()
        got = x[:, : o.vocab].float()
        grad_err = (got - ref_grad.float()).abs().max().item()
        pad_zero = bool((x[:, o.vocab :] == 0).all())
        # FP32 sums in another order; the gradient within one BF16 rounding (a relative 2^-7) of torch's
        ok = loss_err < 1e-4 and pad_zero and torch.allclose(got, ref_grad.float(), rtol=2**-7, atol=2**-16)
        failed |= not ok
        results[variant] = {
            "variant": variant,
            "settings": settings,
            "ok": ok,
            "loss_max_abs_err": loss_err,
            "grad_max_abs_err": grad_err,
            "padding_zero": pad_zero,
            "times": [],
        }
        variants.append((variant, kind, settings, x))
    # Rounds over the variants in turn (a slower stretch of the GPU falls on all of them), each time `--calls` calls
    # back to back between two events: the GPU queue stays full, so the host's launch time stays out of the figure.
    for _ in range(o.rounds):
        for variant, kind, settings, x in variants:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(o.calls):
                KINDS[kind](x, targets, o.vocab, settings)
            end.record()
            end.synchronize()
            results[variant]["times"].append(start.elapsed_time(end) / o.calls)
    for variant, *_ in variants:
        row = results[variant]
        times = row.pop("times")
        ms = statistics.median(times)
        row.update(ms=round(ms, 4), min_ms=round(min(times), 4), tbps_one_read_one_write=round(2 * gbytes / ms, 2))
        print(
            f"{variant:45s} {ms:7.4f} ms (min {min(times):.4f})  {row['tbps_one_read_one_write']:5.2f} TB/s at "
            f"2 x {gbytes:.2f} GB  loss err {row['loss_max_abs_err']:.1e}  grad err {row['grad_max_abs_err']:.1e}  "
            f"padding 0: {row['padding_zero']}{'' if row['ok'] else '  WRONG'}",
            flush=True,
        )
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": o.rows,
        "cols": cols,
        "vocab": o.vocab,
        "rounds": o.rounds,
        "calls": o.calls,
        "hf_apex_defaults": DEFAULTS,
    }
    if o.out:
        with open(o.out, "w") as f:
            json.dump({"meta": meta, "results": list(results.values())}, f, indent=1)
    if failed:
        sys.exit("row_kernel: a variant's loss or gradient is off (marked WRONG above)")


if __name__ == "__main__":
    main()
