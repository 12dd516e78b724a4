"""Where an ApexTrainer step spends host time, and which calls make the host wait for the device.

    python benchmarks/scripts/host_profile.py [--plain] [--steps A:B] [--pstats FILE] <recipes/finetune.py flags>

Runs `recipes/finetune.py` with the given flags (`--trainer stock` too) and profiles optimizer steps A..B-1 twice:
once with torch.profiler (per-step counts of kernel launches, device syncs and host reads of device values; the
device's busy time against the wall time, the kernels by device time and by kind: matmuls, attention, norms...),
once with cProfile (host time per Trainer phase: data, forward+backward, clipping, optimizer, scheduler, callbacks,
logging). Prints both; `--pstats` also saves the cProfile statistics (pstats format: to compare two runs function
by function). `--plain` profiles recipes/plain_loop.py's steps instead (the same training without the Trainer).
Used to find the Trainer's own host cost on a host-bound step, and where a device-bound step spends its time.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import finetune  # noqa: E402

PSTATS: str | None = None  # --pstats: where to save the cProfile statistics
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
# Kinds of device work, by patterns of the kernels' names (lower case), tried in this order.
BUDGET = (
    ("matmuls (cuBLAS)", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "splitkreduce")),
    ("attention (SDPA)", ("sdpa", "fmha", "flash", "cudnn", "attention")),
    ("loss row kernel", ("softmax_xent",)),
    ("optimizer (Adam's kernels)", ("adam",)),  # (torch's FusedAdamMathFunctor, apex's AdamFunctor)
    ("clipping and other foreach ops", ("multi_tensor_apply", "foreach", "lpnorm")),
    ("norms (and what Inductor fused into them)", ("layer_norm", "rms_norm", "cuapplylayernorm", "cuapplyrmsnorm")),
    ("dropout (torch's kernels)", ("fused_dropout",)),
    ("other Triton kernels (Inductor)", ("triton_",)),
    ("other ATen kernels", ("at::native",)),
    ("copies and fills", ("memcpy", "memset")),
)
PHASES = {  # function name (as cProfile records it) -> phase
    "get_batch_samples": "data (next batch, to device)",
    "training_step": "forward + backward",
    "_clip_grad_norm": "clip_grad_norm",
    "step": None,  # resolved by file below
    "call_event": "callbacks",
    "_maybe_log_save_evaluate": "log/save/evaluate",
    "_track_num_input_tokens": "token count",
    "floating_point_ops": "flops count",
    "zero_grad": "zero_grad",
    "_get_learning_rate": "learning rate read",
}


class Profile(TrainerCallback):
    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self.torch_prof = self.cprof = None

    def on_step_begin(self, args, state, control, **kw):
        self.begin(state.global_step)

    def on_step_end(self, args, state, control, **kw):
        self.end(state.global_step)

    def begin(self, step: int):  # `step` optimizer steps done so far
        if step == self.first:
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            )
            self.torch_prof = torch.profiler.profile(activities=acts)
            self.torch_prof.__enter__()
            self.t_torch = time.perf_counter()
        if step == self.last:
            self.cprof = cProfile.Profile()
            self.t0 = time.perf_counter()
            self.cprof.enable()

    def end(self, step: int):
        if step == self.last and self.torch_prof is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.wall_torch = time.perf_counter() - self.t_torch
            self.torch_prof.__exit__(None, None, None)
            self.report_torch(self.last - self.first)
            self.torch_prof = None
        if step == 2 * self.last - self.first and self.cprof is not None:
            self.cprof.disable()
            self.report_cprofile(self.last - self.first)
            self.cprof = None

    def report_torch(self, n: int):
        counts = Counter(e.name for e in self.torch_prof.events())
        kernels = sum(1 for e in self.torch_prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"\n== torch.profiler, per optimizer step (mean of {n}) ==")
        print(f"  device kernels/copies executed: {kernels / n:.1f}")
        for name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", *SYNC_EVENTS):
            print(f"  {name:32s} {counts.get(name, 0) / n:8.2f}")
        table = self.torch_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(table)
        # Where the device time goes: busy time against the (profiled) wall time, then the kernels that take it.
        busy_ms = sum(e.time_range.elapsed_us() for e in self.device_work()) / (1e3 * n)
        print(f"\n== device time per optimizer step (mean of {n}) ==")
        print(f"  wall {1e3 * self.wall_torch / n:8.2f} ms (profiled), kernels and copies {busy_ms:8.2f} ms")
        print(
            self.torch_prof.key_averages().table(
                sort_by="self_device_time_total", row_limit=30, max_name_column_width=70
            )
        )
        self.report_budget(n)
        self.report_aten_kernels(n)

    def device_work(self):
        """The kernels and copies the device ran: not the ranges that name them (``Optimizer.step#AdamW.step`` spans
        the optimizer's kernels on the device's timeline too, and would count them twice)."""
        for e in self.torch_prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
                yield e

    def report_budget(self, n: int):
        """The device time of the step's kernels by kind (the first pattern a kernel's name matches, in this order:
        a Triton kernel that Inductor fused around a norm counts as the norm's)."""
        spent, calls = Counter(), Counter()
        for e in self.device_work():
            kind = next((k for k, pats in BUDGET if any(p in e.name.lower() for p in pats)), "other")
            spent[kind] += e.time_range.elapsed_us()
            calls[kind] += 1
        total = sum(spent.values())
        print(f"\n== device time by kind, per optimizer step (mean of {n}) ==")
        for kind, us in spent.most_common():
            print(f"  {kind:44s} {us / (1e3 * n):7.3f} ms  {100 * us / total:5.1f} %  {calls[kind] / n:6.1f} kernels")

    def report_aten_kernels(self, n: int):
        """torch's own (ATen) kernels, by the op that launched them and that op's callers. A kernel replayed in a CUDA
        graph counts under the call that replays the graph (``## Call CompiledFxGraph ...``): its own code, as
        captured, launched it."""
        launched, device_us = Counter(), Counter()
        for event in self.torch_prof.events():
            for kernel in getattr(event, "kernels", []):
                if "at::native" not in kernel.name:
                    continue
                callers, parent = [event.name], event.cpu_parent
                while parent is not None and len(callers) < 4:
                    callers.append(parent.name)
                    parent = parent.cpu_parent
                key = (kernel.name.split("<")[0].replace("void at::native::", "")[:40], " < ".join(callers)[:150])
                launched[key] += 1
                device_us[key] += kernel.duration
        print(f"\n== ATen kernels, per optimizer step (mean of {n}), by caller (CUDA graphs: the replaying call) ==")
        for (kernel, callers), count in launched.most_common(15):
            print(f"  {count / n:6.1f} x {kernel:40s} {device_us[kernel, callers] / (1e3 * n):7.3f} ms  {callers}")

    def report_cprofile(self, n: int):
        stats = pstats.Stats(self.cprof)
        if PSTATS:
            stats.dump_stats(PSTATS)
        print(f"\n== cProfile, host ms per optimizer step (mean of {n}; cProfile inflates Python-heavy parts) ==")
        print(f"  {'whole step (wall, profiled)':40s} {1e3 * (time.perf_counter() - self.t0) / n:8.2f}")
        for (file, _, func), (_, _, _, cum, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][3]):
            phase = PHASES.get(func, "")
            if func == "step":
                phase = "lr_scheduler.step" if "lr_scheduler" in file else "optimizer.step" if "optim" in file else ""
            if phase:
                print(f"  {phase + ' [' + Path(file).name + ':' + func + ']':40s} {1e3 * cum / n:8.2f}")
        stats.sort_stats("tottime").print_stats(25)


def profiled(trainer_cls):
    """``trainer_cls`` with the profile's callback (ApexTrainer, or transformers' Trainer for --trainer stock)."""

    class Profiled(trainer_cls):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.add_callback(Profile(*PROFILE_STEPS))

    return Profiled


def profile_plain_loop(argv):
    """The same profile around recipes/plain_loop.py's steps (hooked through its StepTimer)."""
    import plain_loop

    from hf_apex.measure.steps import StepTimer

    prof = Profile(*PROFILE_STEPS)

    class HookedTimer(StepTimer):
        done = 0

        def start(self):
            if self.done:
                prof.end(self.done)
            prof.begin(self.done)
            self.done += 1
            super().start()

    plain_loop.StepTimer = HookedTimer
    with tempfile.TemporaryDirectory() as tmp:
        plain_loop.main(str(Path(tmp) / "plain.json"), argv)


if __name__ == "__main__":
    argv = sys.argv[1:]
    PROFILE_STEPS = (10, 15)
    plain = "--plain" in argv
    argv = [a for a in argv if a != "--plain"]
    while argv and argv[0] in ("--steps", "--pstats"):  # (in either order, before the finetune.py flags)
        if argv[0] == "--steps":
            a, b = argv[1].split(":")
            PROFILE_STEPS = (int(a), int(b))
        else:
            PSTATS = argv[1]
        argv = argv[2:]
    if plain:
        profile_plain_loop(argv)
    else:
        finetune.ApexTrainer = profiled(finetune.ApexTrainer)
        finetune.transformers.Trainer = profiled(finetune.transformers.Trainer)  # (this process's only)
        finetune.main(argv)
