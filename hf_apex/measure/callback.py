"""``StageMetricsCallback``: what a stage does to step time, throughput, MFU and memory, step by step.

Works with the stock ``Trainer`` (it writes ``<output_dir>/hf_apex_metrics.json``) and with ``ApexTrainer``,
which also merges the per-window figures into ``Trainer.log`` so every ``report_to`` integration sees them.

Measuring makes the host wait for no step that is still running: CUDA events mark each optimizer step (its time is
the whole cycle to the next step's start, see :class:`~hf_apex.measure.steps.StepTimer`), tokens are counted on the
device and copied to the host without blocking, and both are read at logging steps, at the latest every
``FLUSH_EVERY`` steps, up to the step before (whose successor has started: the wait is for that step, while the
current one runs). So a logged window holds the steps up to the one before the logging step. Under
torch.distributed the ranks are merged there too, at a step every rank runs, with fixed-size tensor reductions;
``Trainer.log`` itself stays local.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from transformers import TrainerCallback

from .. import distributed
from ..kernels import trace
from .flops import lookup_peak_tflops, model_shape
from .report import GIB, process_age_s, rates, run_summary, summary_lines, write_metrics_file
from .steps import BatchCounter, StepRecord, StepTimer, compiled_graphs, merge_ranks, resolve_tokens

logger = logging.getLogger("hf_apex")


def say(lines: list[str]) -> None:
    """The end-of-run lines: at INFO where the ``hf_apex`` logger takes it (recipes/finetune.py, a script that set
    up logging); else printed, as the Trainer prints its own end-of-training metrics: a script that never touched
    logging sees them too."""
    for line in lines:
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s", line)
        else:
            print(line, flush=True)  # noqa: T201 (the console is the point)


class StageMetricsCallback(TrainerCallback):
    """Per-step stage metrics and the run's metrics JSON.

    Args:
        stage (`str`, *optional*): stage name written into the JSON (read from `args.stage` when absent).
        warmup_steps (`int`, *optional*, defaults to 5): optimizer steps left out of the summary.
        peak_tflops (`float`, *optional*): peak dense TFLOP/s for MFU; looked up from the GPU name when `None`.
        profile_kernels (`bool`, *optional*, defaults to `True`): profile one warm-up step on CUDA and record
            the apex kernels that executed.
        extra (`dict` or `callable`, *optional*): more sections for the JSON, or a function returning them at
            the end of training (``ApexTrainer`` passes the rewire report and the autotune decisions).
    """

    FLUSH_EVERY = 256  # steps between reads of the events when nothing is logged (bounds memory, one sync)

    def __init__(self, stage=None, warmup_steps=5, peak_tflops=None, profile_kernels=True, extra=None):
        self.stage = stage
        self.warmup_steps = warmup_steps
        self.peak_tflops = peak_tflops
        self.profile_kernels = profile_kernels
        self.extra = extra or {}
        self._counter = BatchCounter()
        self._profile: trace.KernelProfile | None = None
        self._reset(cuda=False)

    @classmethod
    def for_args(cls, args, extra=None) -> StageMetricsCallback:
        """The callback an :class:`~hf_apex.ApexTrainingArguments` run asks for (``metrics_warmup_steps``,
        ``peak_tflops``, ``profile_kernels``)."""
        return cls(args.stage, args.metrics_warmup_steps, args.peak_tflops, args.profile_kernels, extra)

    def _reset(self, cuda: bool) -> None:
        self.steps: list[StepRecord] = []  # resolved (and merged over ranks) records of this train() call
        self._window: list[StepRecord] = []  # resolved records not yet logged
        self._pending: list[tuple[StepRecord, list]] = []  # stopped steps whose events are not read yet
        self._timer = StepTimer(cuda)
        self._cuda = cuda
        self._index = 0
        self._peak_memory: list[float] | None = None
        self.last_summary: dict | None = None  # the summary this train() call wrote (the main process)
        self._model = self._optimizer = None
        self._calls_at_start: dict = {}
        self._shape: dict = {}
        self._started: float | None = None
        self._first_step_at: float | None = None  # host time when the first step began
        self._startup_s: float | None = None
        self._warmup_floor = 0  # this run's warm-up lasts this long at least (hold_warmup)
        self._graphs_at_start = compiled_graphs()  # (reset with the run: graphs compiled and recorded before it)
        self.kernels_verified: dict | None = None

    # -- hooks ---------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        # A train() that raised never reached on_train_end (auto_find_batch_size retrying after an OOM, an
        # interrupted notebook cell): drop its hook and profiler, or tokens would be counted twice.
        self._counter.detach()
        self._counter.shapes.clear()
        self._close_profile()
        self._reset(cuda=torch.cuda.is_available() and args.device.type == "cuda")
        self.stage = self.stage or getattr(args, "stage", None)
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
        if model is not None:
            self._model, self._shape = model, model_shape(model)
            self._counter.attach(model)
        self._optimizer = optimizer
        self._calls_at_start = trace.collect(model, optimizer)
        self._started = time.time()
        self._startup_s = process_age_s()

    def on_step_begin(self, args, state, control, **kwargs):
        self._index += 1
        if self._first_step_at is None:
            self._first_step_at = time.time()
        if self._cuda and self.profile_kernels and self._profile is None and self._index == self._profiled_index():
            self._profile = trace.KernelProfile().start()
        self._timer.start()

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        tokens, positions, samples, seq_len = self._counter.take()  # (their copy to the host before the end mark)
        self._timer.stop()
        skipped = bool(getattr(optimizer, "step_was_skipped", False))
        record = StepRecord(self._index, state.global_step, 0.0, 0, positions, samples, seq_len, skipped)
        self._pending.append((record, tokens))
        if self._profile is not None and self._profile.running:
            self.kernels_verified = self._profile.stop()
        if state.global_step >= state.max_steps and args.logging_strategy != "no":
            control.should_log = True  # every run logs its last step, however short, so its losses are kept
        if control.should_log or len(self._pending) >= self.FLUSH_EVERY:
            self._flush()
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_log:  # logging_strategy="epoch": the Trainer logs after this, at a point every rank runs
            self._flush()

    # Evaluation and checkpoints are not training: the step before them ends at its own end mark.
    def on_evaluate(self, args, state, control, **kwargs):
        self._timer.interrupt()

    def on_save(self, args, state, control, **kwargs):
        self._timer.interrupt()

    def on_log(self, args, state, control, logs=None, **kwargs):
        # ApexTrainer has already merged (and emptied) this window into the log; with a stock Trainer nothing
        # reads it, so drop it here to keep memory bounded.
        if logs and "loss" in logs:
            self._window = self._from_step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self._counter.detach()
        self._close_profile()  # (CUPTI detached at the step after the profiled one)
        self._flush(final=True)  # a collective under DDP: every rank takes part
        self._window.clear()  # no log follows: the summary holds these steps
        if state.is_world_process_zero:
            summary = self.last_summary = self.summary(args, state)
            path = write_metrics_file(args.output_dir, summary)
            say([*summary_lines(summary), f"hf_apex: stage metrics written to {path}"])

    def _close_profile(self) -> None:
        if self._profile is not None:
            if self._profile.running:
                self._profile.stop()
            self._profile.close()
        self._profile = None

    def hold_warmup(self, steps: int) -> None:
        """This run's warm-up lasts ``steps`` at least (autotune's trial on whole steps). A profile already running
        is dropped, so that the run's last warm-up step is the one profiled."""
        self._warmup_floor = steps
        if self._profile is not None and self._index < self._warmup():
            self._close_profile()

    # -- reading -------------------------------------------------------------------------------------------
    def _warmup(self) -> int:
        return max(self.warmup_steps, self._warmup_floor)

    def _profiled_index(self) -> int:
        # Profile the last warm-up step of this train() call: it is excluded from the timings anyway.
        return max(self._warmup(), 1)

    def _flush(self, final: bool = False) -> None:
        """Read the finished steps (one sync), merge the ranks, and append them to the run and the window. The
        step just ended waits for the next one to start (its time runs to there), unless ``final``."""
        ms = self._timer.drain(final)
        if not ms:
            return
        done, self._pending = self._pending[: len(ms)], self._pending[len(ms) :]
        tokens = resolve_tokens([t for _, t in done])
        records = [dataclasses.replace(r, ms=m, tokens=n) for (r, _), m, n in zip(done, ms, tokens)]
        peak = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()] if self._cuda else []
        records, peak = merge_ranks(records, peak)
        self._peak_memory = peak or None
        self.steps.extend(records)
        self._window.extend(records)

    def resolved_peak_tflops(self) -> float | None:
        if self.peak_tflops:
            return self.peak_tflops
        return lookup_peak_tflops(torch.cuda.get_device_name()) if self._cuda else None

    def _batches(self, args) -> dict:
        """The shapes the run trained on and, where it compiles, the graphs compiled and CUDA graphs recorded."""
        out = {"shapes_trained": [list(s) for s in self.batch_shapes]}
        if getattr(args, "torch_compile", False):
            (graphs, cuda_graphs), (graphs_0, cuda_graphs_0) = compiled_graphs(), self._graphs_at_start
            out["compiled_graphs"], out["cuda_graphs"] = graphs - graphs_0, max(cuda_graphs - cuda_graphs_0, 0)
        return out

    def count_real_tokens(self, tokens: int) -> None:
        """The next training micro-batch's real tokens, counted on the host (a packed batch's: ``hf_apex.data``)."""
        self._counter.give(tokens)

    @property
    def batch_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of this run's training batches (input ids), shortest first."""
        return sorted(self._counter.shapes)

    def calls(self) -> dict:
        """apex / fallback / torch call counts of this run, per component."""
        return trace.calls_since(trace.collect(self._model, self._optimizer), self._calls_at_start)

    def _from_step(self, step: int) -> list[StepRecord]:
        # A log read one step late (ApexTrainer's, see HostCopy) finds its logging step's record read already: that
        # one belongs to the next window, as it would have without the delay.
        return [r for r in self._window if r.step >= step]

    def pop_log_metrics(self, step: int | None = None, calls: dict | None = None) -> dict[str, float]:
        """Figures for the steps of the window before ``step`` (the logging step; None: all of them): time,
        throughput, MFU; the peak memory so far and the call counts since training started (``calls``: those
        counted at the logging step, for a log written later); plain floats for ``Trainer.log``. Local: no
        collective."""
        later = self._from_step(step) if step is not None else []
        steps, self._window = self._window[: len(self._window) - len(later)], later
        if not steps:
            return {}
        logs = {"step_time_ms": sum(r.ms for r in steps) / len(steps)}
        world = distributed.world_size()
        logs.update({k: v for k, v in rates(steps, self._shape, self.resolved_peak_tflops(), world).items() if v})
        if self._peak_memory:
            logs["peak_memory_allocated_gib"] = self._peak_memory[0] / GIB
            logs["peak_memory_reserved_gib"] = self._peak_memory[1] / GIB
        for component, c in (calls if calls is not None else self.calls()).items():
            logs[f"apex_calls/{component}"] = c["apex"]
            logs[f"fallback_calls/{component}"] = c["fallback"]
            if "torch" in c:
                logs[f"torch_calls/{component}"] = c["torch"]
        skipped = sum(r.skipped for r in self.steps)
        if skipped:
            logs["skipped_steps"] = skipped
        return {k: float(v) for k, v in logs.items()}

    def summary(self, args, state) -> dict:
        """The run summary written to the metrics JSON."""
        profiled = self._profiled_index() if self.kernels_verified is not None else None
        timed = [r for r in self.steps if r.index > self._warmup() and r.index != profiled]
        if not timed and self.steps:
            logger.warning("hf_apex: every step was a warm-up step; the summary times all %d steps.", len(self.steps))
            timed = [r for r in self.steps if r.index != profiled] or self.steps
        sections = dict(self.extra() if callable(self.extra) else self.extra)
        sections["batches"] = {**sections.get("batches", {}), **self._batches(args)}
        model = self._model
        sections.setdefault("model", {})
        sections["model"] = {
            "class": type(model).__name__ if model is not None else None,
            "name_or_path": getattr(getattr(model, "config", None), "name_or_path", None) or None,
            "parameters": sum(p.numel() for p in model.parameters()) if model is not None else None,
            **sections["model"],
        }
        inner = getattr(self._optimizer, "optimizer", self._optimizer)
        return run_summary(
            stage=self.stage,
            args=args,
            state=state,
            records=self.steps,
            timed=timed,
            shape=self._shape,
            peak_tflops=self.resolved_peak_tflops(),
            peak_memory=self._peak_memory,
            calls=self.calls(),
            profiled=self.kernels_verified,
            optimizer=type(inner).__name__ if inner is not None else None,
            started=self._started,
            before_first_step_s=self._first_step_at - self._started if self._first_step_at and self._started else None,
            sections=sections,
            startup_s=self._startup_s,
        )
