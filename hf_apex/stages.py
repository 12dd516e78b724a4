"""The stage ladder: one registry row per stage.

``STAGES`` is the single source of truth for the ``--stage`` choices, the benchmark order and the switches
each stage sets on :class:`~hf_apex.ApexTrainingArguments`. The seed's four stages come first, each changing
one thing relative to the previous one; the rungs after them go beyond the seed (torch's own fused kernels,
``torch.compile``, and ``auto``, which times apex against torch on your GPU). Every stage keeps the same
hyper-parameters and the same maths; only the implementation changes — except that under autocast apex's fused
norms compute in BF16 where torch's compute in FP32 (apex's own behaviour).
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
        optimizer: ``"adamw_torch"`` (torch AdamW, foreach), ``"adamw_torch_fused"`` (torch AdamW, fused=True)
            or ``"fused_adam"`` (apex FusedAdam, AdamW mode).
        fused_norms: swap LayerNorm/RMSNorm for apex FusedLayerNorm/FusedRMSNorm.
        precision: ``"fp32"`` (strict: TF32 off) or ``"amp"`` (torch.amp autocast, BF16 unless FP16 is asked).
        compile: ``torch.compile`` the model (norms stay torch ops inside the compiled graph).
        autotune: time apex against torch per component on this GPU and use the faster (see ``hf_apex.autotune``).
    """

    name: str
    summary: str
    optimizer: Literal["adamw_torch", "adamw_torch_fused", "fused_adam"]
    fused_norms: bool
    precision: Literal["fp32", "amp"]
    compile: bool = False
    autotune: bool = False


SEED_STAGES = ("baseline", "fused_adam", "fused_adam_ln", "fused_full")

STAGES: dict[str, StageConfig] = {
    s.name: s
    for s in (
        StageConfig("baseline", "torch AdamW (foreach) + stock norms + strict FP32", "adamw_torch", False, "fp32"),
        StageConfig("fused_adam", "apex FusedAdam (AdamW mode) + FP32", "fused_adam", False, "fp32"),
        StageConfig("fused_adam_ln", "+ apex fused LayerNorm/RMSNorm", "fused_adam", True, "fp32"),
        StageConfig("fused_full", "+ torch.amp autocast (BF16, or FP16 + GradScaler)", "fused_adam", True, "amp"),
        # Beyond the seed: what a user could run instead, and the fastest of both worlds.
        StageConfig("torch_fused", "torch AdamW(fused=True) + stock norms + BF16", "adamw_torch_fused", False, "amp"),
        StageConfig(
            "compiled",
            "torch fused AdamW + BF16 + torch.compile (native norms)",
            "adamw_torch_fused",
            False,
            "amp",
            compile=True,
        ),
        StageConfig(
            "auto",
            "BF16 + the faster of apex/torch per component, timed on this GPU",
            "fused_adam",
            True,
            "amp",
            autotune=True,
        ),
    )
}


def get_stage(name: str) -> StageConfig:
    try:
        return STAGES[name]
    except KeyError:
        raise ValueError(f"Unknown stage {name!r}; choose one of: {', '.join(STAGES)}") from None
