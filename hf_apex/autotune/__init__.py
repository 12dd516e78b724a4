"""``auto``: time apex against torch for each component on this GPU, and use the faster.

An :class:`Autotuner` belongs to one ``ApexTrainer`` and decides once per run for each component: the optimizer
(over the model's parameter shapes), the norms and, with ``attention_backend="fastest"``, the SDPA backend. The
norms of a whole model are decided by timing the forward and backward of the first training batch with each
backend, because under autocast apex's norms return the autocast dtype where torch's return FP32, which only a
whole pass shows; a long run then checks that choice on whole training steps (:class:`NormTrial`), where the host's
share of a step shows. torch's op is the reference: a backend whose results differ from it beyond the tolerance of
the dtype is never chosen. The disk cache (:class:`DecisionCache`) is consulted before anything is measured.

The package, one concern a module: :mod:`.probes` (the timer and each component's candidates and parity check),
:mod:`.cache` (the disk cache and its environment key), :mod:`.trial` (the norms' trial on whole steps) and
:mod:`.tuner` (:class:`Autotuner` and its :class:`Decision`). Every clock a decision reads can be injected:
``Autotuner(timer=...)`` for the candidates, ``Autotuner(clock=...)`` (or ``NormTrial(clock=...)``) for the trial.
"""

from ..kernels.trace import APEX, TORCH
from .cache import STATE_FILE, DecisionCache, checkpoint_decisions, default_cache_path, environment_key, save_decisions
from .probes import (
    attention_probe,
    cuda_timer,
    norm_probe,
    optimizer_probe,
    passes_probe,
    rel_err,
    tolerance,
    training_pass,
)
from .trial import (
    TRIAL_BLOCK,
    TRIAL_MIN_STEPS,
    TRIAL_ORDER,
    TRIAL_STEPS,
    TRIAL_TIE,
    TRIAL_WARMUP,
    ClockSteps,
    NormTrial,
)
from .tuner import AUTOTUNE_PARAM_BYTES, TIMING_ROUNDS, Autotuner, Decision

__all__ = [
    "APEX",
    "AUTOTUNE_PARAM_BYTES",
    "STATE_FILE",
    "TIMING_ROUNDS",
    "TORCH",
    "TRIAL_BLOCK",
    "TRIAL_MIN_STEPS",
    "TRIAL_ORDER",
    "TRIAL_STEPS",
    "TRIAL_TIE",
    "TRIAL_WARMUP",
    "Autotuner",
    "ClockSteps",
    "Decision",
    "DecisionCache",
    "NormTrial",
    "attention_probe",
    "checkpoint_decisions",
    "cuda_timer",
    "default_cache_path",
    "environment_key",
    "norm_probe",
    "optimizer_probe",
    "passes_probe",
    "rel_err",
    "save_decisions",
    "tolerance",
    "training_pass",
]
