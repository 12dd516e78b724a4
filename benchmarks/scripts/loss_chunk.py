"""The logits-free loss alone, compiled, against another way of writing its chunk: where its time goes.

usage: python benchmarks/scripts/loss_chunk.py [--out FILE.json] [--positions 16384] [--hidden 768] [--vocab 50257]
       (on a CPU, `--positions 256 --hidden 32 --vocab 1000 --steps 2` checks that the variants agree, nothing more)

Each variant runs `hf_apex.kernels.loss.LinearCrossEntropy`'s maths under torch.compile, forward and backward, at
the bench's shape in BF16:

- `current`: hf_apex's own (`causal_lm_loss`): on a CUDA GPU with Triton each chunk's softmax, loss and gradient
  come from its row kernel (`_rows_kernel`); elsewhere from `torch`'s ops below;
- `torch`: the same with the row kernel off. Under torch.compile each chunk's gradient is one pointwise expression of
  the logits (softmax minus the one-hot target, as a comparison with the column index);
- `scatter`: the chunk's gradient as hf_apex wrote it until 2026-12-02, and still does in eager on a CPU: the softmax
  in place, then the target's column lowered by a scatter (an indexed in-place update).

A variant may carry settings: `current@chunks=4,block=8192,warps=16` (the number of chunks, the row kernel's columns
per load and warps). On an H200
(benchmarks/h200-2026-12-03-rows) the row kernel in 4 chunks took 7.55 ms against `torch`'s 8.19 in 8.

On an H200 (benchmarks/h200-2026-12-02-bert-trial) the pointwise chunk took 8.34 ms per forward + backward at this
shape against the scatter's 9.71, with the same loss and gradients to the last bit; hf_apex then took it.
(A third way, the head's weight gradient accumulated in FP32 by the matmul itself, `torch.addmm(..., out_dtype=
torch.float32)`, was dropped: Inductor cannot lower `addmm` with `out_dtype` on torch 2.13.)

For each it prints the median time of a forward + backward over `--steps` calls (CUDA events), the kernels of one
call with their time (torch.profiler), and how far its loss and gradients are from the first variant's.
"""

import argparse
import json
import statistics
import sys

import torch
from torch import nn

sys.path.insert(0, ".")
from hf_apex.kernels import loss as L  # noqa: E402


def scatter_forward(ctx, hidden, weight, targets, divisor, ignore_index, amp, grad_hidden, grad_weight):
    """LinearCrossEntropy's forward with each chunk's gradient made in place and a scatter (same maths)."""
    dtype = amp or hidden.dtype
    vocab = weight.shape[0]
    h = hidden.to(dtype)
    w = nn.functional.pad(weight.to(dtype), (0, 0, 0, -vocab % L.PAD_MULTIPLE))
    chunks = 1
    while chunks * L.CHUNK_ELEMENTS < h.shape[0] * w.shape[0]:
        chunks *= 2
    grad_h = []
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for hc, yc in zip(h.tensor_split(chunks), targets.tensor_split(chunks)):
        logits = (hc @ w.T).float()
        logits[:, vocab:] = float("-inf")
        lse = torch.logsumexp(logits, dim=-1)
        valid = yc != ignore_index
        target = yc.where(valid, 0)
        picked = logits.gather(1, target[:, None]).squeeze(1)
        total += torch.where(valid, lse - picked, 0.0).sum()
        probs = logits.sub_(lse[:, None]).exp_()
        probs[torch.arange(yc.shape[0], device=yc.device), target] -= valid.to(probs.dtype)
        g = probs.mul_(valid[:, None]).to(dtype)
        grad_h.append((g @ w).float())
        grad_w += (g.T @ hc).float()
    divisor = divisor.to(total.device, torch.float32) if torch.is_tensor(divisor) else float(divisor)
    ctx.save_for_backward(torch.cat(grad_h).div_(divisor), grad_w[:vocab].div_(divisor))
    ctx.dtypes = hidden.dtype, weight.dtype
    return total / divisor


VARIANTS = {
    "current": L.LinearCrossEntropy,  # the row kernel where it runs (a CUDA GPU with Triton), else torch's ops
    "torch": L.LinearCrossEntropy,  # the same with the row kernel off: each chunk in torch's ops, fused by Inductor
    "scatter": type("LinearCrossEntropyScatter", (L.LinearCrossEntropy,), {"forward": staticmethod(scatter_forward)}),
}


def configure(name: str, logits: int, defaults: dict, kernel: bool) -> tuple[str, dict]:
    """``current@chunks=4,block=8192,warps=16``: the variant and the module settings it runs under.
    ``kernel``: whether the row kernel runs here (its chunks' budget is then ``ROW_CHUNK_BYTES`` of BF16);
    ``fp32=0``: the head's gradient from a BF16 matmul and a cast (``FP32_HEAD_GRAD`` off)."""
    base, _, spec = name.partition("@")
    opts = dict(kv.split("=") for kv in spec.split(",") if kv)
    off = base in ("torch", "scatter")
    settings = {"_row_op": (lambda h: None) if off else defaults["_row_op"]}
    if "chunks" in opts:  # the budget of logits per chunk that gives that many chunks
        per_chunk = -(-logits // int(opts["chunks"]))
        settings.update({"ROW_CHUNK_BYTES": 2 * per_chunk} if kernel and not off else {"CHUNK_ELEMENTS": per_chunk})
    if "fp32" in opts:
        settings["FP32_HEAD_GRAD"] = bool(int(opts["fp32"]))
    for key, setting in (("block", "ROW_BLOCK"), ("warps", "ROW_WARPS")):
        if key in opts:
            settings[setting] = int(opts[key])
    return base, settings


def step_fn(cls, amp):
    def step(hidden, weight, targets):
        loss = cls.apply(hidden, weight, targets, (targets != -100).sum(), -100, amp, True, True)
        grad_h, grad_w = torch.autograd.grad(loss, (hidden, weight))
        return loss, grad_h, grad_w

    return torch.compile(step)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--positions", type=int, default=16 * 1024)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--variants", default=";".join(VARIANTS), help="';'-separated, e.g. 'torch;current@chunks=4'")
    p.add_argument("--out")
    o = p.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    hidden = (torch.randn(o.positions, o.hidden, device=device) * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(o.vocab, o.hidden, device=device) * 0.02).requires_grad_()
    targets = torch.randint(0, o.vocab, (o.positions,), device=device)
    targets[:: o.positions // 16] = -100  # some ignored positions, as at the end of each row
    amp = torch.bfloat16
    results, reference = {}, None
    names = ("_row_op", "CHUNK_ELEMENTS", "ROW_CHUNK_BYTES", "FP32_HEAD_GRAD", "ROW_BLOCK", "ROW_WARPS")
    defaults = {k: getattr(L, k) for k in names}
    kernel = L._row_op(hidden) is not None
    for name in o.variants.split(";"):
        base, settings = configure(name, o.positions * (o.vocab + -o.vocab % L.PAD_MULTIPLE), defaults, kernel)
        for k, v in {**defaults, **settings}.items():
            setattr(L, k, v)
        torch._dynamo.reset()
        step = step_fn(VARIANTS[base], amp)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            out = step(hidden, weight, targets)  # compiles
        except Exception as e:  # e.g. an op Inductor cannot lower on this torch: recorded, the others go on
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name:16s} failed: {results[name]['error']}", flush=True)
            continue
        if reference is None:
            reference = out
        gaps = {
            k: ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
            for k, a, b in zip(("loss", "grad_hidden", "grad_weight"), out, reference)
        }
        times = []
        for _ in range(o.steps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(hidden, weight, targets)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                step(hidden, weight, targets)
        kernels = []
        if cuda:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step(hidden, weight, targets)
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
                kernels.append({"name": e.key[:110], "calls": e.count, "ms": round(e.self_device_time_total / 1e3, 3)})
        results[name] = {
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
            "ms_p50": round(statistics.median(times), 3) if times else None,
            "ms_min": round(min(times), 3) if times else None,
            "relative_gap_to_current": gaps,
            "kernels": kernels,
        }
        r = results[name]
        print(f"{name:32s} p50 {r['ms_p50']} ms  peak {r['peak_gib']} GiB  gaps {gaps}", flush=True)
        for k in kernels:
            print(f"    {k['ms']:8.3f} ms  x{k['calls']:<3d} {k['name']}")
    if o.out:
        shape = {"positions": o.positions, "hidden": o.hidden, "vocab": o.vocab, "steps": o.steps}
        info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, **shape}
        with open(o.out, "w") as f:
            json.dump({"run": info, "variants": results}, f, indent=1)


if __name__ == "__main__":
    main()
