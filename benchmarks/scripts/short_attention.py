"""hf_apex's short-sequence attention kernel against SDPA's backends on BERT-base 128 x 128's attention (CUDA).

usage: python benchmarks/scripts/short_attention.py [OUT.json] [--settings ROWS:WARPS/ROWS:WARPS,...]

BERT-base's attention call as the bench's `fastest` step makes it: 128 sequences x 12 heads x 128 tokens x 64, BF16,
query, key and value as views of (batch, tokens, 768) projections, a (batch, 1, 128, 128) boolean padding mask
(a quarter of each row's keys masked out), dropout 0.1, the output's gradient in (batch, tokens, heads, dim) order.
Prints ms per forward + backward (the median of up to 50 calls, CUDA events) for PyTorch's choice, cuDNN, the
memory-efficient backend and the kernel under each setting (forward rows:warps / backward rows:warps), cuDNN and the
kernel once more without dropout, and checks
each without dropout against the math backend in FP32 (relative error of the output and the three gradients).
"""

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_apex.autotune import cuda_timer, rel_err
from hf_apex.kernels import short_attention as sa

B, H, N, D, P = 128, 12, 128, 64, 0.1


def inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, N, H * D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q, k, v = (t.view(B, N, H, D).transpose(1, 2).requires_grad_() for t in (q, k, v))
    keys = torch.arange(N, device="cuda") < (N * 3 // 4)
    mask = keys.expand(B, 1, N, N).contiguous()
    grad = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)  # heads inside tokens
    return q, k, v, mask, grad


def sdpa(backend, q, k, v, mask, p):
    ctx = sdpa_kernel([backend]) if backend is not None else torch.enable_grad()
    with ctx:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p).transpose(1, 2)


def short(q, k, v, mask, p):
    return sa.short_attention(q, k, v, mask, p)


def main():
    out_path = next((a for a in sys.argv[1:] if not a.startswith("--") and a.endswith(".json")), None)
    settings = ["64:4/64:8", "128:8/64:8", "64:4/32:4", "64:4/128:8", "32:4/64:4"]
    if "--settings" in sys.argv:
        settings = sys.argv[sys.argv.index("--settings") + 1].split(",")
    assert sa.register(), "Triton cannot run hf_apex's kernels here"
    q, k, v, mask, grad = inputs()
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask).transpose(1, 2)
    refs = [ref, *torch.autograd.grad(ref, ref_in, grad.float())]
    rows = []

    def measure(name, fn, p=P):
        def step():
            out = fn(q, k, v, mask, p)
            torch.autograd.grad(out, (q, k, v), grad)

        try:
            out = fn(q, k, v, mask, 0.0)
            got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
            errors = [rel_err(a, b) for a, b in zip(got, refs)]
            ms = cuda_timer(step, budget_s=2.0)
        except Exception as exc:  # a backend that cannot take the call
            rows.append({"name": name, "error": str(exc).splitlines()[0]})
            print(f"{name:>24}: {rows[-1]['error']}", flush=True)
            return
        rows.append({"name": name, "ms": ms, "rel_err": errors})
        print(f"{name:>24}: {ms:7.3f} ms   rel err {' '.join(f'{e:.1e}' for e in errors)}", flush=True)

    measure("torch (PyTorch's choice)", lambda *a: sdpa(None, *a))
    measure("cudnn", lambda *a: sdpa(SDPBackend.CUDNN_ATTENTION, *a))
    measure("efficient", lambda *a: sdpa(SDPBackend.EFFICIENT_ATTENTION, *a))
    measure("cudnn, no dropout", lambda *a: sdpa(SDPBackend.CUDNN_ATTENTION, *a), p=0.0)
    measure("short, no dropout", short, p=0.0)
    for setting in settings:
        fwd, bwd = setting.split("/")
        sa.FORWARD_ROWS, sa.FORWARD_WARPS = map(int, fwd.split(":"))
        sa.BACKWARD_ROWS, sa.BACKWARD_WARPS = map(int, bwd.split(":"))
        measure(f"short {setting}", short)
    # dropout: the kept fraction of one call's probabilities (values = identity: the output is the kept matrix)
    eye = torch.eye(N, D, device="cuda", dtype=torch.bfloat16).expand(B, H, N, D)
    kept = (short(q.detach(), k.detach(), eye, None, 0.5).transpose(1, 2)[..., :D] != 0).float().mean().item()
    print(f"dropout 0.5, nothing masked: {kept:.4f} of the first {D} keys' probabilities kept", flush=True)
    if out_path:
        json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows, "kept": kept},
                  open(out_path, "w"), indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
