"""The norms' trial: the backend that timed forward and backward passes chose, checked on whole training steps,
where the host's share of a step shows."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from ..kernels.trace import APEX, TORCH
from ..measure.steps import StepTimer

TRIAL_BLOCK = 4  # optimizer steps per block of the norms' trial on whole training steps (NormTrial)
TRIAL_ORDER = (0, 1, 1, 0)  # its blocks: the passes' choice, the other backend, the other, the passes' choice
TRIAL_MIN_STEPS = 64  # a run with fewer optimizer steps keeps the passes' choice (the trial would be too much of it)
TRIAL_STEPS = TRIAL_BLOCK * len(TRIAL_ORDER)
TRIAL_WARMUP = TRIAL_STEPS + 2  # warm-up of a run with a trial: the passes' step, the trial's, the profiled one after
# The trial's backends tie when their median steps differ by less than this fraction of the faster one's (or by less
# than the steps' own spread, NormTrial.tied): a tie decides this run only and is not cached.
TRIAL_TIE = 0.01


class ClockSteps(StepTimer):
    """A :class:`StepTimer` whose marks are read from ``clock`` (seconds), on any device: the trial's steps timed
    by a clock the caller gives (a test's, which moves only when the test says so)."""

    def __init__(self, clock: Callable[[], float]):
        super().__init__(cuda=False)
        self.clock = clock

    def _mark(self) -> float:
        return self.clock()


class NormTrial:
    """The norms' decision checked on whole training steps, after :meth:`Autotuner.choose_norms` timed forward and
    backward alone.

    Those passes measure the device well, but not the host work of the rest of a step (optimizer, clipping, the
    Trainer's own), and where a step is host-bound that decides: the faster passes can make the slower steps. So the
    next optimizer steps run in blocks of :data:`TRIAL_BLOCK`, the passes' choice and the other backend in turns
    (:data:`TRIAL_ORDER`), timed as the stage metrics time steps (start to next start, CUDA events on a GPU and
    ``perf_counter`` otherwise, one sync at the end), or by ``clock`` (seconds) where one is given. Each block's
    first step, the switch, is left out; the backend with the lower median step stays for the rest of the run.
    Where the steps cannot tell the two apart (:meth:`tied`), that choice holds for this run only: it is not
    cached, and the next run checks again.
    """

    def __init__(
        self,
        key: dict,
        passes,
        switch: Callable[[str], None],
        cuda: bool,
        after: int | None = None,
        clock: Callable[[], float] | None = None,
    ):
        self.key, self.passes, self.switch = key, passes, switch
        first = passes.backend
        pair = (first, TORCH if first == APEX else APEX)
        self.plan = [pair[i] for i in TRIAL_ORDER for _ in range(TRIAL_BLOCK)]  # TRIAL_STEPS long
        self.timer = StepTimer(cuda) if clock is None else ClockSteps(clock)
        self._begun = 0  # planned steps started
        self._step = after  # the optimizer step whose micro-batches run now (the passes' step, to begin with)
        self._dropped: set[int] = set()  # planned steps during which something else ran (evaluation, a save)
        self._times: list[float] | None = None  # the planned steps' milliseconds, read once (one sync)

    def interrupt(self) -> None:
        """Something that is not training runs now (evaluation, a checkpoint): the step in progress is left out."""
        if self._begun:
            self._dropped.add(self._begun - 1)

    def begin(self, step: int) -> bool:
        """A micro-batch of optimizer step ``step`` (the steps done before it) starts. True once every planned
        step has run: the trial is ready to decide."""
        if step == self._step:
            return False  # another micro-batch of the same optimizer step
        self._step = step
        if self._begun:
            self.timer.stop()
        if self._begun == len(self.plan):
            return True
        backend = self.plan[self._begun]
        if self._begun and backend != self.plan[self._begun - 1]:
            self.switch(backend)
        self._begun += 1
        self.timer.start()
        return False

    def kept(self) -> dict[str, list[float]]:
        """Each backend's steps in milliseconds, each block's first step and interrupted steps left out (one sync on
        a GPU, at the first call). A backend left with no step is left out."""
        if self._times is None:
            self._times = self.timer.drain(final=True)
        kept: dict[str, list[float]] = {name: [] for name in dict.fromkeys(self.plan)}
        for i, (backend, ms) in enumerate(zip(self.plan, self._times)):
            if i % TRIAL_BLOCK and i not in self._dropped:
                kept[backend].append(ms)
        return {name: times for name, times in kept.items() if times}

    def medians(self) -> dict[str, float]:
        """Each backend's median step in milliseconds (of :meth:`kept`)."""
        return {name: statistics.median(times) for name, times in self.kept().items()}

    def tied(self) -> bool:
        """Whether the steps cannot tell the two backends apart: their medians differ by less than
        :data:`TRIAL_TIE` of the faster one's, or by less than the steps' own spread (each backend's median
        absolute deviation from its median, the larger of the two). Where a step waits on a host whose speed
        changes for tens of steps at a time, all of the trial's steps can fall in one slow stretch, in which both
        backends take the same time."""
        kept, medians = self.kept(), self.medians()
        if len(kept) < 2:
            return False
        spread = max(statistics.median([abs(ms - medians[name]) for ms in times]) for name, times in kept.items())
        fast, slow = sorted(medians.values())
        return slow - fast < max(TRIAL_TIE * fast, spread)
