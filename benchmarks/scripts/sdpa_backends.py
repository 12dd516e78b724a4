"""Forward + backward time of each SDPA backend on the bench models' attention shapes (BF16, CUDA).

usage: python benchmarks/scripts/sdpa_backends.py [OUT.json] [--kernels]

The attention of GPT-2 and of the Llama-architecture model at 16 x 1024 (12 heads of 64, causal) and of BERT-base at
128 x 128 (12 heads of 64, a padding mask or none), with and without the models' attention dropout (0.1 for GPT-2
and BERT, none in Llama), with contiguous heads and in GPT-2's own layout (query, key and value are views into one
(batch, tokens, 3 x 768) projection, and the output's gradient comes back with heads inside tokens; once more with
those views copied to contiguous heads inside the timed call), under PyTorch's own choice and each backend forced
with `torch.nn.attention.sdpa_kernel`. Prints ms per forward + backward (the median of up to 20 calls after 3
warm-up calls, CUDA events) and TFLOP/s counting causal attention as half the score matrix (as FlashAttention's
papers do); a backend that cannot run a shape says why. Used to see what the `fastest` rung's attention costs (a
profile of GPT-2 `fastest` on an H200, 2026-12-01: cuDNN's kernels took 13.6 of 45 ms per step).

`--kernels`: after all the timings, also profile one forward + backward of PyTorch's choice per shape
(torch.profiler, CUDA activity) and print the kernels it ran with their device times, to set beside a training
step's profile. In GPT-2's `fastest` step cuDNN ran `..._flash_fprop_wgmma_f16_knob_7_...` (0.45 ms) and
`..._flash_bprop_wgmma_f16_knob_26_...` (0.63 ms) per layer: 1.08 ms, about 1.7 times the 0.65 ms that these
timings gave the whole call in GPT-2's layout (`git show
46ca0e8:benchmarks/h200-2026-12-01-ladder/second-session/sdpa.log`). A different plan would show here.
"""

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_apex.autotune import cuda_timer

BACKENDS = {
    "default": None,  # PyTorch's own choice
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# name -> (batch, heads, tokens, head dim, causal, padding mask, dropout[, layout]); layout "gpt2": GPT-2's views,
# "gpt2, copied": the same views made contiguous inside the timed call (what a contiguous-heads wrapper would cost)
SHAPES = {
    "gpt2 (dropout 0.1)": (16, 12, 1024, 64, True, False, 0.1),
    "gpt2 layout (dropout 0.1)": (16, 12, 1024, 64, True, False, 0.1, "gpt2"),
    "gpt2 layout, copied (dropout 0.1)": (16, 12, 1024, 64, True, False, 0.1, "gpt2, copied"),
    "gpt2/llama (no dropout)": (16, 12, 1024, 64, True, False, 0.0),
    "gpt2 layout (no dropout)": (16, 12, 1024, 64, True, False, 0.0, "gpt2"),
    "bert, padded (dropout 0.1)": (128, 12, 128, 64, False, True, 0.1),
    "bert, padded (no dropout)": (128, 12, 128, 64, False, True, 0.0),
    "bert, no mask (dropout 0.1)": (128, 12, 128, 64, False, False, 0.1),
}


KERNELS = "--kernels" in sys.argv
profiles = []  # (row, its call) of PyTorch's choice per shape, for --kernels


def measure(
    name: str, b: int, h: int, t: int, d: int, causal: bool, padded: bool, dropout: float, layout: str | None = None
) -> list[dict]:
    if layout:  # GPT-2: c_attn's output split in three, each viewed as (batch, tokens, heads, dim), transposed
        qkv = torch.randn(b, t, 3 * h * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q, k, v = (x.view(b, t, h, d).transpose(1, 2) for x in qkv.split(h * d, dim=2))
        grad = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # from c_proj's input
        inputs = (qkv,)
    else:
        q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        inputs = (q, k, v)
    mask = None
    if padded:  # SST-2-like lengths: each row keeps its first n keys (n from 8 to t), as BERT's padding mask does
        keep = torch.arange(t, device="cuda") < torch.randint(8, t + 1, (b, 1, 1, 1), device="cuda")
        mask = keep.expand(b, 1, t, t)
    flops = 4 * b * h * t * t * d * (0.5 if causal else 1.0) * 3.5  # the backward 2.5 times the forward

    def heads():  # what SDPA is handed (the copies inside the timed call, where they are part of the cost)
        return [x.contiguous() for x in (q, k, v)] if layout == "gpt2, copied" else (q, k, v)

    def step():
        y = F.scaled_dot_product_attention(*heads(), attn_mask=mask, dropout_p=dropout, is_causal=causal)
        torch.autograd.grad(y, inputs, grad)

    rows = []
    for backend, sdp in BACKENDS.items():
        row = {"shape": name, "backend": backend}
        try:
            if sdp is None:
                row["ms"] = cuda_timer(step, budget_s=0.5, max_reps=20)  # (this first call settles the priority)
                picked = torch._fused_sdp_choice(*heads(), attn_mask=mask, dropout_p=dropout, is_causal=causal)
                row["picked"] = SDPBackend(picked).name  # which backend PyTorch's choice is
                if KERNELS:
                    profiles.append((row, step))  # profiled after every timing (CUPTI stays attached after it)
            else:
                with sdpa_kernel([sdp]):
                    row["ms"] = cuda_timer(step, budget_s=0.5, max_reps=20)
            row["tflops"] = flops / row["ms"] / 1e9
        except RuntimeError as exc:
            row["error"] = str(exc).splitlines()[0][:100]
        rows.append(row)
        ms = f"{row['ms']:8.3f} ms {row['tflops']:6.0f} TFLOP/s" if "ms" in row else row["error"]
        ms += f" ({row['picked']})" if "picked" in row else ""
        print(f"{name:28s} {backend:10s} {ms}", flush=True)
    return rows


def profiled_kernels(step) -> list[tuple[str, float]]:
    """(kernel name, device µs) of one call of ``step``, in launch order."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name, e.device_time_total) for e in sorted(events, key=lambda e: e.time_range.start)]


def main(out: str | None) -> None:
    torch.manual_seed(0)
    rows = [row for name, shape in SHAPES.items() for row in measure(name, *shape)]
    for row, step in profiles:
        row["kernels"] = profiled_kernels(step)
        print(f"{row['shape']:28s} {row['backend']:10s} kernels:", flush=True)
        for kernel, us in row["kernels"]:
            print(f"{'':40s}{us:9.1f} us  {kernel[:110]}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(next((a for a in sys.argv[1:] if not a.startswith("--")), None))
