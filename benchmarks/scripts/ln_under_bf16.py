"""Why `fused_full` gains less than BF16 alone: apex FusedLayerNorm vs torch's LayerNorm under BF16 autocast.

Plain training loop (apex FusedAdam, BF16 autocast, synthetic tokens), BERT-base 128x128 and GPT-2 124M 16x1024,
with the stock nn.LayerNorm and with hf_apex's apex-backed swap; then torch.profiler's CUDA time of the norm
kernels in one step of each. Writes one JSON to the path given as the first argument.

    python benchmarks/scripts/ln_under_bf16.py out.json
"""

import json
import sys

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

from hf_apex import rewire
from hf_apex.kernels.optim import apex_optimizer_class
from hf_apex.measure.report import provenance

MODELS = {
    "bert-base 128x128": (
        lambda: transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2)),
        128,
        128,
    ),
    "gpt2-124M 16x1024": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config()), 16, 1024),
}


def run(build, batch, seq, apex_ln, steps=30, warmup=10):
    torch.manual_seed(0)
    model = build().cuda().train()
    if apex_ln:
        rewire(model, strict_kernels=True)
    opt = apex_optimizer_class("fused_adam")(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
    labels = ids if seq == 1024 else torch.randint(0, 2, (batch,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)

    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        if i >= warmup:
            times.append((start, end))
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in times)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    norm_us = sum(
        e.device_time_total
        for e in prof.key_averages()
        if "norm" in e.key.lower() or "Norm" in e.key or "GammaBeta" in e.key or "cuComputeGradInput" in e.key
    )
    total_us = sum(e.device_time_total for e in prof.key_averages())
    return {"step_ms_p50": ms[len(ms) // 2], "norm_kernels_ms": norm_us / 1e3, "all_kernels_ms": total_us / 1e3}


results = {"provenance": provenance(), "rows": []}
for name, (build, batch, seq) in MODELS.items():
    native = run(build, batch, seq, apex_ln=False)
    torch.cuda.empty_cache()
    fused = run(build, batch, seq, apex_ln=True)
    torch.cuda.empty_cache()
    row = {
        "model": name,
        "native_ln": native,
        "apex_ln": fused,
        "apex_ln_step_cost": fused["step_ms_p50"] / native["step_ms_p50"] - 1,
    }
    results["rows"].append(row)
    print(json.dumps(row), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(results, f, indent=2)
