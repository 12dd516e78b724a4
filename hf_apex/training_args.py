"""``ApexTrainingArguments``: ``TrainingArguments`` plus the switches of the stage ladder."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from .optim import APEX_OPTIMIZERS
from .stages import STAGES, get_stage

_DEFAULT_OPTIM = next(f.default for f in dataclasses.fields(TrainingArguments) if f.name == "optim")


@dataclass
class ApexTrainingArguments(TrainingArguments):
    r"""
    Configuration for [`ApexTrainer`]: every [`~transformers.TrainingArguments`] field, plus the following.

    Parameters:
        > Parameters that choose a stage of the ladder

        stage (`str` or `None`, *optional*, defaults to `None`):
            One of `hf_apex.STAGES`: the seed's `baseline`, `fused_adam`, `fused_adam_ln`, `fused_full`, then
            `torch_fused`, `compiled` and `auto`. A stage sets `optim`, `apex_optimizer`, `apex_fused_norms`,
            `autotune`, `torch_compile`, `tf32` and the AMP flags; setting any of them to something the stage
            contradicts raises `ValueError`. `None` leaves every switch to you.
        amp_dtype (`str`, *optional*, defaults to `"bf16"`):
            Autocast dtype of stages with mixed precision: `"bf16"`, or `"fp16"` (with a GradScaler).

        > Parameters that switch apex components on individually

        apex_optimizer (`str`, *optional*, defaults to `"none"`):
            `"fused_adam"` (apex FusedAdam in AdamW mode), `"fused_lamb"` (apex FusedLAMB) or `"none"` (use `optim`).
        apex_optimizer_kwargs (`dict` or `str`, *optional*):
            Extra keyword arguments for the apex optimizer, e.g. `'{"max_grad_norm": 0}'` for FusedLAMB.
        apex_fused_norms (`bool`, *optional*, defaults to `False`):
            Swap `nn.LayerNorm` and the HF RMSNorms for apex FusedLayerNorm / FusedRMSNorm.
        apex_strict_kernels (`bool`, *optional*, defaults to `False`):
            Raise instead of falling back to the torch op when an apex kernel is missing or cannot run.
        autotune (`bool`, *optional*, defaults to `False`):
            For each apex component switched on, time apex against torch on this GPU (optimizer over the real
            parameter shapes; each norm type at its hidden size, token count and dtype), about a second of
            timing per decision, and use the faster; a backend that fails the parity check is never chosen.
            Decisions are cached in `autotune_cache` and written to the logs and the metrics JSON.
        autotune_cache (`str` or `None`, *optional*, defaults to `None`):
            Decision cache file; `None` means `$HF_APEX_CACHE` or `~/.cache/hf_apex/autotune.json`.

        > Parameters that control the stage metrics

        stage_metrics (`bool`, *optional*, defaults to `True`):
            Attach `StageMetricsCallback`: per-step time, tokens/s, MFU, peak memory and kernel counts in the
            logs, and a run summary in `<output_dir>/hf_apex_metrics.json`.
        metrics_warmup_steps (`int`, *optional*, defaults to `5`):
            Optimizer steps left out of the timing summary (compilation, allocator and cuBLAS warm-up).
        peak_tflops (`float` or `None`, *optional*, defaults to `None`):
            Peak dense TFLOP/s used for MFU; `None` looks the GPU up in `hf_apex.metrics.PEAK_TFLOPS`.
        profile_kernels (`bool`, *optional*, defaults to `True`):
            On CUDA, profile one warm-up step with `torch.profiler` and record which apex kernels executed.

    > [!NOTE]
    > A stage pins `optim` (`"adamw_torch"`, foreach, unless the stage uses torch's fused AdamW) and `tf32=False`;
    > without a stage the `TrainingArguments` defaults apply unchanged. An explicit `--optim` equal to the
    > transformers default (`adamw_torch_fused`) cannot be told from no `--optim`, so a stage overrides it.
    """

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + ["apex_optimizer_kwargs"]

    stage: str | None = field(
        default=None,
        metadata={
            "help": "Stage of the ladder; sets the apex and precision switches. "
            + "; ".join(f"{name}: {config.summary}" for name, config in STAGES.items()),
            "choices": list(STAGES),
        },
    )
    amp_dtype: str = field(
        default="bf16",
        metadata={
            "help": "Autocast dtype for mixed-precision stages (fp16 adds a GradScaler).",
            "choices": ["bf16", "fp16"],
        },
    )
    apex_optimizer: str = field(
        default="none",
        metadata={
            "help": "apex optimizer: fused_adam (AdamW mode), fused_lamb, or none.",
            "choices": list(APEX_OPTIMIZERS),
        },
    )
    apex_optimizer_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Extra apex optimizer kwargs as JSON, e.g. '{\"max_grad_norm\": 0}'."}
    )
    apex_fused_norms: bool = field(
        default=False, metadata={"help": "Swap LayerNorm/RMSNorm modules for apex FusedLayerNorm/FusedRMSNorm."}
    )
    apex_strict_kernels: bool = field(
        default=False, metadata={"help": "Raise instead of falling back to torch ops when an apex kernel cannot run."}
    )
    autotune: bool = field(
        default=False,
        metadata={"help": "Time apex against torch per component on this GPU and use the faster (cached on disk)."},
    )
    autotune_cache: str | None = field(
        default=None,
        metadata={"help": "Autotune decision cache (default $HF_APEX_CACHE or ~/.cache/hf_apex/autotune.json)."},
    )
    stage_metrics: bool = field(
        default=True, metadata={"help": "Record per-step stage metrics and write <output_dir>/hf_apex_metrics.json."}
    )
    metrics_warmup_steps: int = field(
        default=5, metadata={"help": "Optimizer steps excluded from the timing summary."}
    )
    peak_tflops: float | None = field(
        default=None, metadata={"help": "Peak dense TFLOP/s for MFU (default: looked up from the GPU name)."}
    )
    profile_kernels: bool = field(
        default=True, metadata={"help": "On CUDA, profile one warm-up step to record which apex kernels ran."}
    )

    def __post_init__(self):
        # Stage switches must be set before super().__post_init__(): it derives mixed precision and TF32 from them.
        if self.stage is not None:
            self._apply_stage()
        super().__post_init__()
        if self.apex_optimizer not in APEX_OPTIMIZERS:
            raise ValueError(f"apex_optimizer must be one of {APEX_OPTIMIZERS}, got {self.apex_optimizer!r}")
        if self.metrics_warmup_steps < 0:
            raise ValueError(f"metrics_warmup_steps must be >= 0, got {self.metrics_warmup_steps}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"peak_tflops must be positive, got {self.peak_tflops}")

    def _apply_stage(self) -> None:
        stage = get_stage(self.stage)

        def conflict(what: str) -> ValueError:
            return ValueError(
                f"stage={stage.name!r} ({stage.summary}) contradicts {what}; drop it or pick another stage."
            )

        if self.amp_dtype not in ("bf16", "fp16"):
            raise ValueError(f"amp_dtype must be 'bf16' or 'fp16', got {self.amp_dtype!r}")
        stage_optim = stage.optimizer if stage.optimizer.startswith("adamw_torch") else "adamw_torch"
        optim = getattr(self.optim, "value", self.optim)
        if optim not in (_DEFAULT_OPTIM, stage_optim):
            raise conflict(f"optim={optim!r}")
        if self.torch_compile and not stage.compile:
            raise conflict("torch_compile=True")
        if self.autotune and not stage.autotune:
            raise conflict("autotune=True")
        if self.tf32:
            raise conflict("tf32=True (stages keep FP32 matmuls strict)")
        want_apex_opt = stage.optimizer if stage.optimizer == "fused_adam" else "none"
        if self.apex_optimizer not in ("none", want_apex_opt):
            raise conflict(f"apex_optimizer={self.apex_optimizer!r}")
        if self.apex_fused_norms and not stage.fused_norms:
            raise conflict("apex_fused_norms=True")
        if stage.precision == "fp32" and (self.bf16 or self.fp16):
            raise conflict("bf16/fp16 (this stage is FP32)")
        if stage.precision == "amp":
            if self.bf16 and self.fp16:
                raise conflict("bf16=True together with fp16=True")
            if self.bf16 and self.amp_dtype == "fp16":
                raise conflict("bf16=True with amp_dtype='fp16'")
            if self.fp16:
                self.amp_dtype = "fp16"

        self.optim = stage_optim
        self.apex_optimizer = want_apex_opt
        self.apex_fused_norms = stage.fused_norms
        self.autotune = stage.autotune
        self.torch_compile = stage.compile
        self.tf32 = False
        if stage.precision == "amp":
            self.bf16 = self.amp_dtype == "bf16"
            self.fp16 = self.amp_dtype == "fp16"
