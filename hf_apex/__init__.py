"""hf_apex: train Hugging Face Transformers models with NVIDIA Apex fused kernels and mixed precision, and
see, stage by stage, what each one buys.

Importing ``hf_apex`` never imports apex; the public names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "ApexTrainer": "trainer",
    "ApexTrainingArguments": "training_args",
    "STAGES": "stages",
    "StageConfig": "stages",
    "StageRecipe": "stages",
    "StageMetricsCallback": "measure.callback",
    "StagePlan": "plan",
    "RewireReport": "kernels.models.surgery",
    "rewire": "kernels.models.surgery",
    "unrewire": "kernels.models.surgery",
    "with_stages": "compose",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:
    from .compose import with_stages
    from .kernels.models.surgery import RewireReport, rewire, unrewire
    from .measure.callback import StageMetricsCallback
    from .plan import StagePlan
    from .stages import STAGES, StageConfig, StageRecipe
    from .trainer import ApexTrainer
    from .training_args import ApexTrainingArguments


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_apex' has no attribute {name!r}")
