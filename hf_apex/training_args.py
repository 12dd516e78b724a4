"""``ApexTrainingArguments``: ``TrainingArguments`` plus the switches of the stage ladder."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments
from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

from .kernels.attention import CHOICES as ATTENTION_CHOICES
from .kernels.trace import APEX, TORCH
from .stages import APEX_OPTIMIZERS, AUTO_CHOICES, STAGES, get_stage

logger = logging.getLogger("hf_apex")

# Seen on an H200 (torch 2.11, BERT fastest, two micro-batches of 64): the second micro-batch's backward read an output
# of the first's graphs that its replay had overwritten, and stopped. Where nothing stops, the first micro-batch's
# gradients (a graph's outputs, taken as .grad without a copy) come out overwritten (a repro in pytorch/pytorch#96693).
GRAPHS_CANNOT_ACCUMULATE = (
    "in torch's CUDA graph trees cannot accumulate gradients over micro-batches (a later micro-batch's replay "
    "overwrites the outputs of the earlier one's: pytorch/pytorch#169545)"
)


def mode_records_cuda_graphs(mode: str | None) -> bool:
    """Whether ``torch.compile(mode=mode)`` records CUDA graphs (Inductor's cudagraph trees), as torch's own table of
    what each mode sets says."""
    if not mode:
        return False
    import torch._inductor

    return bool(torch._inductor.list_mode_options().get(mode, {}).get("triton.cudagraphs"))


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
    backend, which replays the traced kernels as they are (on an H200, BERT-base 128 x 128's step took 30.2 ms with
    apex's norms in the graphs against 35.5 ms with torch's, whose autocast runs them in FP32), else the stock op,
    which Inductor fuses with its neighbours (measured faster there than apex's op in the graph). TORCH when the run
    does not compile."""
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
    stage = get_stage(args.stage)
    raise ValueError(
        f"stage={stage.name!r} runs BF16 autocast ({stage.summary}), and no GPU here runs BF16: on a CPU pass "
        "use_cpu=True (--use_cpu), or take an FP32 stage (fused_adam_ln is fused_full without autocast)."
    )


@dataclass
class ApexTrainingArguments(TrainingArguments):
    r"""
    Configuration for [`ApexTrainer`]: every [`~transformers.TrainingArguments`] field, plus the following.

    Parameters:
        > Parameters that choose a stage of the ladder

        stage (`str` or `None`, *optional*, defaults to `None`):
            One of `hf_apex.STAGES`: the seed's `baseline`, `fused_adam`, `fused_adam_ln`, `fused_full`, then
            `torch_fused`, `compiled`, `fastest` and `auto`. A stage sets `optim`, `apex_optimizer`,
            `apex_fused_norms`, `autotune`, `torch_compile`, `torch_compile_mode`, `torch_compile_backend`,
            `fused_linear_cross_entropy`, `compile_min_steps`, `compile_recompute_pointwise`, `compile_rotary_once`,
            `compile_eager_random`, `compile_fuse_projections`, `compile_combo_kernels`, `compile_fp32_weight_grads`,
            `attention_backend`, `tf32` and the AMP flags; setting any of them to something the stage contradicts
            raises `ValueError` (`torch_compile_mode`, `torch_compile_backend`, `compile_min_steps`,
            `compile_recompute_pointwise`, `compile_rotary_once`, `compile_eager_random`, `compile_fuse_projections`,
            `compile_combo_kernels`, `compile_fp32_weight_grads` and `attention_backend` excepted: the stage's value is
            a default, and a mode or backend on a stage that does not compile is an error). `fastest` compiles with
            CUDA graphs (`"reduce-overhead"`) in a single process and with torch's default mode under DDP or FSDP (not
            measured there) or gradient accumulation (which CUDA graphs cannot do: a mode of yours that records them is
            then a `ValueError`). `auto` replays its eager kernels as CUDA graphs (the `cudagraphs` backend, apex's
            norms inside) in a single process on a GPU without gradient accumulation, and runs eager elsewhere. `None`
            leaves every switch to you.
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
            For each apex component switched on, time apex against torch on this GPU (the optimizer over the
            real parameter shapes; the norms on the model's forward and backward of the first batch, or, under
            FSDP or activation checkpointing, each norm type alone; under torch.compile the norms are not timed, the
            graphs run the op the backend calls for), in turns, and use the faster;
            a backend that fails the parity check is never chosen.
            Decisions are cached in `autotune_cache` and written to the logs and the metrics JSON.
        autotune_cache (`str` or `None`, *optional*, defaults to `None`):
            Decision cache file; `None` means `$HF_APEX_CACHE` or `~/.cache/hf_apex/autotune.json`.
        drop_full_attention_mask (`bool`, *optional*, defaults to `True`):
            A batch whose `attention_mask` is all ones (packed LM blocks, unpadded batches) goes to the model without
            it, which means the same to the model (checked on the CPU batch in the collator; a batch with
            `position_ids` keeps it; in eager runs only for a model without a `pad_token_id`, since transformers then
            looks for the pad token in the input ids, a device sync), and while `train()` runs, a model on
            transformers' `sdpa` attention runs as `hf_apex_sdpa`, the same attention with masks decided without
            reading a tensor: no padding mask means no mask (SDPA's `is_causal`), a padding mask is built as it is.
            transformers itself reads the mask's values to decide (a host-device sync on every eager forward) and,
            under `torch.compile`, builds the full causal mask even without one (see `hf_apex.kernels.attention`).
        compile_min_steps (`int` or `None`, *optional*, defaults to `None`):
            With `torch_compile`: when the run has fewer optimizer steps than this (`max_steps`, or the epochs over
            a dataset of known length), it runs eager and the log and the metrics JSON say why. On an H200 compiling
            took 23-28 s per model with Inductor and paid off against the faster eager BF16 stage after ~300-480 steps
            (GPT-2, Llama) and ~3,100-3,400 (BERT); `auto`'s CUDA graphs took 8-10 s and ~950-2,200 steps. `None`
            (or 0) compiles whenever asked; the `fastest` stage sets 500 and `auto` 2,500, which a value of yours
            overrides.
        compile_recompute_pointwise (`str` or `None`, *optional*, defaults to `None`):
            With `torch_compile`: `"true"` makes the backward recompute the pointwise results its matmuls read, such
            as a GELU's output, from what the forward keeps anyway (the GELU's input), instead of keeping both from
            the forward (`torch._functorch.config.ban_recompute_materialized_backward=False`, set for this trainer's
            training steps only; a run compiling under other settings than the graphs an earlier run of the process
            left drops those first, `torch._dynamo.reset`). The same maths, less activation memory, a little more
            time: on an H200 BERT-base at 128 x 128 held 1.67 GiB less (5.28 against 6.95 GiB) for 2.6 % more time
            per step, GPT-2 124M at 16 x 1024 1.85 GiB less for 2.8 % more. `"auto"`: `"true"` for a model whose
            training loss is computed from its logits, `"false"` where `fused_linear_cross_entropy` took the logits
            away: that already put GPT-2's and Llama's peak at a third of the baseline's, so recomputing would only
            cost them time (2.8 % and 1.9 % of the step). `None` or `"false"`: torch's default (keep them). The
            `fastest` stage sets `"auto"`, which a value of yours overrides; `True` and `False` stand for `"true"`
            and `"false"`.
        compile_rotary_once (`bool` or `None`, *optional*, defaults to `None`):
            With `torch_compile`, for RoPE models (Llama, Mistral, Qwen...): the cos and sin of the rotary embedding
            are computed once per forward into a buffer that every attention layer reads, instead of being
            recomputed by the compiler inside each layer's rotation kernels, forward and backward
            (`hf_apex.kernels.rotary`). The same values; other models are left as they are. `None`: off; the
            `fastest` stage sets `True`, which `False` of yours overrides.
        compile_eager_random (`bool` or `None`, *optional*, defaults to `None`):
            With `torch_compile`: random ops, dropout's masks among them, run torch's own kernels inside the compiled
            graph (`torch._inductor.config.fallback_random`, set for this trainer's training steps only) instead of
            random numbers generated inside Inductor's fused kernels, which cost a Philox evaluation per element.
            The same distribution; the draws are those eager mode makes from the same generator state. On an H200,
            with dropout 0.1 in the models' configs, BERT-base 128 x 128's `fastest` step took 26.27 ms against 27.11
            and GPT-2 124M 16 x 1024's 35.57 against 36.05 (`benchmarks/h200-2026-12-03-random`). `None`: off; the
            `fastest` stage sets `True`, which `False` of yours overrides.
        compile_fuse_projections (`str` or `None`, *optional*, defaults to `None`):
            With `torch_compile` (Inductor), `"true"`: the linears that read one input, such as BERT's query, key and
            value or a Llama's q/k/v and gate/up projections, run as one matmul on their concatenated weights, split
            back after it (`hf_apex.kernels.projections`, an Inductor pre-grad pass set for this trainer's training
            steps only). The same dot products; the modules and the state dict are unchanged. On an H200 BERT-base
            128 x 128's `fastest` step took 24.75 ms with it against 26.27, but the Llama-architecture 124M's took
            34.55 against 32.44 and 0.57 GiB more (`benchmarks/h200-2026-12-03-short`). `"auto"`: `"true"` except
            for a causal LM (a `...ForCausalLM` or `...LMHeadModel`). `None` or `"false"`: off. The `fastest` stage
            sets `"auto"`, which a value of yours overrides; `True` and `False` stand for `"true"` and `"false"`.
        compile_combo_kernels (`bool` or `None`, *optional*, defaults to `None`):
            With `torch_compile` (Inductor): independent small kernels of a compiled graph, such as the casts of the
            weights to the autocast dtype, run as one kernel (Inductor's `combo_kernels`, set for this trainer's
            training steps only). The same operations. On an H200 BERT-base 128 x 128's `fastest` step took 25.78 ms
            with it against 26.27 (`benchmarks/h200-2026-12-03-short`); not yet measured with the other models or
            with `compile_fuse_projections`, so no stage sets it. `None`: off.
        compile_fp32_weight_grads (`bool` or `None`, *optional*, defaults to `None`):
            With `torch_compile` (Inductor), under BF16/FP16 autocast on CUDA: weight gradients that a half-precision
            matmul and a cast kernel would make are written in FP32 by the matmul (cuBLAS's accumulator as it is;
            `hf_apex.kernels.weight_grads`, an Inductor post-grad pass set for this trainer's training steps only;
            one of yours keeps its place, and the metrics JSON's `kernels.weight_gradients` says which ran). The
            same sums, rounded once instead of twice. On an H200 BERT-base 128 x 128's `fastest` step took 24.62 ms
            with the same pass (its experiment script) against 24.83, GPT-2 124M's 35.30 against 35.24
            (`benchmarks/h200-2026-12-03-headgrad`). The `fastest` stage sets `True`, which `False` of yours
            overrides. `None`: off.
        fused_linear_cross_entropy (`bool`, *optional*, defaults to `False`):
            For causal LMs of the families in `hf_apex.kernels.loss.SUPPORTED`: the training loss is computed
            chunk by chunk from the LM head's matmul, without FP32 logits (`hf_apex.kernels.loss`): the same
            maths as transformers' loss (the logits rounded to the autocast dtype, the softmax in FP32), the head's
            matmuls on a vocabulary padded to a multiple of 64 with the padding masked out. Training forwards then
            return no logits; evaluation runs the stock forward. Another model, and any under FP16 autocast, keeps
            its loss: the metrics JSON's `lm_loss` says which (with a warning when you asked for it yourself).
        attention_backend (`str` or `None`, *optional*, defaults to `None`):
            The SDPA backend of the model's attention (transformers' `sdpa` implementation): `"flash"`, `"cudnn"`,
            `"efficient"` or `"math"` first in SDPA's priority (inputs it cannot take fall back to the others),
            `"short"`: hf_apex's Triton kernel for sequences of up to 128 tokens (`hf_apex.kernels.short_attention`;
            the model runs as `hf_apex_short` during training, SDPA taking the calls the kernel does not fit; it needs
            a CUDA GPU with Triton and `drop_full_attention_mask`; on an H200 it was slower than cuDNN, so `"fastest"`
            does not time it), or `"fastest"`: on the first training batch, the model's first SDPA call is recorded
            and every SDPA backend that can run it is timed (forward and backward at its shapes, memory layout, mask,
            dropout and scale) against PyTorch's own choice, in turns; the fastest whose results match the math
            backend's wins, the decision is cached in `autotune_cache`, kept in checkpoints and written to the logs
            and the metrics JSON. Not timed under FSDP or DeepSpeed. `None` leaves the choice to PyTorch. The
            `fastest` stage sets `"fastest"`, which a value of yours overrides.

        > Parameters that control the stage metrics

        stage_metrics (`bool`, *optional*, defaults to `True`):
            Attach `StageMetricsCallback`: per-step time, tokens/s, MFU, peak memory and kernel counts in the
            logs, and a run summary in `<output_dir>/hf_apex_metrics.json`.
        metrics_warmup_steps (`int`, *optional*, defaults to `5`):
            Optimizer steps left out of the timing summary (compilation, allocator and cuBLAS warm-up). With
            `autotune`, a run whose norms are checked on whole steps leaves those steps out too, and the one after
            them: 18 steps at least (`hf_apex.autotune.NormTrial`).
        peak_tflops (`float` or `None`, *optional*, defaults to `None`):
            Peak dense TFLOP/s used for MFU; `None` looks the GPU up in `hf_apex.measure.flops.PEAK_TFLOPS`.
        profile_kernels (`bool`, *optional*, defaults to `True`):
            On CUDA, profile one warm-up step with `torch.profiler` and record which apex kernels executed.

        > Defaults that differ from `TrainingArguments` (so that the training loop never waits on the GPU and DDP does
        no work per step that these models do not need)

        logging_nan_inf_filter (`bool`, *optional*, defaults to `False`):
            The stock filter reads every micro-batch's loss on the host (a device sync per micro-batch) to replace
            a NaN/Inf loss by the running average. Off, a NaN/Inf shows in the logged loss instead of being hidden.
        ddp_find_unused_parameters (`bool`, *optional*, defaults to `False`):
            The stock Trainer walks the autograd graph after every forward of a `PreTrainedModel` to find parameters
            the step left unused; on 2 H200s that walk cost compiled GPT-2 124M 8 % of its step (54.9 vs 50.6 ms).
            A model that leaves parameters out of some steps (mixture-of-experts routing, LayerDrop, a head the
            loss does not use) needs `True`; `ApexTrainer` names this flag when DDP stops on such a parameter.
        ddp_bucket_cap_mb (`int`, *optional*, defaults to `100`):
            Gradient all-reduce bucket size: fewer, larger all-reduces and, under `torch.compile`, fewer graph
            pieces (DDP's compiled overlap splits the graph at bucket boundaries) than torch's 25 MB.
        fp32_outputs (`bool`, *optional*, defaults to `False`):
            Not a `TrainingArguments` field: under autocast accelerate converts every output of the model's forward
            to FP32, and `True` keeps that. `False` leaves the outputs in the autocast dtype from the first training
            step on: the loss is FP32 either way (transformers computes it in FP32 inside the forward), and the
            conversion is a full FP32 copy of the logits each step (GPT-2 at 16 x 1024: 3.3 GB written). Where the
            Trainer computes the loss from the outputs instead (label smoothing, a `compute_loss_func`, a
            `compute_loss` of a subclass), the conversion stays. Evaluation after the first training step gets
            BF16/FP16 logits too (before it, FP32): a `preprocess_logits_for_metrics` of yours sees that dtype, and
            `compute_metrics` gets FP32 arrays under BF16 (the Trainer converts them: NumPy has no bfloat16) and
            float16 arrays under FP16. The metrics JSON's `kernels.model_outputs` says which ran.
        accelerator_config (`dict`, *optional*, defaults to `{"non_blocking": True}` with pinned memory):
            Batches are copied to the GPU asynchronously from pinned memory; accelerate's default copy waits for
            the GPU to finish the previous step. Any `accelerator_config` you pass is used as given.

    > [!NOTE]
    > A stage sets each argument its `StageConfig` row names (`optim`, `apex_optimizer`, `apex_fused_norms`, `bf16`,
    > `torch_compile`, `torch_compile_mode`, `torch_compile_backend`, `autotune`, `fused_linear_cross_entropy`,
    > `compile_min_steps`, `compile_recompute_pointwise`, `compile_rotary_once`, `compile_eager_random`,
    > `compile_fuse_projections`, `compile_combo_kernels`, `compile_fp32_weight_grads`, `attention_backend`,
    > `tf32=False`); a value you set that the stage contradicts is a `ValueError`, except for `torch_compile_mode`,
    > `torch_compile_backend`, `compile_min_steps`, `compile_recompute_pointwise`, `compile_rotary_once`,
    > `compile_eager_random`, `compile_fuse_projections`, `compile_combo_kernels`, `compile_fp32_weight_grads` and
    > `attention_backend`, whose stage values are defaults.
    > A compile mode or backend on a stage that does not compile is a `ValueError` too.
    > Without a stage the `TrainingArguments` defaults apply, except the four `TrainingArguments` fields above. An
    > explicit `--optim` equal to the transformers default (`adamw_torch_fused`) cannot be told from no `--optim`, so
    > a stage overrides it.
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
    drop_full_attention_mask: bool = field(
        default=True,
        metadata={
            "help": "Drop a batch's attention_mask when it is all ones, and decide the model's SDPA masks without "
            "reading a tensor (hf_apex_sdpa): no device sync, SDPA's is_causal under torch.compile. Same maths."
        },
    )
    compile_min_steps: int | None = field(
        default=None,
        metadata={
            "help": "With torch_compile: a run of fewer optimizer steps runs eager and says so (compilation would "
            "not pay). None: compile whenever asked; 0 too. The fastest stage sets 500."
        },
    )
    compile_recompute_pointwise: str | None = field(
        default=None,
        metadata={
            "help": "With torch_compile: true makes the backward recompute pointwise results its matmuls read (a "
            "GELU's output) instead of keeping them: less activation memory, a little more time, same maths. auto: "
            "true unless the causal-LM loss runs without logits (fused_linear_cross_entropy). None or false: torch's "
            "default (keep them). The fastest stage sets auto.",
            "choices": list(AUTO_CHOICES),
        },
    )
    compile_rotary_once: bool | None = field(
        default=None,
        metadata={
            "help": "With torch_compile, RoPE models: compute the rotary embedding's cos/sin once per forward instead "
            "of inside every attention layer's compiled kernels (same values). None: off. The fastest stage sets "
            "True, which false of yours overrides."
        },
    )
    compile_eager_random: bool | None = field(
        default=None,
        metadata={
            "help": "With torch_compile: random ops (dropout's masks) run torch's own kernels inside the compiled "
            "graph, as eager draws them, instead of Inductor's per-element Philox (same distribution). None: off. "
            "The fastest stage sets True, which false of yours overrides."
        },
    )
    compile_fuse_projections: str | None = field(
        default=None,
        metadata={
            "help": "With torch_compile (Inductor), true: linears that read one input (BERT's query/key/value, a "
            "Llama's q/k/v and gate/up) run as one matmul on their concatenated weights (same dot products, same "
            "modules); auto: the same except in causal LMs. None or false: off. The fastest stage sets auto.",
            "choices": list(AUTO_CHOICES),
        },
    )
    compile_combo_kernels: bool | None = field(
        default=None,
        metadata={
            "help": "With torch_compile (Inductor): independent small kernels (the weights' casts) run as one kernel "
            "(Inductor's combo_kernels; the same operations). None: off."
        },
    )
    compile_fp32_weight_grads: bool | None = field(
        default=None,
        metadata={
            "help": "With torch_compile (Inductor), under BF16/FP16 autocast on CUDA: weight gradients written in "
            "FP32 by their matmuls, without a cast kernel each (the same sums, rounded once). None: off. The "
            "fastest stage sets True, which false of yours overrides."
        },
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
            "help": "SDPA backend for the model's attention: one named first in SDPA's priority, short (hf_apex's "
            "Triton kernel for up to 128 tokens), or fastest (timed on the first batch's attention, cached). None: "
            "PyTorch's choice. The fastest stage sets fastest.",
            "choices": list(ATTENTION_CHOICES),
        },
    )
    autotune_cache: str | None = field(
        default=None,
        metadata={"help": "Autotune decision cache (default $HF_APEX_CACHE or ~/.cache/hf_apex/autotune.json)."},
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
    fp32_outputs: bool = field(
        default=False,
        metadata={
            "help": "Under autocast, let accelerate convert the model's training outputs (the logits) to FP32 after "
            "each forward. Off: they stay in the autocast dtype; the loss is FP32 either way."
        },
    )
    logging_nan_inf_filter: bool = field(
        default=False,
        metadata={
            "help": "Replace NaN/Inf losses in the logged loss (off by default here: it syncs each micro-batch)."
        },
    )

    def __post_init__(self):
        # Stage switches must be set before super().__post_init__(): it derives mixed precision and TF32 from them.
        if self.amp_dtype not in ("bf16", "fp16"):
            raise ValueError(f"amp_dtype must be 'bf16' or 'fp16', got {self.amp_dtype!r}")
        for name in ("compile_recompute_pointwise", "compile_fuse_projections"):  # "auto", "true" or "false"
            value = getattr(self, name)
            if isinstance(value, bool):  # (before the stage: a value of yours wins over it)
                setattr(self, name, value := str(value).lower())
            if value not in (None, *AUTO_CHOICES):
                raise ValueError(f"{name} must be one of {AUTO_CHOICES} or None, got {value!r}")
        if self.stage is not None:
            self._apply_stage()
        if self.ddp_find_unused_parameters is None:
            self.ddp_find_unused_parameters = False  # no graph walk per step (see the docstring)
        if self.ddp_bucket_cap_mb is None:
            self.ddp_bucket_cap_mb = 100
        if self.accelerator_config is None and self.dataloader_pin_memory and not self.use_cpu:
            self.accelerator_config = {"non_blocking": True}  # asynchronous copies from pinned memory
        refuse_accumulation_under_cuda_graphs(self)  # (before super(), which sets up the device and processes)
        refuse_bf16_stage_without_device(self)  # (transformers' own refusal names neither the stage nor FP32)
        super().__post_init__()
        if self.attention_backend not in (None, *ATTENTION_CHOICES):
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_CHOICES} or None, got {self.attention_backend!r}"
            )
        if self.compile_recompute_pointwise not in (None, "false") and not self.torch_compile:
            raise ValueError(
                f"compile_recompute_pointwise={self.compile_recompute_pointwise!r} sets what torch.compile's backward "
                "recomputes, but torch_compile is off: turn torch_compile on (or pick a stage that compiles: "
                "compiled, fastest, auto), or drop it."
            )
        if self.compile_fuse_projections not in (None, "false") and not self.torch_compile:
            raise ValueError(
                f"compile_fuse_projections={self.compile_fuse_projections!r} changes what torch.compile generates, "
                "but torch_compile is off: turn torch_compile on (or pick a stage that compiles: compiled, fastest, "
                "auto), or drop it."
            )
        for name in (
            "compile_rotary_once",
            "compile_eager_random",
            "compile_combo_kernels",
            "compile_fp32_weight_grads",
        ):
            if getattr(self, name) and not self.torch_compile:
                raise ValueError(
                    f"{name}=True changes what torch.compile generates, but torch_compile is off: turn torch_compile "
                    "on (or pick a stage that compiles: compiled, fastest, auto), or drop it."
                )
        if self.apex_optimizer not in APEX_OPTIMIZERS:
            raise ValueError(f"apex_optimizer must be one of {APEX_OPTIMIZERS}, got {self.apex_optimizer!r}")
        if self.metrics_warmup_steps < 0:
            raise ValueError(f"metrics_warmup_steps must be >= 0, got {self.metrics_warmup_steps}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"peak_tflops must be positive, got {self.peak_tflops}")

    def _apply_stage(self) -> None:
        """Set every argument of the stage's row; refuse a value of yours that contradicts it."""
        stage = get_stage(self.stage)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        user_bf16, user_fp16 = self.bf16, self.fp16
        user_mode, user_backend = self.torch_compile_mode, self.torch_compile_backend
        for name, value in stage.settings().items():
            current = getattr(self, name)
            current = getattr(current, "value", current)  # optim may be an OptimizerNames enum
            if name in stage.OVERRIDABLE and current != defaults[name]:
                continue  # a threshold of yours wins over the stage's default
            if current not in (defaults[name], value):
                raise ValueError(
                    f"stage={stage.name!r} ({stage.summary}) sets {name}={value!r}, but you set {name}={current!r}; "
                    "drop it or pick another stage."
                )
            setattr(self, name, value)
        for name in ("torch_compile_mode", "torch_compile_backend"):  # either turns torch_compile on
            if getattr(self, name) is not None and not stage.torch_compile:
                raise ValueError(
                    f"stage={stage.name!r} ({stage.summary}) does not compile, but you set "
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
                self.torch_compile, self.torch_compile_backend = False, None
                self.torch_compile_mode = self.compile_min_steps = None
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
            raise ValueError(f"stage={stage.name!r} ({stage.summary}) runs in FP32, but you set fp16=True.")
        if stage.bf16 and user_bf16 and (user_fp16 or self.amp_dtype == "fp16"):
            raise ValueError("bf16=True contradicts fp16=True / amp_dtype='fp16'; give one of them.")
        if stage.bf16 and (user_fp16 or self.amp_dtype == "fp16"):
            self.amp_dtype, self.bf16, self.fp16 = "fp16", False, True
