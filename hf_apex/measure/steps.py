"""Per-step records: a timer that costs no synchronisation, a counter of the real batch, and the rank merge.

Step times come from CUDA events recorded at the start and end of each optimizer step, read only when the
callback flushes (at a logging step); events go back to a pool once read. Tokens are counted on the device from
``attention_mask`` and copied to pinned host memory without blocking, before the step's end mark, so that they
can be read once the step's time can. Under torch.distributed, :func:`merge_ranks` turns each
rank's records into one row per step for the job, with fixed-size tensor reductions.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .. import distributed
from ..internals import cuda_graphs_recorded, dynamo_counters


@dataclasses.dataclass
class StepRecord:
    index: int  # 1-based position in this train() call (warm-up counts from here, not from a resumed step)
    step: int  # the Trainer's global step
    ms: float = 0.0
    tokens: int = 0  # real tokens (attention_mask), summed over ranks once merged
    positions: int = 0  # sequence positions computed, padding included (what MFU counts)
    samples: int = 0
    seq_len: int = 0
    skipped: bool = False  # the GradScaler skipped this optimizer step (FP16 overflow)


class StepTimer:
    """Marks at the start and end of each step: CUDA events on a GPU, ``perf_counter`` otherwise.

    A step's time is its whole cycle, from its start to the next step's start, so the host work between two
    optimizer steps (fetching the next batch, logging) counts: that is what a user waits for. Where something
    that is not training ran in between (evaluation, saving a checkpoint: :meth:`interrupt`), and for the last
    step, the time runs from the step's start to its end instead.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._steps: list[list] = []  # [start, end, interrupted]
        self._pool: list = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._steps.append([self._mark(), None, False])

    def stop(self) -> None:
        self._steps[-1][1] = self._mark()

    def interrupt(self) -> None:
        """Something that is not training ran after the last step: end its time at its own end mark."""
        if self._steps:
            self._steps[-1][2] = True

    def _elapsed(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def drain(self, final: bool = False) -> list[float]:
        """Milliseconds of the finished steps, in order (one sync on a GPU). A step whose successor has not
        started yet is kept for the next call, unless ``final``."""
        ready = [s for s in self._steps if s[1] is not None]
        if not final and ready and ready[-1] is self._steps[-1]:
            ready = ready[:-1]
        if not ready:
            return []
        nexts = self._steps[1 : len(ready) + 1] + [None]
        ends = [s[1] if (s[2] or nxt is None) else nxt[0] for s, nxt in zip(ready, nexts)]
        if self.cuda:
            ends[-1].synchronize()
        out = [self._elapsed(s[0], end) for s, end in zip(ready, ends)]
        self._steps = self._steps[len(ready) :]
        if self.cuda:  # events that no kept step refers to go back to the pool
            self._pool.extend(e for s in ready for e in s[:2])
        return out


class BatchCounter:
    """A forward pre-hook on the model that counts the training batch (tokens, positions, samples)."""

    def __init__(self):
        self.handle = None
        self._tokens: list = []  # per micro-batch: a 0-d device tensor (mask sum) or an int
        self._positions = self._samples = self._seq_len = 0
        self._given: int | None = None  # the next training forward's real tokens, counted on the host
        self.shapes: set[tuple[int, ...]] = set()  # the training batches' shapes (input ids)

    def attach(self, model: torch.nn.Module) -> None:
        self.detach()
        self.handle = model.register_forward_pre_hook(torch.compiler.disable(self._count), with_kwargs=True)

    def detach(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def give(self, tokens: int) -> None:
        """The next training forward's real tokens, counted on the host by the collator (``hf_apex.data``): a
        packed batch has no attention mask to count them from."""
        self._given = tokens

    def _count(self, module, args, kwargs) -> None:
        if not module.training:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if self._given is not None:
            self._tokens.append(self._given)
            self._given = None
        elif isinstance(mask, torch.Tensor):
            self._tokens.append(mask.sum())
        elif isinstance(ids, torch.Tensor):
            self._tokens.append(ids.numel())
        if isinstance(ids, torch.Tensor) and ids.ndim >= 2:
            self.shapes.add(tuple(ids.shape))
            self._positions += ids.numel()
            self._samples += ids.shape[0]
            self._seq_len = max(self._seq_len, ids.shape[-1])

    def take(self) -> tuple[list, int, int, int]:
        """This step's (token counts, positions, samples, longest sequence); starts the next step. Counts on a GPU
        are being copied to the host: they can be read once the step has finished."""
        tokens = [t for t in self._tokens if not isinstance(t, torch.Tensor)]
        counted = [t for t in self._tokens if isinstance(t, torch.Tensor)]
        if counted and counted[0].is_cuda:  # one copy per step, without blocking (read after the step's end mark)
            total = torch.stack(counted).sum() if len(counted) > 1 else counted[0]
            counted = [torch.empty((), dtype=total.dtype, pin_memory=True).copy_(total, non_blocking=True)]
        out = (tokens + counted, self._positions, self._samples, self._seq_len)
        self._tokens, self._positions, self._samples, self._seq_len = [], 0, 0, 0
        return out


def resolve_tokens(counts: list[list]) -> list[int]:
    """Per-step token totals from the ints and tensors each step took: on the host (GPU counts copied there,
    or CPU training) read as they are, on another device in one transfer."""
    on_device = [t for step in counts for t in step if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
    values = iter(torch.stack(on_device).tolist() if on_device else [])

    def value(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.item() if t.device.type == "cpu" else next(values)

    return [int(sum(value(t) for t in step)) for step in counts]


def merge_ranks(records: list[StepRecord], peak_memory: list[float]) -> tuple[list[StepRecord], list[float]]:
    """One record per step for the whole job: the slowest rank's time, tokens/positions/samples summed, and the
    busiest rank's peak memory. A collective when distributed (every rank calls it at the same step)."""
    if not distributed.is_distributed() or not records:
        return records, peak_memory
    sums = torch.tensor([[r.tokens, r.positions, r.samples] for r in records], dtype=torch.float64)
    maxes = torch.tensor([[r.ms, r.seq_len, float(r.skipped)] for r in records], dtype=torch.float64)
    sums = distributed.all_reduce(sums, "sum").tolist()
    flat = distributed.all_reduce(torch.cat([maxes.flatten(), torch.tensor(peak_memory, dtype=torch.float64)]), "max")
    maxes, peak = flat[: maxes.numel()].view(-1, 3).tolist(), flat[maxes.numel() :].tolist()
    merged = [
        StepRecord(r.index, r.step, ms, int(tok), int(pos), int(smp), int(seq), bool(skp))
        for r, (tok, pos, smp), (ms, seq, skp) in zip(records, sums, maxes)
    ]
    return merged, peak


def compiled_graphs() -> tuple[int, int]:
    """The graphs this process has compiled (Dynamo's count) and the CUDA graphs torch's cudagraph trees hold on the
    current GPU (0 without one)."""
    graphs = int(dynamo_counters()["stats"]["unique_graphs"])
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return graphs, 0
    return graphs, cuda_graphs_recorded(torch.cuda.current_device())
