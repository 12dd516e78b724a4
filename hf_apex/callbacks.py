"""``StageMetricsCallback``: what a stage does to step time, throughput, MFU and memory, step by step.

Works with the stock ``Trainer`` (it writes ``<output_dir>/hf_apex_metrics.json``) and with ``ApexTrainer``,
which also merges the per-window figures into ``Trainer.log`` so every ``report_to`` integration sees them.

Timing uses CUDA events recorded at ``on_step_begin``/``on_step_end`` and is resolved only when figures are
reported, so measuring adds no synchronisation to the training loop. Tokens are counted from the real batch
(``attention_mask`` when present) by a forward pre-hook, on the device, without a host sync.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from .autotune import autotune_report
from .counters import KERNEL_COUNTER
from .metrics import flops_per_token, lookup_peak_tflops, model_shape, percentiles, provenance, write_metrics_file
from .profiling import KernelProfile

logger = logging.getLogger("hf_apex")
GIB = 2**30


@dataclasses.dataclass
class _Step:
    step: int
    start: object  # torch.cuda.Event or float (perf_counter)
    end: object
    tokens: object  # real tokens (attention_mask): int or 0-d tensor on the device
    positions: int  # sequence positions computed, padding included (what MFU counts)
    samples: int
    seq_len: int
    skipped: bool = False
    ms: float | None = None
    index: int = 0  # 1-based position in this train() call (warm-up and profiling count from here, not from a
    # resumed checkpoint's global step)


class StageMetricsCallback(TrainerCallback):
    """Per-step stage metrics and the run's metrics JSON.

    Args:
        stage (`str`, *optional*): stage name written into the JSON (read from `args.stage` when absent).
        warmup_steps (`int`, *optional*, defaults to 5): optimizer steps left out of the summary.
        peak_tflops (`float`, *optional*): peak dense TFLOP/s for MFU; looked up from the GPU name when `None`.
        profile_kernels (`bool`, *optional*, defaults to `True`): profile one warm-up step on CUDA and record
            the apex kernels that executed.
        extra (`dict`, *optional*): more fields for the JSON (e.g. the rewire report).
    """

    def __init__(self, stage=None, warmup_steps=5, peak_tflops=None, profile_kernels=True, extra=None):
        self.stage = stage
        self.warmup_steps = warmup_steps
        self.peak_tflops = peak_tflops
        self.profile_kernels = profile_kernels
        self.extra = dict(extra or {})
        self._reset()

    # -- state -------------------------------------------------------------------------------------------
    def _reset(self) -> None:
        self.steps: list[_Step] = []
        self._pending: list[_Step] = []
        self._window: list[_Step] = []
        self._open: _Step | None = None
        self._run_steps = 0
        self._tokens = 0
        self._positions = 0
        self._samples = 0
        self._seq_len = 0
        self._hook = None
        self._counts_at_start: Counter = Counter()
        self._cuda = False
        self._shape: dict = {}
        self._profile: KernelProfile | None = None
        self.kernels_verified: dict | None = None
        self._optimizer_class: str | None = None
        self._start_wall = None

    def _count_batch(self, module, args, kwargs) -> None:
        if not module.training:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            self._tokens = self._tokens + mask.sum()
        elif isinstance(ids, torch.Tensor):
            self._tokens = self._tokens + ids.numel()
        if isinstance(ids, torch.Tensor) and ids.ndim >= 2:
            self._positions += ids.numel()
            self._samples += ids.shape[0]
            self._seq_len = max(self._seq_len, ids.shape[-1])

    # -- hooks -------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        # A train() that ended by an exception never reached on_train_end (auto_find_batch_size retries after an
        # OOM, an interrupted notebook cell): drop its hook and profiler, or tokens would be counted twice.
        if self._hook is not None:
            self._hook.remove()
        if self._profile is not None and self._profile.running:
            self._profile.stop()
        self._reset()
        if self.stage is None:
            self.stage = getattr(args, "stage", None)
        self._cuda = torch.cuda.is_available() and args.device.type == "cuda"
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
            if not args.skip_memory_metrics:
                logger.warning(
                    "hf_apex: StageMetricsCallback resets CUDA peak-memory stats; Trainer memory metrics will be off."
                )
        if model is not None:
            self._shape = model_shape(model)
            self._hook = model.register_forward_pre_hook(torch.compiler.disable(self._count_batch), with_kwargs=True)
        inner = getattr(optimizer, "optimizer", optimizer)
        self._optimizer_class = type(inner).__name__ if inner is not None else None
        self._counts_at_start = KERNEL_COUNTER.snapshot()
        self._start_wall = time.time()

    def on_step_begin(self, args, state, control, **kwargs):
        self._tokens, self._positions, self._samples, self._seq_len = 0, 0, 0, 0
        self._run_steps += 1
        if self._cuda and self.profile_kernels and self._profile is None and self._run_steps == self._profiled_index():
            self._profile = KernelProfile().start()
        start = torch.cuda.Event(enable_timing=True) if self._cuda else time.perf_counter()
        if self._cuda:
            start.record()
        self._open = _Step(state.global_step + 1, start, None, 0, 0, 0, 0, index=self._run_steps)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        step = self._open
        if step is None:
            return
        self._open = None
        if self._cuda:
            step.end = torch.cuda.Event(enable_timing=True)
            step.end.record()
        else:
            step.end = time.perf_counter()
        step.tokens, step.positions = self._tokens, self._positions
        step.samples, step.seq_len = self._samples, self._seq_len
        step.skipped = bool(getattr(optimizer, "step_was_skipped", False))
        if self._profile is not None and self._profile.running:
            self.kernels_verified = self._profile.stop()
        self._pending.append(step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        # ApexTrainer has already merged (and emptied) this window into the training log; with a stock Trainer
        # nothing reads it, so resolve the events at the Trainer's own sync point and keep memory bounded.
        if logs and "loss" in logs:
            self._resolve()
            self._window.clear()

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._resolve()
        summary = self.summary(args, state)  # a collective under DDP: every rank takes part
        if state.is_world_process_zero:
            path = write_metrics_file(args.output_dir, summary)
            logger.info("hf_apex: stage metrics written to %s", path)

    # -- reporting ---------------------------------------------------------------------------------------
    def _profiled_index(self) -> int:
        # Profile the last warm-up step of this train() call: it is excluded from the timings anyway.
        return max(self.warmup_steps, 1)

    def _resolve(self) -> None:
        """Turn recorded events into milliseconds and token counts into ints (one sync, at report time)."""
        if not self._pending:
            return
        if self._cuda:
            self._pending[-1].end.synchronize()
        for s in self._pending:
            s.ms = s.start.elapsed_time(s.end) if self._cuda else (s.end - s.start) * 1e3
            s.tokens = int(s.tokens)
        self.steps.extend(self._pending)
        self._window.extend(self._pending)
        self._pending = []

    @staticmethod
    def _across_ranks(steps: list[_Step]) -> list[_Step]:
        """Under torch.distributed, one row per step for the whole job: the slowest rank's time, the sum of
        tokens, positions and samples. (A collective: every rank must call it at the same point.)"""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return steps
        mine = [(s.step, s.ms, int(s.tokens), s.positions, s.samples, s.seq_len, s.skipped, s.index) for s in steps]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        merged = []
        for rows in zip(*gathered):
            step, *_ = rows[0]
            merged.append(
                _Step(
                    step,
                    None,
                    None,
                    sum(r[2] for r in rows),
                    sum(r[3] for r in rows),
                    sum(r[4] for r in rows),
                    max(r[5] for r in rows),
                    any(r[6] for r in rows),
                    max(r[1] for r in rows),
                    rows[0][7],
                )
            )
        return merged

    def _rates(self, steps: list[_Step]) -> dict:
        secs = sum(s.ms for s in steps) / 1e3
        tokens = sum(s.tokens for s in steps)
        out = {
            "tokens_per_s": tokens / secs if secs else None,
            "samples_per_s": sum(s.samples for s in steps) / secs if secs else None,
        }
        # MFU counts the positions the GPU computed, padding included; tokens/s counts real tokens only.
        # Each step at its own sequence length (dynamic padding changes it); positions were summed over ranks.
        flops = [flops_per_token(self._shape, s.seq_len) if self._shape else None for s in steps]
        peak = self.resolved_peak_tflops()
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if peak and secs and flops and all(f is not None for f in flops):
            total = sum(f * (s.positions or int(s.tokens)) for f, s in zip(flops, steps))
            out["mfu"] = total / secs / (peak * 1e12 * world)
        else:
            out["mfu"] = None
        return out

    def resolved_peak_tflops(self) -> float | None:
        if self.peak_tflops:
            return self.peak_tflops
        return lookup_peak_tflops(torch.cuda.get_device_name()) if self._cuda else None

    def _memory(self) -> dict:
        if not self._cuda:
            return {"peak_memory_allocated_gib": None, "peak_memory_reserved_gib": None}
        return {
            "peak_memory_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "peak_memory_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        }

    def _memory_across_ranks(self) -> dict:
        """Peak memory of the busiest rank (a collective under torch.distributed)."""
        mem = self._memory()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mem)
            mem = {k: max((g[k] for g in gathered if g[k] is not None), default=None) for k in mem}
        return mem

    def pop_log_metrics(self) -> dict[str, float]:
        """Figures for the steps since the last call (time, throughput, MFU), the peak memory so far, and the
        apex/fallback call counts since training started; plain floats for ``Trainer.log``."""
        self._resolve()
        steps, self._window = self._across_ranks(self._window), []
        if not steps:
            return {}
        logs = {"step_time_ms": sum(s.ms for s in steps) / len(steps)}
        logs.update({k: v for k, v in self._rates(steps).items() if v is not None})
        logs.update({k: v for k, v in self._memory().items() if v is not None})
        counts = KERNEL_COUNTER.since(self._counts_at_start)
        for component, c in counts.items():
            logs[f"apex_calls/{component}"] = c["apex"]
            logs[f"fallback_calls/{component}"] = c["fallback"]
            if "torch" in c:
                logs[f"torch_calls/{component}"] = c["torch"]
        skipped = sum(s.skipped for s in self.steps)
        if skipped:
            logs["skipped_steps"] = skipped
        return {k: float(v) for k, v in logs.items()}

    def summary(self, args, state) -> dict:
        """The run summary written to the metrics JSON."""
        self._resolve()
        steps = self._across_ranks(self.steps)
        profiled = self._profiled_index() if self.kernels_verified is not None else None
        timed = [s for s in steps if s.index > self.warmup_steps and s.index != profiled]
        if not timed and steps:
            logger.warning("hf_apex: every step was a warm-up step; the summary times all %d steps.", len(steps))
            timed = [s for s in steps if s.index != profiled] or steps
        world = max(getattr(args, "world_size", 1), 1)
        counts = KERNEL_COUNTER.since(self._counts_at_start)
        losses = [{"step": h["step"], "loss": h["loss"]} for h in state.log_history if "loss" in h]
        peak = self.resolved_peak_tflops()
        return {
            "stage": self.stage,
            "model": {
                "class": self.extra.get("model_class"),
                "name_or_path": self.extra.get("model_name_or_path"),
                **self._shape,
            },
            "run": {
                # the batch that ran (auto_find_batch_size may have lowered the requested one)
                "per_device_train_batch_size": getattr(state, "train_batch_size", None)
                or args.per_device_train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "world_size": world,
                "seq_len": max((s.seq_len for s in steps), default=None),
                "steps": len(steps),
                "timed_steps": len(timed),
                "warmup_steps": self.warmup_steps,
                "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
                "tf32": args.tf32,
                "optimizer": self._optimizer_class,
                "torch_compile": bool(getattr(args, "torch_compile", False)),
                # The first step carries one-off costs: torch.compile, autotune, cuBLAS/allocator warm-up.
                "first_step_ms": steps[0].ms if steps else None,
                "seed": args.seed,
                "wall_time_s": time.time() - self._start_wall if self._start_wall else None,
            },
            "step_time_ms": percentiles([s.ms for s in timed]),
            **self._rates(timed),
            "peak_tflops": peak,
            "mfu_formula": "(6N + 12*L*d*T) * positions/s / peak; N: params without position or untied input "
            "embeddings); padding counted",
            **self._memory_across_ranks(),
            "skipped_steps": sum(s.skipped for s in steps),
            "loss": {"first": losses[0]["loss"] if losses else None, "last": losses[-1]["loss"] if losses else None},
            "loss_history": losses,
            "kernels": {"calls": counts, "profiled": self.kernels_verified, **self.extra.get("kernels", {})},
            "rewire": self.extra.get("rewire"),
            "autotune": autotune_report() if getattr(args, "autotune", False) else [],
            "steps_ms": [round(s.ms, 4) for s in steps],
            "provenance": provenance(),
        }
