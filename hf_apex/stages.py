"""The stage ladder: one registry row per stage, whose fields are the arguments it sets.

``STAGES`` is the single source of truth for the ``--stage`` choices, the benchmark order and the switches each
stage sets: every field of a :class:`StageConfig` except ``name`` and ``summary`` is an
:class:`~hf_apex.ApexTrainingArguments` field, and applying a stage sets each one to the row's value. The seed's
four stages come first, each changing one field relative to the previous one; the rungs after them go beyond the
seed (torch's own fused kernels, ``torch.compile``, ``fastest``, which adds CUDA graphs, a RoPE model's cos and sin
computed once per forward, dropout's masks drawn by torch's own kernels inside the compiled graph, linears that read
one input run as one matmul outside causal LMs, weight gradients written in FP32 by their matmuls, pointwise results
recomputed in the backward where the loss reads the logits, a loss that never holds FP32 logits and the SDPA backend
timed fastest on your GPU, and ``auto``, which times apex against torch on your GPU and replays the step's kernels
as CUDA graphs).
Every stage keeps the same hyper-parameters and the same maths; only the implementation changes, except that
under autocast apex's fused norms compute in BF16 where torch's compute in FP32 (apex's own behaviour).
"""

from __future__ import annotations

import dataclasses

APEX_OPTIMIZERS = ("none", "fused_adam", "fused_lamb")
AUTO_CHOICES = ("auto", "true", "false")  # compile_recompute_pointwise, compile_fuse_projections


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """What one stage sets. Each field after ``summary`` is the `ApexTrainingArguments` field of that name.

    Attributes:
        name: registry key, e.g. ``"fused_adam"``.
        summary: one line for tables and ``--help``.
        optim: HF's ``optim``: ``"adamw_torch"`` (foreach) or ``"adamw_torch_fused"``; ignored where
            ``apex_optimizer`` is set.
        apex_optimizer: ``"fused_adam"`` (apex FusedAdam, AdamW mode) or ``"none"``.
        apex_fused_norms: swap LayerNorm/RMSNorm for apex's fused norms.
        bf16: torch.amp autocast (BF16; FP16 with a GradScaler when ``amp_dtype="fp16"``); FP32 otherwise.
        torch_compile: ``torch.compile`` the model.
        torch_compile_mode: its mode (None: torch's default). A default, as below: a value of yours wins.
        torch_compile_backend: its backend: `"inductor"` (torch's default), or `"cudagraphs"`, which replays the
            traced kernels as CUDA graphs without generating code; the swapped norms then run apex's kernel inside
            them. A default, as above.
        autotune: time apex against torch per component on this GPU and use the faster.
        fused_linear_cross_entropy: a causal LM's training loss without its logits (chunked LM head +
            cross-entropy, the same maths; see `hf_apex.kernels.loss`); other models keep their loss.
        compile_min_steps: with `torch_compile`, a run of fewer optimizer steps runs eager instead (compilation
            would not pay). A default: a value of yours wins (see `OVERRIDABLE`).
        compile_recompute_pointwise: with `torch_compile`, `"true"`: the backward recomputes pointwise results that
            its matmuls read (a GELU's output) instead of keeping them from the forward: less activation memory for
            a little time, the same maths; `"auto"`: the same, except where the loss runs without the logits
            (`fused_linear_cross_entropy`). A default, as above.
        compile_rotary_once: with `torch_compile`, a RoPE model's cos and sin are computed once per forward, not
            inside every attention layer's compiled kernels (`hf_apex.kernels.rotary`); the same values. A default,
            as above.
        compile_eager_random: with `torch_compile`, random ops (dropout's masks) run torch's own kernels inside the
            compiled graph, as eager draws them, instead of Inductor's per-element Philox. A default, as above.
        compile_fuse_projections: with `torch_compile` (Inductor), `"true"`: linears that read one input (BERT's
            query, key and value; a Llama's q/k/v and gate/up) run as one matmul on their concatenated weights
            (`hf_apex.kernels.projections`); the same dot products. `"auto"`: the same except in a causal LM, where
            it slowed the Llama-architecture model's step. A default, as above.
        compile_combo_kernels: with `torch_compile` (Inductor), independent small kernels run as one (Inductor's
            `combo_kernels`); the same operations. A default, as above.
        compile_fp32_weight_grads: with `torch_compile` (Inductor), under BF16/FP16 autocast on CUDA, the weights'
            gradients are written in FP32 by their matmuls instead of a half-precision matmul and a cast
            (`hf_apex.kernels.weight_grads`); the same sums, rounded once. A default, as above.
        attention_backend: the SDPA backend of the model's attention (`hf_apex.kernels.attention`): None for
            PyTorch's choice, a backend's name, or `"fastest"` (timed on the first batch). A default, as above.
        tf32: always False: FP32 matmuls stay strict, so the ladder compares like with like.
    """

    name: str
    summary: str
    optim: str = "adamw_torch"
    apex_optimizer: str = "none"
    apex_fused_norms: bool = False
    bf16: bool = False
    torch_compile: bool = False
    torch_compile_mode: str | None = None
    torch_compile_backend: str | None = None
    autotune: bool = False
    fused_linear_cross_entropy: bool = False
    compile_min_steps: int | None = None
    compile_recompute_pointwise: str | None = None
    compile_rotary_once: bool | None = None
    compile_eager_random: bool | None = None
    compile_fuse_projections: str | None = None
    compile_combo_kernels: bool | None = None
    compile_fp32_weight_grads: bool | None = None
    attention_backend: str | None = None
    tf32: bool = False

    # not switches of the ladder but tuning: the stage's value is a default you may change
    OVERRIDABLE = (
        "torch_compile_mode",
        "torch_compile_backend",
        "compile_min_steps",
        "compile_recompute_pointwise",
        "compile_rotary_once",
        "compile_eager_random",
        "compile_fuse_projections",
        "compile_combo_kernels",
        "compile_fp32_weight_grads",
        "attention_backend",
    )

    def settings(self) -> dict:
        """The arguments this stage sets, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[2:]}


SEED_STAGES = ("baseline", "fused_adam", "fused_adam_ln", "fused_full")
_APEX_ADAM = {"apex_optimizer": "fused_adam"}
_TORCH_FUSED = {"optim": "adamw_torch_fused", "bf16": True}
_INDUCTOR = {"torch_compile": True, "torch_compile_backend": "inductor"}

STAGES: dict[str, StageConfig] = {
    s.name: s
    for s in (
        StageConfig("baseline", "torch AdamW (foreach) + stock norms + strict FP32"),
        StageConfig("fused_adam", "apex FusedAdam (AdamW mode) + FP32", **_APEX_ADAM),
        StageConfig("fused_adam_ln", "+ apex fused LayerNorm/RMSNorm", **_APEX_ADAM, apex_fused_norms=True),
        StageConfig(
            "fused_full",
            "+ torch.amp autocast (BF16, or FP16 + GradScaler)",
            **_APEX_ADAM,
            apex_fused_norms=True,
            bf16=True,
        ),
        # Beyond the seed: what a user could run instead, and the fastest of both worlds.
        StageConfig("torch_fused", "torch AdamW(fused=True) + stock norms + BF16", **_TORCH_FUSED),
        StageConfig(
            "compiled", "torch fused AdamW + BF16 + torch.compile (native norms)", **_TORCH_FUSED, **_INDUCTOR
        ),
        StageConfig(
            "fastest",
            "compiled with CUDA graphs, RoPE's cos/sin once per forward, torch's dropout kernels, projections "
            "that share an input as one matmul (not in causal LMs), weight gradients in FP32 from their matmuls and "
            "pointwise results recomputed where the loss reads the logits + a causal LM's loss without its logits + "
            "the fastest SDPA backend, timed on this GPU",
            **_TORCH_FUSED,
            **_INDUCTOR,
            # one replay per graph instead of a launch per kernel: on an H200 BERT-base 128x128's compiled step went
            # from 33.4 ms (p20-p80 30.3-36.9, host-bound) to 26.7 ms (26.6-27.0); GPT-2's, device-bound, took
            # 45.6 ms, level with an earlier default-mode run on another machine (45.4 ms;
            # benchmarks/h200-2026-12-01-cuda-graphs). Multi-process runs and gradient accumulation keep torch's
            # default mode.
            torch_compile_mode="reduce-overhead",
            fused_linear_cross_entropy=True,
            attention_backend="fastest",
            # compilation took 21-29 s on an H200 and paid off against torch_fused after ~400 (Llama), ~460
            # (GPT-2) and ~2,150 (BERT) steps (benchmarks/h200-2026-11-30-ladder)
            compile_min_steps=500,
            # on an H200 recomputing kept BERT-base 128x128's step 1.67 GiB less (5.28 against 6.95 GiB, 0.48x the
            # baseline's 11.07) for 2.6 % more time, its losses within 0.1 %; GPT-2's and Llama's, under the
            # logits-free loss at 0.31x and 0.35x of their baselines' memory without it, it cost 2.8 % and 1.9 %
            # (benchmarks/h200-2026-12-01-causal-steps, benchmarks/h200-2026-12-01-recompute)
            compile_recompute_pointwise="auto",
            compile_rotary_once=True,
            # dropout's masks drawn by torch's kernels: on an H200 BERT-base 128x128's step took 26.27 ms against
            # 27.11, GPT-2's 35.57 against 36.05 (benchmarks/h200-2026-12-03-random)
            compile_eager_random=True,
            # one matmul for the linears that read one input: on an H200 BERT-base 128x128's step took 24.75 ms against
            # 26.27; the Llama-architecture 124M's took 34.55 against 32.44, so not in a causal LM
            # (benchmarks/h200-2026-12-03-short)
            compile_fuse_projections="auto",
            # weight gradients written in FP32 by their matmuls: on an H200 BERT-base 128x128's step took 24.62 ms
            # against 24.83 (p20-p80 24.61-24.64 against 24.81-24.85); GPT-2's 35.30 against 35.24, level (one pair
            # each on one machine, the pass run by its experiment script; benchmarks/h200-2026-12-03-headgrad)
            compile_fp32_weight_grads=True,
        ),
        StageConfig(
            "auto",
            "BF16 + the faster of apex/torch per component, timed on this GPU, replayed as CUDA graphs",
            **_APEX_ADAM,
            apex_fused_norms=True,
            bf16=True,
            autotune=True,
            # The step's own kernels (apex's norms among them) recorded once and replayed, without code generation:
            # the host no longer paces the GPU. In a whole `make bench` on an H200 (benchmarks/h200-2026-12-02-whole)
            # BERT-base 128x128's step took 30.1 ms against fused_full's 38.3 ms (95 % interval 31.9-46.0, host-bound)
            # and torch_fused's 35.3 ms; GPT-2's 105.6 against 113.9 ms, Llama's 88.3 against 92.5 ms.
            # One process, no gradient accumulation, a GPU: elsewhere the stage runs eager (ApexTrainingArguments).
            torch_compile=True,
            torch_compile_backend="cudagraphs",
            # Tracing and recording cost the first step 8-10 s there, repaid against the faster eager row after
            # ~1,950 (BERT), ~950 (GPT-2) and ~2,200 (Llama) steps
            compile_min_steps=2500,
        ),
    )
}


def get_stage(name: str) -> StageConfig:
    try:
        return STAGES[name]
    except KeyError:
        raise ValueError(f"Unknown stage {name!r}; choose one of: {', '.join(STAGES)}") from None
