"""``ApexTrainingArguments``: ``TrainingArguments`` plus the switches of the stage ladder."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers import TrainingArguments
from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

from .data import LAYOUTS
from .internals import compile_mode_options, valid_dict_fields
from .kernels.models.attention import CHOICES as ATTENTION_CHOICES
from .kernels.trace import APEX, TORCH
from .stages import APEX_OPTIMIZERS, STAGES, StageRecipe, get_stage

logger = logging.getLogger("hf_apex")

# A later micro-batch's replay overwrites the earlier one's graph outputs (its gradients among them).
GRAPHS_CANNOT_ACCUMULATE = (
    "in torch's CUDA graph trees cannot accumulate gradients over micro-batches (a later micro-batch's replay "
    "overwrites the outputs of the earlier one's: pytorch/pytorch#169545)"
)


def mode_records_cuda_graphs(mode: str | None) -> bool:
    """Whether ``torch.compile(mode=mode)`` records CUDA graphs (Inductor's cudagraph trees), as torch's own table of
    what each mode sets says."""
    return bool(mode) and bool(compile_mode_options(mode).get("triton.cudagraphs"))


# torch.compile's backend that runs the traced graphs' own kernels under CUDA graphs (cudagraph trees, as the modes
# above), without Inductor's code generation.
CUDA_GRAPHS_BACKEND = "cudagraphs"


def _graph_setting(args) -> str | None:
    """The setting of ``args`` that records CUDA graphs, as ``name=value`` (None when none does)."""
    if getattr(args, "torch_compile_backend", None) == CUDA_GRAPHS_BACKEND:
        return f"torch_compile_backend={CUDA_GRAPHS_BACKEND!r}"
    if mode_records_cuda_graphs(args.torch_compile_mode):
        return f"torch_compile_mode={args.torch_compile_mode!r}"
    return None


def refuse_accumulation_under_cuda_graphs(args) -> None:
    """A ``ValueError`` for a run that would accumulate gradients over micro-batches under CUDA graphs."""
    setting = _graph_setting(args) if args.gradient_accumulation_steps > 1 else None
    if setting:
        raise ValueError(
            f"{setting} records CUDA graphs, which {GRAPHS_CANNOT_ACCUMULATE}: set gradient_accumulation_steps=1, "
            "or compile without CUDA graphs (torch's default mode and backend, max-autotune-no-cudagraphs)."
        )


def graph_norm_kernel(args) -> str:
    """What the swapped norms run inside this run's ``torch.compile`` graphs: apex's kernel under the ``cudagraphs``
    backend, which replays the traced kernels as they are, else the stock op, which Inductor fuses with its
    neighbours. TORCH when the run does not compile."""
    graphs = getattr(args, "torch_compile", False) and args.torch_compile_backend == CUDA_GRAPHS_BACKEND
    return APEX if graphs else TORCH


def uses_cuda_graphs(args) -> bool:
    """Whether a run compiles with CUDA graphs (a mode that records them, or the ``cudagraphs`` backend). A graph's
    outputs live in memory that its next replay reuses, so a training loop marks where each step begins
    (``torch.compiler.cudagraph_mark_step_begin``)."""
    return bool(getattr(args, "torch_compile", False) and _graph_setting(args))


def refuse_bf16_stage_without_device(args: ApexTrainingArguments) -> None:
    """A BF16 stage on a machine with no device that runs BF16 (a CPU-only one): transformers refuses it unless
    the run is told to use the CPU. Say which stage asked for BF16 and the two ways on."""
    if args.stage is None or not args.bf16 or args.use_cpu:
        return
    if is_torch_bf16_gpu_available() or is_torch_xla_available():  # (transformers' own test)
        return
    raise ValueError(
        f"stage={args.stage!r} runs BF16 autocast and no GPU here runs BF16: on a CPU take an FP32 stage "
        "(baseline, fused_adam, fused_adam_ln) with use_cpu=True, or keep this stage and set use_cpu=True "
        "(--use_cpu on the command line)."
    )


def refuse_out_of_range(args) -> None:
    """A one-line ``ValueError`` for a numeric argument out of range, before any data or model is loaded
    (``TrainingArguments`` accepts these and fails late, or trains for epochs where ``max_steps`` was meant)."""
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
    if args.max_steps == 0 or args.max_steps < -1:
        raise ValueError(
            f"max_steps must be a positive number of optimizer steps, or -1 to train num_train_epochs epochs; got "
            f"{args.max_steps}"
        )
    if args.max_steps == -1 and not args.num_train_epochs > 0:
        raise ValueError(f"num_train_epochs must be > 0 (or set max_steps), got {args.num_train_epochs}")
    if args.learning_rate < 0:
        raise ValueError(f"learning_rate must be >= 0, got {args.learning_rate}")


@dataclass
class ApexTrainingArguments(TrainingArguments):
    r"""
    Configuration for [`ApexTrainer`]: every [`~transformers.TrainingArguments`] field, plus the following
    (docs/arguments.md says more about each).

    Parameters:
        stage (`str` or `None`, *optional*, defaults to `None`):
            One of `hf_apex.STAGES` (`baseline`, `fused_adam`, `fused_adam_ln`, `fused_full`, `torch_fused`,
            `compiled`, `fastest`, `auto`). A stage sets the switches its `StageConfig` row names; a value of yours
            that contradicts one is a `ValueError`, except `torch_compile_mode`, `torch_compile_backend` and
            `attention_backend`, whose stage values are defaults. `None` leaves every switch to you.
        stage_recipe (`dict`, `str` or `None`, *optional*, defaults to `None`):
            Overrides of the stage's `StageRecipe` (how it compiles, reuses compiled work, builds attention masks and
            returns outputs under autocast), as a dict or JSON, e.g. `'{"min_steps": 0, "compile_cache": false}'`.
            After `__post_init__` it holds the whole recipe the run uses; `args.recipe` is the same as a
            `StageRecipe`.
        amp_dtype (`str`, *optional*, defaults to `"bf16"`):
            Autocast dtype of the mixed-precision stages: `"bf16"`, or `"fp16"` (with a GradScaler).
        apex_optimizer (`str`, *optional*, defaults to `"none"`):
            `"fused_adam"` (apex FusedAdam, AdamW mode), `"fused_lamb"` (apex FusedLAMB) or `"none"` (`optim`).
        apex_optimizer_kwargs (`dict` or `str`, *optional*):
            Extra keyword arguments of the apex optimizer, e.g. `'{"max_grad_norm": 0}'` for FusedLAMB.
        apex_fused_norms (`bool`, *optional*, defaults to `False`):
            Swap `nn.LayerNorm` and the HF RMSNorms for apex's fused norms (`print(model)` shows them).
        apex_strict_kernels (`bool`, *optional*, defaults to `False`):
            Raise instead of falling back to the torch op when an apex kernel is missing or cannot run.
        autotune (`bool`, *optional*, defaults to `False`):
            Time apex against torch per component switched on, on this GPU, and use the faster; decisions cached
            in `$HF_APEX_CACHE` (default `~/.cache/hf_apex/autotune.json`) and in checkpoints.
        fused_linear_cross_entropy (`bool`, *optional*, defaults to `False`):
            A causal LM's training loss computed chunk by chunk from the LM head, without FP32 logits (the same
            maths as transformers' loss); other models, and FP16 autocast, keep theirs.
        attention_backend (`str` or `None`, *optional*, defaults to `None`):
            The SDPA backend put first: `"flash"`, `"cudnn"`, `"efficient"`, `"math"`, or `"fastest"` (each one
            that can run the model's first attention call timed on the first batch). `None`: PyTorch's choice.
        stage_metrics (`bool`, *optional*, defaults to `True`):
            Per-step time, tokens/s, MFU, peak memory and kernel counts in the logs, and a run summary in
            `<output_dir>/hf_apex_metrics.json`.
        metrics_warmup_steps (`int`, *optional*, defaults to `5`):
            Optimizer steps left out of the timing summary.
        peak_tflops (`float` or `None`, *optional*, defaults to `None`):
            Peak dense TFLOP/s for MFU; `None` looks the GPU up in `hf_apex.measure.flops.PEAK_TFLOPS`.
        profile_kernels (`bool`, *optional*, defaults to `True`):
            On CUDA, profile one warm-up step and record which apex kernels executed.
        packing (`str` or `None`, *optional*, defaults to `None`):
            The training batches' layout (`hf_apex.data`): `"documents"` packs a causal LM's examples into rows of
            `packing_length` tokens with positions restarting at each document (attention and loss stay within each
            document; one batch shape); `"buckets"` groups examples by length and pads each batch to one of a few
            lengths; `"auto"` picks documents for a causal LM, buckets otherwise, and neither where every example has
            one length. `None` or `"off"`: the batches as your collator makes them. The `fastest` stage sets `auto`.
        packing_length (`int` or `None`, *optional*, defaults to `None`):
            Tokens per packed row (`packing="documents"`); default: the model's maximum positions, at most 1024.

    > [!NOTE]
    > Defaults that differ from `TrainingArguments`, so that the loop never waits on the GPU and DDP does no work
    > per step these models do not need: `logging_nan_inf_filter=False`, `ddp_find_unused_parameters=False`,
    > `ddp_bucket_cap_mb=100`, and `accelerator_config={"non_blocking": True}` with pinned memory.
    """

    _VALID_DICT_FIELDS = valid_dict_fields(TrainingArguments) + ["apex_optimizer_kwargs", "stage_recipe"]

    stage: str | None = field(
        default=None,
        metadata={
            "help": "Stage of the ladder; sets the apex and precision switches. "
            + "; ".join(f"{name}: {config.summary}" for name, config in STAGES.items()),
            "choices": list(STAGES),
        },
    )
    stage_recipe: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": 'Expert overrides of the stage\'s recipe as JSON, e.g. \'{"fuse_projections": "false"}\' '
            f"(entries: {', '.join(f.name for f in dataclasses.fields(StageRecipe))}; see hf_apex.StageRecipe)."
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
    fused_linear_cross_entropy: bool = field(
        default=False,
        metadata={
            "help": "Causal LMs: compute the training loss chunk by chunk from the LM head without holding the "
            "logits (same maths; vocabulary padded to x64 for the matmuls)."
        },
    )
    attention_backend: str | None = field(
        default=None,
        metadata={
            "help": "SDPA backend for the model's attention: one named first in SDPA's priority, or fastest (timed "
            "on the first batch's attention, cached). None: PyTorch's choice. The fastest stage sets fastest.",
            "choices": list(ATTENTION_CHOICES),
        },
    )
    stage_metrics: bool = field(
        default=True, metadata={"help": "Record per-step stage metrics and write <output_dir>/hf_apex_metrics.json."}
    )
    metrics_warmup_steps: int = field(
        default=5,
        metadata={
            "help": "Optimizer steps excluded from the timing summary (with auto's trial on whole steps: 18 at least)."
        },
    )
    peak_tflops: float | None = field(
        default=None, metadata={"help": "Peak dense TFLOP/s for MFU (default: looked up from the GPU name)."}
    )
    profile_kernels: bool = field(
        default=True, metadata={"help": "On CUDA, profile one warm-up step to record which apex kernels ran."}
    )
    packing: str | None = field(
        default=None,
        metadata={
            "help": "Training batches in a few fixed shapes: documents (a causal LM's examples packed into rows, "
            "positions restarting per document), buckets (grouped by length, padded to a few lengths), auto "
            "(documents for a causal LM, else buckets), off. The fastest stage sets auto.",
            "choices": list(LAYOUTS),
        },
    )
    packing_length: int | None = field(
        default=None,
        metadata={"help": "Tokens per packed row (packing=documents); default: the model's positions, at most 1024."},
    )
    logging_nan_inf_filter: bool = field(
        default=False,
        metadata={
            "help": "Replace NaN/Inf losses in the logged loss (off by default here: it syncs each micro-batch)."
        },
    )

    # Arguments a config mixed by hf_apex.with_stages has too (TRL's packing): its meaning wins; stages leave them.
    BASE_OWNED: ClassVar[frozenset] = frozenset()

    def __post_init__(self):
        # Stage switches must be set before super().__post_init__(): it derives mixed precision and TF32 from them.
        refuse_out_of_range(self)  # (before anything is set up or loaded)
        if self.amp_dtype not in ("bf16", "fp16"):
            raise ValueError(f"amp_dtype must be 'bf16' or 'fp16', got {self.amp_dtype!r}")
        if self.stage is not None:
            self._apply_stage()
        if self.ddp_find_unused_parameters is None:
            self.ddp_find_unused_parameters = False  # no autograd-graph walk after every forward
        if self.ddp_bucket_cap_mb is None:
            self.ddp_bucket_cap_mb = 100  # fewer, larger all-reduces (and fewer compiled graph pieces) than 25 MB
        if self.accelerator_config is None and self.dataloader_pin_memory and not self.use_cpu:
            self.accelerator_config = {"non_blocking": True}  # asynchronous copies from pinned memory
        refuse_accumulation_under_cuda_graphs(self)  # (before super(), which sets up the device and processes)
        refuse_bf16_stage_without_device(self)  # (transformers' own refusal names neither the stage nor FP32)
        if isinstance(self.stage_recipe, str):  # (super() would parse it, in an error that names no argument)
            try:
                self.stage_recipe = json.loads(self.stage_recipe)
            except json.JSONDecodeError as exc:
                raise ValueError(f"stage_recipe is not a JSON object ({exc}): {self.stage_recipe!r}") from None
        super().__post_init__()  # (turns JSON strings of the other dict fields into dicts)
        self.stage_recipe = self._resolve_recipe().to_dict()
        if self.attention_backend not in (None, *ATTENTION_CHOICES):
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_CHOICES} or None, got {self.attention_backend!r}"
            )
        if self.apex_optimizer not in APEX_OPTIMIZERS:
            raise ValueError(f"apex_optimizer must be one of {APEX_OPTIMIZERS}, got {self.apex_optimizer!r}")
        if "packing" not in self.BASE_OWNED and self.packing not in (None, *LAYOUTS):
            raise ValueError(f"packing must be one of {LAYOUTS} or None, got {self.packing!r}")
        if self.packing_length is not None and self.packing_length < 2:
            raise ValueError(f"packing_length must be at least 2 tokens, got {self.packing_length}")
        if self.metrics_warmup_steps < 0:
            raise ValueError(f"metrics_warmup_steps must be >= 0, got {self.metrics_warmup_steps}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"peak_tflops must be positive, got {self.peak_tflops}")

    @property
    def recipe(self) -> StageRecipe:
        """The run's :class:`~hf_apex.stages.StageRecipe`: the stage's, with your ``stage_recipe`` entries."""
        return StageRecipe(**self.stage_recipe)

    def _resolve_recipe(self) -> StageRecipe:
        """The stage's recipe (the defaults without a stage) with your entries; one of yours that acts only under
        ``torch_compile`` on a run that does not compile is a ``ValueError``."""
        yours = self.stage_recipe
        if isinstance(yours, StageRecipe):
            yours = yours.to_dict()
        if yours is not None and not isinstance(yours, dict):
            raise ValueError(f"stage_recipe must be a dict or a JSON object, got {yours!r}")
        base = get_stage(self.stage).recipe if self.stage is not None else StageRecipe()
        recipe = base.with_overrides(yours)
        if not self.torch_compile:  # (the stage's own entries may stand: auto runs eager where it cannot graph)
            compiled = {n: v for n, v in recipe.compiled_entries().items() if v != getattr(base, n)}
            if compiled:
                raise ValueError(
                    f"stage_recipe {compiled} changes what torch.compile does, but torch_compile is off: pick a "
                    "stage that compiles (compiled, fastest, auto), turn torch_compile on, or drop it."
                )
        return recipe

    def _apply_stage(self) -> None:
        """Set every argument of the stage's row; refuse a value of yours that contradicts it."""
        stage = get_stage(self.stage)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        user_bf16, user_fp16 = self.bf16, self.fp16
        user_mode, user_backend = self.torch_compile_mode, self.torch_compile_backend
        for name, value in stage.settings().items():
            if name in self.BASE_OWNED:
                continue
            current = getattr(self, name)
            current = getattr(current, "value", current)  # optim may be an OptimizerNames enum
            if name in stage.OVERRIDABLE and current != defaults[name]:
                continue  # a threshold of yours wins over the stage's default
            if current not in (defaults[name], value):
                raise ValueError(
                    f"stage={stage.name!r} sets {name}={value!r}, but you set {name}={current!r}; "
                    "drop it or pick another stage."
                )
            setattr(self, name, value)
        for name in ("torch_compile_mode", "torch_compile_backend"):  # either turns torch_compile on
            if getattr(self, name) is not None and not stage.torch_compile:
                raise ValueError(
                    f"stage={stage.name!r} does not compile, but you set "
                    f"{name}={getattr(self, name)!r}; pick a stage that compiles (compiled, fastest, auto)."
                )
        processes = int(os.environ.get("WORLD_SIZE") or 1)  # set by torchrun and accelerate launch
        stage_graphs = (user_mode is None and mode_records_cuda_graphs(stage.torch_compile_mode)) or (
            user_backend is None and stage.torch_compile_backend == CUDA_GRAPHS_BACKEND
        )
        if stage_graphs:
            # CUDA graphs have been measured here on one process only (not with DDP's or FSDP's collectives), and
            # they cannot accumulate gradients over micro-batches (GRAPHS_CANNOT_ACCUMULATE)
            if processes > 1:
                why = f"{processes} processes (unmeasured with more than one process)"
            elif self.gradient_accumulation_steps > 1 and _graph_setting(self):
                why = f"gradient_accumulation_steps={self.gradient_accumulation_steps} ({GRAPHS_CANNOT_ACCUMULATE})"
            else:
                why = None
            if why and user_backend is None and stage.torch_compile_backend == CUDA_GRAPHS_BACKEND:
                # graphs of the eager kernels: without them, the eager kernels (a mode of yours included)
                logger.warning("hf_apex: stage %r: %s, so the stage runs eager, without CUDA graphs.", stage.name, why)
                self.torch_compile, self.torch_compile_backend, self.torch_compile_mode = False, None, None
            elif why:
                logger.warning(
                    "hf_apex: stage %r: %s, so torch.compile keeps its default mode, not the stage's %r.",
                    stage.name,
                    why,
                    stage.torch_compile_mode,
                )
                self.torch_compile_mode = None
        # The row says autocast or FP32; amp_dtype="fp16" (or --fp16) makes the autocast FP16 with a GradScaler.
        if user_fp16 and not stage.bf16:
            raise ValueError(f"stage={stage.name!r} runs in FP32, but you set fp16=True.")
        if stage.bf16 and user_bf16 and (user_fp16 or self.amp_dtype == "fp16"):
            raise ValueError("bf16=True contradicts fp16=True / amp_dtype='fp16'; give one of them.")
        if stage.bf16 and (user_fp16 or self.amp_dtype == "fp16"):
            self.amp_dtype, self.bf16, self.fp16 = "fp16", False, True


# The arguments ApexTrainingArguments adds to TrainingArguments.
_STOCK = {f.name for f in dataclasses.fields(TrainingArguments)}
ADDED_ARGUMENTS = tuple(f.name for f in dataclasses.fields(ApexTrainingArguments) if f.name not in _STOCK)
