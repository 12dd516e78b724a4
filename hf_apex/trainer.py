"""``ApexTrainer``: the stock ``Trainer`` with apex kernels plugged in and stage metrics recorded.

Override points for subclasses (each calls ``super()`` and can be replaced alone):

- ``rewire_model(model)``: the norm surgery applied to the model given to ``__init__`` and to every model
  ``model_init`` produces (the Trainer re-creates it in ``train()``), before any DDP or compile wrapping.
- ``get_optimizer_cls_and_kwargs(args, model)``: apex FusedAdam/FusedLAMB when ``args.apex_optimizer`` asks.
- ``create_stage_metrics_callback()``: the ``StageMetricsCallback`` attached when ``args.stage_metrics``.
- ``train()``: starts a new autotune run (``args.autotune``), so the metrics report this run's decisions.
- ``log(logs, start_time)``: merges the stage metrics of the current logging window into every log.

With plain ``TrainingArguments`` it behaves exactly like ``Trainer``.
"""

from __future__ import annotations

import logging
import os

from torch import nn
from transformers import Trainer

from .autotune import configure_autotuner
from .callbacks import StageMetricsCallback
from .import_utils import APEX_BUILD_HINT, is_fused_adam_available, is_fused_norm_available
from .norms import is_swapped
from .optim import apex_optimizer_cls_and_kwargs
from .surgery import RewireReport, rewire, unrewire
from .training_args import ApexTrainingArguments

logger = logging.getLogger("hf_apex")


def _uses_fsdp(args) -> bool:
    return bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def validate_apex_args(args: ApexTrainingArguments) -> None:
    """Refuse, before training, combinations that cannot work (clear ``ValueError`` naming the fix)."""
    if args.apex_optimizer != "none" and _uses_fsdp(args):
        raise ValueError(
            f"apex_optimizer={args.apex_optimizer!r} cannot run under FSDP/FSDP2: apex's fused optimizers have no "
            "DTensor support. Use DDP, or keep FSDP with optim='adamw_torch_fused' (stage=None)."
        )
    if args.apex_optimizer == "fused_lamb" and not is_fused_adam_available():
        raise ValueError(
            f"apex_optimizer='fused_lamb' needs apex's amp_C kernels (no torch fallback). {APEX_BUILD_HINT}"
        )
    if args.apex_strict_kernels:
        if args.apex_fused_norms and args.torch_compile:
            raise ValueError(
                "apex_strict_kernels=True with apex_fused_norms and torch_compile: under torch.compile the swapped "
                "norms run the torch op inside the graph, not apex's kernel. Drop one of the three."
            )
        missing = []
        if args.apex_optimizer != "none" and not is_fused_adam_available():
            missing.append("amp_C (FusedAdam/FusedLAMB)")
        if args.apex_fused_norms and not is_fused_norm_available():
            missing.append("fused_layer_norm_cuda (fused norms)")
        if missing:
            raise ValueError(
                f"apex_strict_kernels=True but these apex kernels are missing: {', '.join(missing)}. {APEX_BUILD_HINT}"
            )
        if args.device.type != "cuda" and (args.apex_optimizer != "none" or args.apex_fused_norms):
            raise ValueError(f"apex_strict_kernels=True needs a CUDA device; training would run on {args.device}.")


class ApexTrainer(Trainer):
    """A ``Trainer`` that applies the apex switches of :class:`ApexTrainingArguments` (see module docstring)."""

    rewire_report: RewireReport | None = None
    stage_metrics: StageMetricsCallback | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, ApexTrainingArguments):
            return
        validate_apex_args(self.args)
        if self.args.autotune:
            configure_autotuner(self.args.autotune_cache)
        if self.model_init is None and self.rewire_report is None:
            self.rewire_report = self.rewire_model(self.model)
        if self.args.apex_fused_norms and self.args.torch_compile:
            logger.warning(
                "hf_apex: torch_compile is on, so the swapped norms run the torch op inside the compiled graph, "
                "not apex's kernel (apex's own modules do the same). This is recorded in the metrics JSON."
            )
        if self.args.stage_metrics:
            self.stage_metrics = self.create_stage_metrics_callback()
            self.add_callback(self.stage_metrics)

    def train(self, *args, **kwargs):
        if isinstance(self.args, ApexTrainingArguments) and self.args.autotune:
            # Before the optimizer is created: this run's decisions (optimizer, norms) are the ones reported.
            configure_autotuner(self.args.autotune_cache).begin_run()
        return super().train(*args, **kwargs)

    # Re-apply the surgery to every model model_init builds (Trainer re-creates the model in train()).
    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        if isinstance(self.args, ApexTrainingArguments):
            self.rewire_report = self.rewire_model(model)
            if self.stage_metrics is not None:
                self.stage_metrics.extra["rewire"] = self.rewire_report.to_dict() if self.rewire_report else None
        return model

    def rewire_model(self, model: nn.Module) -> RewireReport | None:
        """Swap norms for apex fused norms when ``args.apex_fused_norms``; returns the report (or None)."""
        if not self.args.apex_fused_norms:
            if any(is_swapped(m) for m in model.modules()):  # rewire() works in place: a model reused from an
                # earlier fused-norm run must not carry apex norms into a stage that has none
                logger.warning("hf_apex: apex_fused_norms is off; restoring the stock norms of the rewired model.")
                unrewire(model)
            return None
        report = rewire(model, strict_kernels=self.args.apex_strict_kernels, autotune=self.args.autotune)
        if report.num_swapped == 0:
            logger.warning("hf_apex: apex_fused_norms is on but no norm of %s could be swapped.", type(model).__name__)
        return report

    # transformers >= 5.8 has no `adamw_apex_fused`: apex optimizers come in through this hook.
    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None):
        if isinstance(args, ApexTrainingArguments) and args.apex_optimizer != "none":
            return apex_optimizer_cls_and_kwargs(args, model)
        return Trainer.get_optimizer_cls_and_kwargs(args, model)

    def create_stage_metrics_callback(self) -> StageMetricsCallback:
        model = self.model
        kernels = (
            {"norms_under_torch_compile": "torch op"} if self.args.apex_fused_norms and self.args.torch_compile else {}
        )
        return StageMetricsCallback(
            stage=self.args.stage,
            warmup_steps=self.args.metrics_warmup_steps,
            peak_tflops=self.args.peak_tflops,
            profile_kernels=self.args.profile_kernels,
            extra={
                "model_class": type(model).__name__ if model is not None else None,
                "model_name_or_path": getattr(getattr(model, "config", None), "_name_or_path", None) or None,
                "rewire": self.rewire_report.to_dict() if self.rewire_report else None,
                "kernels": kernels,
            },
        )

    # Merge the stage metrics into the logs before Trainer.log copies them to log_history and the integrations.
    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self.stage_metrics is not None and "loss" in logs:
            logs.update(self.stage_metrics.pop_log_metrics())
        super().log(logs, *args, **kwargs)
