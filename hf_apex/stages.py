"""The stage ladder: one registry row per stage, whose fields are the arguments it sets.

``STAGES`` is the single source of truth for the ``--stage`` choices, the benchmark order and the switches each
stage sets: every field of a :class:`StageConfig` except ``name``, ``summary`` and ``recipe`` is an
:class:`~hf_apex.ApexTrainingArguments` field, and applying a stage sets each one to the row's value. The seed's
four stages come first, each changing one field relative to the previous one; the rungs after them go beyond the
seed (torch's own fused kernels, ``torch.compile``, ``fastest`` and ``auto``). A row's :class:`StageRecipe` says how
the stage runs beneath its switches (how it compiles, how it builds attention masks); experts override its entries
with ``ApexTrainingArguments.stage_recipe``.
Every stage keeps the same hyper-parameters and the same maths; only the implementation changes, except that
under autocast apex's fused norms compute in BF16 where torch's compute in FP32 (apex's own behaviour).
"""

from __future__ import annotations

import dataclasses

APEX_OPTIMIZERS = ("none", "fused_adam", "fused_lamb")
AUTO_CHOICES = ("auto", "true", "false")  # StageRecipe.recompute_pointwise, StageRecipe.fuse_projections


@dataclasses.dataclass(frozen=True)
class StageRecipe:
    """How a stage runs beneath its switches. The entries marked *compiled* act only under ``torch_compile``; setting
    one on a run that does not compile is an error.

    Attributes:
        min_steps: *compiled*: a run of fewer optimizer steps than this runs eager and says why (compilation would
            not repay itself), until runs on this GPU have measured the same model, stage and batch both eager and
            compiled: then the measured break-even replaces it (:func:`hf_apex.autotune.compiled.compile_payback`);
            0 compiles whenever asked.
        recompute_pointwise: *compiled*: ``"true"``: the backward recomputes the pointwise results its matmuls read
            (a GELU's output) instead of keeping them from the forward: less activation memory for a little time;
            ``"auto"``: the same, except where the loss runs without the logits (``fused_linear_cross_entropy``),
            whose memory is low already; ``"false"``: torch's default.
        rotary_once: *compiled*: a RoPE model's cos and sin are computed once per forward
            (:mod:`hf_apex.kernels.models.rotary`), not inside every attention layer's kernels; the same values.
        eager_random: *compiled*: random ops (dropout's masks) run torch's own kernels inside the compiled graph
            instead of Inductor's per-element Philox; the same distribution.
        fuse_projections: *compiled*, Inductor: ``"true"``: linears that read one input (BERT's query/key/value, a
            Llama's q/k/v and gate/up) run as one matmul on their concatenated weights
            (:mod:`hf_apex.kernels.passes.projections`); the same dot products. ``"auto"``: the same except in a
            causal LM, where it slowed the Llama-architecture model. ``"false"``: off.
        compile_cache: *compiled*: the run loads the compiled work saved by an earlier run of the same model, stage
            and environment before it compiles, and saves its own after the metrics warm-up, in a ``compiled/``
            folder beside the autotune cache (``$HF_APEX_CACHE``, default ``~/.cache/hf_apex/``;
            :mod:`hf_apex.autotune.compiled`).
        static_masks: every run: an all-ones ``attention_mask`` is left out of the batches (not of batches padded to
            buckets, where it would make a second call signature) and SDPA's masks are
            decided without reading a tensor (:data:`hf_apex.kernels.models.attention.STATIC_MASKS`): no host-device
            sync, SDPA's ``is_causal`` under ``torch.compile``; the same attention.
        fp32_outputs: every run under autocast: accelerate's FP32 copy of the model's training outputs (the logits)
            is kept. Off, they stay in the autocast dtype; the loss is FP32 either way.
    """

    min_steps: int = 0
    recompute_pointwise: str = "false"
    rotary_once: bool = False
    eager_random: bool = False
    fuse_projections: str = "false"
    compile_cache: bool = True
    static_masks: bool = True
    fp32_outputs: bool = False

    COMPILED = ("min_steps", "recompute_pointwise", "rotary_once", "eager_random", "fuse_projections", "compile_cache")

    def __post_init__(self):
        for name in ("recompute_pointwise", "fuse_projections"):
            value = getattr(self, name)
            if isinstance(value, bool):  # True and False stand for "true" and "false"
                object.__setattr__(self, name, value := str(value).lower())
            if value not in AUTO_CHOICES:
                raise ValueError(f"stage_recipe: {name} must be one of {AUTO_CHOICES}, got {value!r}")
        if not isinstance(self.min_steps, int) or self.min_steps < 0:
            raise ValueError(f"stage_recipe: min_steps must be an integer >= 0, got {self.min_steps!r}")

    def with_overrides(self, overrides: dict | None) -> StageRecipe:
        """This recipe with ``overrides``' entries (a ``ValueError`` naming the entries for an unknown one)."""
        overrides = dict(overrides or {})
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ValueError(f"stage_recipe: unknown entries {unknown}; its entries are {names}")
        return dataclasses.replace(self, **overrides)

    def compiled_entries(self) -> dict:
        """The entries that differ from the defaults and act only under ``torch_compile``."""
        default = StageRecipe()
        return {n: getattr(self, n) for n in self.COMPILED if getattr(self, n) != getattr(default, n)}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """What one stage sets. Each field from ``optim`` to ``tf32`` is the `ApexTrainingArguments` field of that name.

    Attributes:
        name: registry key, e.g. ``"fused_adam"``.
        summary: one line for tables and ``--help``.
        recipe: how the stage runs beneath its switches (:class:`StageRecipe`).
        optim: HF's ``optim``: ``"adamw_torch"`` (foreach) or ``"adamw_torch_fused"``; ignored where
            ``apex_optimizer`` is set.
        apex_optimizer: ``"fused_adam"`` (apex FusedAdam, AdamW mode) or ``"none"``.
        apex_fused_norms: swap LayerNorm/RMSNorm for apex's fused norms.
        bf16: torch.amp autocast (BF16; FP16 with a GradScaler when ``amp_dtype="fp16"``); FP32 otherwise.
        torch_compile: ``torch.compile`` the model.
        torch_compile_mode: its mode (None: torch's default). A default: a value of yours wins (``OVERRIDABLE``).
        torch_compile_backend: its backend: ``"inductor"``, or ``"cudagraphs"``, which replays the traced kernels as
            CUDA graphs without generating code (the swapped norms then run apex's kernel inside them). A default.
        autotune: time apex against torch per component on this GPU and use the faster.
        fused_linear_cross_entropy: a causal LM's training loss without its logits
            (:mod:`hf_apex.kernels.models.loss`).
        attention_backend: the SDPA backend (:mod:`hf_apex.kernels.models.attention`): None for PyTorch's choice, a
            backend's name, or ``"fastest"`` (timed on the first batch). A default.
        tf32: always False: FP32 matmuls stay strict, so the ladder compares like with like.
        packing: the batches' layout (:mod:`hf_apex.data`): None (as given), ``"documents"``, ``"buckets"`` or
            ``"auto"`` (documents for a causal LM, buckets otherwise, nothing for examples of one length). A default.
    """

    name: str
    summary: str
    recipe: StageRecipe = StageRecipe()
    optim: str = "adamw_torch"
    apex_optimizer: str = "none"
    apex_fused_norms: bool = False
    bf16: bool = False
    torch_compile: bool = False
    torch_compile_mode: str | None = None
    torch_compile_backend: str | None = None
    autotune: bool = False
    fused_linear_cross_entropy: bool = False
    attention_backend: str | None = None
    tf32: bool = False
    packing: str | None = None

    # not switches of the ladder but tuning: the stage's value is a default you may change
    OVERRIDABLE = ("torch_compile_mode", "torch_compile_backend", "attention_backend", "packing")

    def settings(self) -> dict:
        """The arguments this stage sets, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[3:]}


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
            "compiled with CUDA graphs + a causal LM's loss without its logits + the SDPA backend timed fastest on "
            "this GPU + natural-length data packed or bucketed + the compile recipe (StageRecipe)",
            StageRecipe(
                min_steps=500,  # compilation repays itself after a few hundred steps
                recompute_pointwise="auto",
                rotary_once=True,
                eager_random=True,
                fuse_projections="auto",
            ),
            **_TORCH_FUSED,
            **_INDUCTOR,
            torch_compile_mode="reduce-overhead",  # CUDA graphs: one replay per graph, not a launch per kernel
            fused_linear_cross_entropy=True,
            attention_backend="fastest",
            packing="auto",  # natural-length data in a few fixed shapes: one compilation, CUDA graphs that hold
        ),
        StageConfig(
            "auto",
            "BF16 + the faster of apex/torch per component, timed on this GPU, replayed as CUDA graphs",
            StageRecipe(min_steps=2500),  # tracing and recording repay themselves after a few thousand steps
            **_APEX_ADAM,
            apex_fused_norms=True,
            bf16=True,
            autotune=True,
            # the step's own kernels (apex's norms among them) recorded once and replayed, without code generation:
            # the host no longer paces the GPU. One process, no gradient accumulation, a GPU: elsewhere it runs eager.
            torch_compile=True,
            torch_compile_backend="cudagraphs",
        ),
    )
}


def get_stage(name: str) -> StageConfig:
    try:
        return STAGES[name]
    except KeyError:
        raise ValueError(f"Unknown stage {name!r}; choose one of: {', '.join(STAGES)}") from None
