"""Which sequences of CUDA profiles in one process record their kernels, and what a profile costs later launches.

    python benchmarks/scripts/cupti_sequences.py [OUT.json]

On an H200 (torch 2.11) every `hf_apex.kernels.trace.KernelProfile` after the first of a process recorded no CUDA
kernel when a CPU-only profile ran between them (`tests/gpu/test_attention_gpu.py::
test_every_kernel_profile_of_a_process_names_the_sdpa_backend_that_ran`, 2026-12-01). Each sequence below runs in a
fresh process (60 s limit: a hang shows as a timeout) and prints, per CUDA profile, how many kernels it recorded, and
the host time of 2,000 small kernel launches before the first profile and after the last. The sequences differ in
what happens between two profiles and how TEARDOWN_CUPTI is set, so the one whose second profile records kernels
without leaving the launches slower is the one for `KernelProfile` to follow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, os, sys, time, torch
from hf_apex.kernels import trace
steps = sys.argv[1].split(",")
x = torch.randn(256, 256, device="cuda")

def launches():  # host time of 2,000 small kernel launches (ms)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(2000):
        x.add_(1.0)
    torch.cuda.synchronize()
    return round(1e3 * (time.perf_counter() - t), 2)

out = {"launches_before_ms": launches(), "kernels": []}
profile = None
for step in steps:
    if step == "kp":  # hf_apex's profile, stopped (closed later by "close")
        profile = trace.KernelProfile().start(); (x @ x).sum(); out["kernels"].append(profile.stop()["cuda_kernels"])
    elif step == "close":
        profile.close()
    elif step == "cuda":  # a CUDA call: kineto completes CUPTI's detach here
        (x @ x).sum().item()
    elif step == "wait":
        time.sleep(1.0); (x @ x).sum().item()
    elif step == "cpu":  # a CPU-only torch profile, as a user's
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            (x @ x).sum()
    elif step == "torch":  # a user's CUDA profile
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            (x @ x).sum(); torch.cuda.synchronize()
        out["kernels"].append(sum(e.device_type == torch.autograd.DeviceType.CUDA for e in p.events()))
    elif step.startswith("env="):
        os.environ["TEARDOWN_CUPTI"] = step[4:]
    elif step == "unenv":
        os.environ.pop("TEARDOWN_CUPTI", None)
out["launches_after_ms"] = launches()
out["teardown_cupti_at_exit"] = os.environ.get("TEARDOWN_CUPTI")
print(json.dumps(out))
"""

# name -> (steps, extra environment)
SEQUENCES = {
    "two profiles": ("kp,cuda,close,kp,cuda,close", {}),
    "a CPU profile between (the failing test)": ("kp,cuda,close,cpu,kp,cuda,close", {}),
    "a user's CUDA profile after": ("kp,cuda,close,torch", {}),
    "detach completed before close": ("kp,cuda,wait,close,cpu,kp,cuda,close", {}),
    "TEARDOWN_CUPTI=1 for the whole process": ("env=1,kp,cuda,close,cpu,kp,cuda,close", {}),
    "lazy re-init off": ("kp,cuda,close,cpu,kp,cuda,close", {"DISABLE_CUPTI_LAZY_REINIT": "1"}),
    "no teardown (TEARDOWN_CUPTI=0)": ("env=0,kp,cuda,close,cpu,kp,cuda,close", {}),
    "no profile (launch cost only)": ("cuda", {}),
}


def main(out_json: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("TEARDOWN_CUPTI", None)
    results = {}
    for name, (steps, extra) in SEQUENCES.items():
        start = time.perf_counter()
        try:
            run = subprocess.run(
                [sys.executable, "-c", CHILD, steps],
                capture_output=True,
                text=True,
                env={**env, **extra},
                timeout=60,
            )
            lines = run.stdout.strip().splitlines()
            result = json.loads(lines[-1]) if run.returncode == 0 and lines else {"error": run.stderr[-800:]}
        except subprocess.TimeoutExpired:
            result = {"error": "timed out after 60 s (a hang)"}
        result["seconds"] = round(time.perf_counter() - start, 1)
        results[name] = {"steps": steps, "env": extra, **result}
        print(f"{name:45s} {json.dumps(result)}", flush=True)
    if out_json:
        Path(out_json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
