"""Which of PyTorch's SDPA backends runs a model's attention.

transformers' ``sdpa`` attention calls ``torch.nn.functional.scaled_dot_product_attention``, and PyTorch picks a
backend (FlashAttention, cuDNN, memory-efficient, math) by a fixed priority and the inputs. The fastest one depends
on the GPU and the shape, and attention is a large part of a long-sequence step. ``attention_backend`` names one
backend, or ``"fastest"``:
:func:`capture` records the model's first SDPA call on a real batch and ``hf_apex.autotune.attention_probe`` times
each backend that can run it (forward and backward, the same shapes, memory layout, mask, dropout and scale) for the
autotuner, which keeps the fastest whose results match the math backend's in FP32. :func:`preferring` then puts
that backend first in SDPA's priority for the run's steps; inputs it cannot take fall back to the others. Every
backend computes the same attention; with dropout, each draws its own masks.

Which mask SDPA gets is the other half: :func:`use_static_masks` runs a model as :data:`STATIC_MASKS`, transformers'
``sdpa`` attention with its masks decided without reading a tensor (below).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import sys
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from transformers import masking_utils

from ...internals import (
    attn_implementation,
    can_set_attn_implementation,
    functorch_config,
    sdp_priority_order,
    settle_sdp_priority,
)
from ..trace import TORCH  # the autotuner's reference candidate: here, PyTorch's own choice

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
CHOICES = (*BACKENDS, "fastest")  # the values of ``attention_backend`` besides None (PyTorch's own choice)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """What a probe needs to replay a model's SDPA call: the tensors' shapes and memory layouts, not their values."""

    query: tuple[int, ...]
    key: tuple[int, ...]
    value: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    mask: torch.Tensor | None
    dropout_p: float
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    # query, key and value strides: a GPT-2 hands SDPA views into one (batch, tokens, 3 x width) projection, which a
    # kernel reads otherwise than contiguous heads. None: contiguous.
    strides: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None

    def describe(self) -> dict:
        """The decision key: everything that makes one backend faster than another."""
        mask = None if self.mask is None else {"shape": list(self.mask.shape), "dtype": str(self.mask.dtype)}
        return {
            "query": list(self.query),
            "key": list(self.key),
            "value": list(self.value),
            "dtype": str(self.dtype),
            "mask": mask,
            "dropout_p": self.dropout_p,
            "is_causal": self.is_causal,
            "scale": self.scale,
            "enable_gqa": self.enable_gqa,
            "strides": None if self.strides is None else [list(st) for st in self.strides],
        }


class _Seen(Exception):
    """Raised by the capture once it holds the first call: the rest of the forward is not needed."""


class _Capture(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.call: AttentionCall | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v, mask, dropout_p, is_causal, scale = _sdpa_args(*args, **kwargs)
            dtype = _computed_in(q)
            if mask is not None:
                mask = mask.detach().clone()
                mask = mask.to(dtype) if mask.is_floating_point() else mask
            self.call = AttentionCall(
                tuple(q.shape),
                tuple(k.shape),
                tuple(v.shape),
                dtype,
                q.device,
                mask,
                float(dropout_p),
                bool(is_causal),
                scale,
                bool(kwargs.get("enable_gqa", False)),
                (q.stride(), k.stride(), v.stride()),
            )
            raise _Seen
        return func(*args, **kwargs)


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    return query, key, value, attn_mask, dropout_p, is_causal, scale


def _computed_in(query: torch.Tensor) -> torch.dtype:
    """The dtype SDPA runs in: autocast's where autocast is on (it casts every floating input of the call; a Llama
    reaches SDPA with FP32 queries and keys after its rotary embedding, and BF16 values), else the query's."""
    device = query.device.type
    if query.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def capture(forward: Callable[[], object]) -> AttentionCall | None:
    """Run ``forward`` (a model's forward on a real batch) until its first SDPA call and return that call; None when
    the forward finishes without one (another attention implementation, or no attention). The forward runs without
    gradients and leaves the RNG as it found it."""
    mode = _Capture()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        try:
            with mode:
                forward()
        except _Seen:
            pass
    return mode.call


@contextlib.contextmanager
def preferring(backend: str | None):
    """SDPA's backends with ``backend`` first, then the others in PyTorch's own order; nothing changes for None or
    TORCH. Code compiled meanwhile is traced with that backend; AOTAutograd's on-disk cache, whose key leaves SDPA's
    priority out, is neither read nor written meanwhile (it would serve a graph traced under another priority)."""
    if backend in (None, TORCH):
        yield
        return
    if backend == "math":  # it runs every input, so it needs no fallback (and the CPU's choice ignores priority)
        kernels = sdpa_kernel([SDPBackend.MATH])
    else:
        _settle_default_priority()
        first, order = BACKENDS[backend], sdp_priority_order()
        rest = sorted((b for b in BACKENDS.values() if b is not first), key=lambda b: order.index(int(b)))
        kernels = sdpa_kernel([first, *rest], set_priority=True)
    config = functorch_config()
    uncached = config.patch(enable_autograd_cache=False) if hasattr(config, "enable_autograd_cache") else None
    with kernels, uncached or contextlib.nullcontext():
        yield


@functools.cache
def _settle_default_priority() -> None:
    """Have PyTorch install its CUDA default priority now. It does so on the process's first CUDA backend selection
    (cuDNN first on sm90/sm100 with a recent cuDNN), overwriting an order set before that, such as ours."""
    if torch.cuda.is_available():
        settle_sdp_priority()


def runnable(device: torch.device | str) -> dict[str, str]:
    """Which SDPA backends run a causal training call (forward and backward, 2 x 4 heads x 128 tokens x 64, BF16 on
    CUDA, FP32 elsewhere, no dropout) on ``device``: ``"ok"``, or why not."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {}
    for name, backend in BACKENDS.items():
        if device.type != "cuda" and name in ("cudnn", "efficient"):
            out[name] = "CUDA only"
            continue
        q, k, v = (torch.randn(2, 4, 128, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        with warnings.catch_warnings(record=True) as seen, sdpa_kernel([backend]):
            warnings.simplefilter("always", UserWarning)  # PyTorch says why a backend cannot run, then raises
            try:
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                out[name] = "ok"
            except RuntimeError as exc:
                why = [str(w.message).split(" (Triggered internally")[0] for w in seen]
                out[name] = "; ".join(w for w in why if not w.endswith("kernel not used because:")) or str(exc)
    return out


# Masks. transformers builds a model's 4D mask before its first attention layer and leaves it out (SDPA then takes
# `is_causal`, or no mask at all) only where it can tell that the mask is a plain causal or full pattern. Under
# torch.compile it never can (transformers 5.17 checks "tracing?" first; later releases ask torch whether it is
# exporting, which torch answers "yes" while compiling before 2.14), so every compiled step hands SDPA a full causal
# mask in place of `is_causal`. In eager it decides by reading the padding mask's values (`.all()`), a
# host-device sync on every forward. `STATIC_MASKS` is transformers' `sdpa` attention with a mask function that
# decides from what is known without reading a tensor: no padding mask (hf_apex's collator leaves out an all-ones one
# on the CPU) and no cache offset means no mask; a padding mask means the mask is built, without asking whether it is
# all ones. The attention computed is the same either way.
STATIC_MASKS = "hf_apex_sdpa"
_SDPA_LITERAL = re.compile(r"""_attn_implementation\s*[!=]=\s*["']sdpa["']""")


def _sdpa_mask(*args, **kwargs):
    """transformers' ``sdpa_mask``, deciding from static facts only (see above)."""
    if args:  # (transformers passes keywords; anything else gets its own function as it is)
        return masking_utils.sdpa_mask(*args, **kwargs)
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    plain = (
        kwargs.get("attention_mask") is None
        and kwargs.get("local_size") is None
        and type(q_offset) is int
        and type(kv_offset) is int
        and q_offset == kv_offset == 0
    )
    pattern = kwargs.get("mask_function", masking_utils.causal_mask_function)
    if plain and pattern is masking_utils.causal_mask_function and kwargs.get("allow_is_causal_skip", True):
        if kwargs["q_length"] == kwargs["kv_length"]:
            return None  # SDPA's is_causal (upper-left aligned: the same square)
    elif plain and pattern is masking_utils.bidirectional_mask_function and kwargs.get("allow_is_bidirectional_skip"):
        return None  # full attention
    if kwargs.get("attention_mask") is not None:  # built as it is, not first asked whether it is all ones
        kwargs = {**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False}
    return masking_utils.sdpa_mask(**kwargs)


# Packed sequences. With no padding mask and no KV cache (a training step: the Trainer turns the cache off, and an
# all-ones mask is left out), transformers asks the position ids whether a row packs several sequences
# (`find_packed_sequence_indices`). In eager it reads them to tell (`.all()`, a host-device sync per forward). Under
# torch.compile it cannot, and masks as if they did: SDPA gets a full (batch, 1, T, T) mask and no `is_causal`, so
# the kernels compute the whole square (on a CPU: tests/test_attention.py). A batch that brings no `position_ids`
# runs on the model's own, 0 to T-1 in every row: one sequence per row, as eager transformers finds by reading them.
# `one_sequence_per_row` says so for the steps it wraps.
def _one_sequence_per_row(position_ids):
    """transformers' ``find_packed_sequence_indices`` for position ids a model made itself: no packed sequences."""
    return None


@contextlib.contextmanager
def one_sequence_per_row(on: bool = True):
    """While on, transformers' mask functions take each row of the batch for one sequence (see above). Turn it on
    only for batches that carry no ``position_ids``."""
    if not on or not hasattr(masking_utils, "find_packed_sequence_indices"):
        yield
        return
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = _one_sequence_per_row
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@functools.cache
def _register_static_masks() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(STATIC_MASKS, sdpa_attention_forward)
    masking_utils.AttentionMaskInterface.register(STATIC_MASKS, _sdpa_mask)


def static_masks_blocker(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run :data:`STATIC_MASKS`, or None when it can (or already does)."""
    implementation = attn_implementation(model)
    if implementation == STATIC_MASKS:
        return None
    if implementation != "sdpa":
        return f"its attention is {implementation!r}, not transformers' 'sdpa'"
    if not can_set_attn_implementation(model):
        return "it cannot switch its attention implementation (it does not call transformers' AttentionInterface)"
    for name in sorted({type(m).__module__ for m in model.modules()}):
        if _tests_for_sdpa(name):
            return f"{name} tests for the name 'sdpa' itself"
    return None


@functools.cache
def _tests_for_sdpa(module_name: str) -> bool:
    """Whether a module's source compares ``_attn_implementation`` with "sdpa" (its code would then take another
    path under any other name)."""
    module = sys.modules.get(module_name)
    try:
        return module is not None and bool(_SDPA_LITERAL.search(inspect.getsource(module)))
    except (OSError, TypeError):
        return False


def use_static_masks(model: torch.nn.Module, on: bool = True) -> bool:
    """Run ``model``'s SDPA attention with :data:`STATIC_MASKS` (``on``) or with transformers' own masks again;
    returns whether it now runs with static masks. A model it does not fit (another attention implementation, one
    that tests for the name "sdpa") is left as it is."""
    implementation = attn_implementation(model)
    if not on:
        if implementation == STATIC_MASKS:
            model.set_attn_implementation("sdpa")
        return False
    if static_masks_blocker(model) is not None:
        return False
    if implementation != STATIC_MASKS:
        _register_static_masks()
        model.set_attn_implementation(STATIC_MASKS)
    return attn_implementation(model) == STATIC_MASKS
