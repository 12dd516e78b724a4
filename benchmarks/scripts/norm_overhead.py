"""What each way of reaching apex's LayerNorm costs on a host-bound step (BERT-base, 128 x 128, BF16 autocast).

    python benchmarks/scripts/norm_overhead.py OUT.json

A plain loop (torch fused AdamW) over the same model and batch, with the 25 LayerNorms run five ways, in
alternating blocks so clock drift hits all of them: torch's native LayerNorm; hf_apex's swapped modules (what
`--apex_fused_norms` runs); the same kernel with the autocast casts as separate autograd nodes (hf_apex before
this change); apex's own `fused_layer_norm_affine` (its autocast cast and `torch.library` custom op); and
`FusedLayerNormAffineFunction.apply` after one explicit cast. Prints p50 step times and writes them with the
provenance to OUT.json.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
import transformers

from hf_apex import rewire, unrewire
from hf_apex.kernels.apex import norms
from hf_apex.measure.report import provenance


def _casts_as_nodes(m, x, amp):
    w, b = m.weight, m.bias
    if amp is not None:
        x, w, b = x.to(amp), w.to(amp), b.to(amp)
    return norms._LayerNormAffine.apply(x, w, b, m.normalized_shape, m.eps, None)


def _apex_entry_point(m, x, amp):
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine

    return fused_layer_norm_affine(x, m.weight, m.bias, m.normalized_shape, m.eps)


def _apex_function(m, x, amp):
    from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction

    w, b = m.weight, m.bias
    if amp is not None:
        x, w, b = x.to(amp), w.to(amp), b.to(amp)
    with torch.autocast("cuda", enabled=False):
        return FusedLayerNormAffineFunction.apply(x, w, b, m.normalized_shape, m.eps)


VARIANTS = {
    "torch native": None,
    "hf_apex (casts inside one autograd.Function)": "default",
    "hf_apex, casts as separate autograd nodes": _casts_as_nodes,
    "apex fused_layer_norm_affine (custom op)": _apex_entry_point,
    "apex FusedLayerNormAffineFunction.apply": _apex_function,
}


def step_times(model, optimizer, batch, steps):
    marks = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        end.record()
        marks.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in marks]


def use(model, variant, kernel_of):
    unrewire(model)
    if variant is None:
        return
    rewire(model, strict_kernels=True)
    if variant != "default":
        norms._LayerNormKernel.hf_apex_kernel = lambda self, amp: lambda m, x: variant(m, x, amp)
    else:
        norms._LayerNormKernel.hf_apex_kernel = kernel_of


def measure(names=tuple(VARIANTS), blocks: int = 4, steps: int = 15) -> dict[str, list[float]]:
    """Step times (ms) of each way in ``names``, in ``blocks`` alternating blocks of ``steps`` steps."""
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2)).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(1000, 30000, (128, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids.cuda(), "attention_mask": torch.ones_like(ids).cuda(), "labels": (ids[:, 0] % 2).cuda()}
    kernel_of = norms._LayerNormKernel.hf_apex_kernel
    times: dict[str, list[float]] = {name: [] for name in names}
    try:
        for name in names:  # warm-up of every path
            use(model, VARIANTS[name], kernel_of)
            step_times(model, optimizer, batch, 5)
        for _ in range(blocks):
            for name in names:
                use(model, VARIANTS[name], kernel_of)
                times[name] += step_times(model, optimizer, batch, steps)
    finally:
        norms._LayerNormKernel.hf_apex_kernel = kernel_of
    return times


def main(out: str) -> None:
    times = measure()
    native = statistics.median(times["torch native"])
    rows = {}
    for name, ms in times.items():
        p50 = statistics.median(ms)
        q = statistics.quantiles(ms, n=5)
        rows[name] = {"p50_ms": p50, "p20_ms": q[0], "p80_ms": q[3], "vs_native": p50 / native - 1, "steps": len(ms)}
        print(f"{name:48s} {p50:7.2f} ms  ({q[0]:.2f}-{q[3]:.2f})  {p50 / native - 1:+6.1%}")
    with open(out, "w") as f:
        json.dump({"rows": rows, "provenance": provenance()}, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
