"""The stage ladder: one registry row per stage, each changing one thing relative to the previous one.

``STAGES`` is the single source of truth for the ``--stage`` choices, the benchmark order and the switches
each stage sets on :class:`~hf_apex.ApexTrainingArguments`. Every stage keeps the same hyper-parameters and the
same maths; only the implementation changes.
"""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """What one stage switches on.

    Attributes:
        name: registry key, e.g. ``"fused_adam"``.
        summary: one line for tables and ``--help``.
        optimizer: ``"adamw_torch"`` (torch AdamW, foreach) or an apex optimizer (``"fused_adam"``).
        fused_norms: swap LayerNorm/RMSNorm for apex FusedLayerNorm/FusedRMSNorm.
        precision: ``"fp32"`` (strict: TF32 off) or ``"amp"`` (torch.amp autocast, BF16 unless FP16 is asked).
    """

    name: str
    summary: str
    optimizer: Literal["adamw_torch", "fused_adam"]
    fused_norms: bool
    precision: Literal["fp32", "amp"]


STAGES: dict[str, StageConfig] = {
    s.name: s
    for s in (
        StageConfig("baseline", "torch AdamW (foreach) + stock norms + strict FP32", "adamw_torch", False, "fp32"),
        StageConfig("fused_adam", "apex FusedAdam (AdamW mode) + FP32", "fused_adam", False, "fp32"),
        StageConfig("fused_adam_ln", "+ apex fused LayerNorm/RMSNorm", "fused_adam", True, "fp32"),
        StageConfig("fused_full", "+ torch.amp autocast (BF16, or FP16 + GradScaler)", "fused_adam", True, "amp"),
    )
}


def get_stage(name: str) -> StageConfig:
    try:
        return STAGES[name]
    except KeyError:
        raise ValueError(f"Unknown stage {name!r}; choose one of: {', '.join(STAGES)}") from None
