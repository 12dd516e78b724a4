"""Every reach into torch's, transformers' and accelerate's private API, in one place.

hf_apex works beneath the Trainer and the compiler, where some of what it needs has no public API. Each reach below
says what it uses and why; the rest of the package goes through these names and touches no private name of the
three projects (torch's ``torch._foreach_*`` ops aside: its documented multi-tensor API, which the optimizer's
fallback uses as torch's own optimizers do). Each is tested at both ends of the supported range, CI's lowest and
newest environments, and on the GPU machine: torch 2.11 to 2.13, transformers 5.17 to 5.25, accelerate 1.15 to
1.16. Where a reach is gone in a later release, the failure points here.

Two reaches are overrides, written where the class is: ``ApexTrainer._maybe_log_save_evaluate`` (taken only where
:func:`can_defer_logs` finds the tested signature) and ``_VALID_DICT_FIELDS`` (the fields ``TrainingArguments``
parses from JSON, extended: ``ApexTrainingArguments``' and the configs ``hf_apex.with_stages`` mixes), each built
from :func:`valid_dict_fields`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

# ---------------------------------------------------------------------------------------------------------- torch

# The compiler's configuration modules, by the names StagePlan patches around each step (``module.patch(...)``).
INDUCTOR_CONFIG = "torch._inductor.config"
FUNCTORCH_CONFIG = "torch._functorch.config"

# autocast's enter and exit inside traced graphs: functions AOTAutograd's cache must be told are safe to cache.
AUTOCAST_REGIONS = ("torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast")

# aten's linear, as Dynamo records it in a graph (besides ``torch.nn.functional.linear``).
ATEN_LINEAR = torch._C._nn.linear


def inductor_config():
    """Inductor's configuration module (``pre_grad_custom_pass``, ``unsafe_marked_cacheable_functions``)."""
    import torch._inductor.config

    return torch._inductor.config


def functorch_config():
    """AOTAutograd's configuration module (the partitioner's recomputation, its on-disk cache)."""
    import torch._functorch.config

    return torch._functorch.config


def compile_mode_options(mode: str) -> dict:
    """What ``torch.compile(mode=mode)`` sets, as torch's own table says (``triton.cudagraphs``...)."""
    import torch._inductor

    return torch._inductor.list_mode_options().get(mode, {})


def dynamo_counters():
    """Dynamo's and Inductor's process-wide counters (graphs compiled, cache hits, a pass's own tallies)."""
    from torch._dynamo.utils import counters

    return counters


def cuda_graphs_recorded(device: int) -> int:
    """The CUDA graphs torch's cudagraph trees hold on GPU ``device`` (a walk of its tree manager's nodes)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device, create_if_none_exists=False)
    nodes = list(manager.get_roots()) if manager is not None and manager.roots is not None else []
    recorded = 0
    while nodes:
        node = nodes.pop()
        recorded += 1
        nodes.extend(child for children in node.children.values() for child in children)
    return recorded


def fresh_cache_artifacts() -> contextlib.AbstractContextManager:
    """torch's record of compile-cache artifacts set apart while it lasts (so that a run saves its own only), then
    put back (``torch.compiler.save_cache_artifacts`` reads that record)."""
    from torch.compiler._cache import CacheArtifactManager

    return CacheArtifactManager.with_fresh_cache()


def cache_artifacts_new() -> bool:
    """Whether torch's record holds compile-cache artifacts not yet saved (``save_cache_artifacts`` has work)."""
    from torch.compiler._cache import CacheArtifactManager

    return CacheArtifactManager.need_serialize()


def custom_graph_pass():
    """Inductor's base class of a custom pass and its hash of source files (for its FX graph cache key)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    return CustomGraphPass, get_hash_for_files


def is_fake_tensor(value) -> bool:
    """Whether ``value`` is the fake tensor Dynamo traced a node with."""
    return isinstance(value, torch._subclasses.FakeTensor)


def op_schema(target):
    """The schema of an aten op (its ``is_mutable``), None for a target without one."""
    return getattr(target, "_schema", None)


def sdp_priority_order() -> list[int]:
    """SDPA's backend priority now, as torch keeps it."""
    return torch._C._get_sdp_priority_order()


def settle_sdp_priority(device: str = "cuda") -> None:
    """Make torch choose an SDPA backend once, which installs its CUDA default priority (it does so on the process's
    first choice, overwriting an order set before that)."""
    t = torch.zeros(1, 1, 16, 64, device=device, dtype=torch.bfloat16)
    torch._fused_sdp_choice(t, t, t)


def uncompiled(module: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (itself where it is not compiled)."""
    return getattr(module, "_orig_mod", module)


def mark_dynamic_length(tensor: torch.Tensor) -> None:
    """Mark ``tensor``'s dimension 1 dynamic for Dynamo's next trace of it, where the compiler lets it be (torch has
    no public name for it: ``torch._dynamo.maybe_mark_dynamic``)."""
    torch._dynamo.maybe_mark_dynamic(tensor, 1)


def has_triton() -> bool:
    """Whether Triton can run here (torch's own check; False where torch has no such check)."""
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()


def tree_map_only(cls, fn, tree):
    """``fn`` on every leaf of ``tree`` that is a ``cls``, the structure kept (torch's pytree)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(cls, fn, tree)


def local_tensor(tensor):
    """A DTensor's shard on this rank, the tensor itself (not a copy or a view of another autograd node), as FSDP2's
    own optimizer step reaches it."""
    return tensor._local_tensor


def cpu_has_bf16_instructions() -> bool:
    """Whether this x86 CPU has AVX512-BF16 or AMX tiles (torch's own probes; False where torch has neither)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


# ---------------------------------------------------------------------------------------------------- transformers


def attn_implementation(model: nn.Module) -> str | None:
    """The attention implementation ``model``'s config names (``"sdpa"``, ``"eager"``, a registered one)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def can_set_attn_implementation(model: nn.Module) -> bool:
    """Whether transformers lets ``model`` switch its attention implementation."""
    return hasattr(model, "set_attn_implementation") and model._can_set_attn_implementation()


def prepare_inputs(trainer, inputs):
    """A batch moved and shaped as the Trainer's training step gets it."""
    return trainer._prepare_inputs(inputs)


def train_batch_size(trainer) -> int:
    """The batch size the Trainer builds its training loader with: per device times the GPUs of DataParallel, lowered
    by ``auto_find_batch_size`` after an out-of-memory error."""
    return trainer._train_batch_size


def last_logged_step(trainer) -> int:
    """The optimizer step the Trainer logged last."""
    return trainer._globalstep_last_logged


def loss_items_counter(model: nn.Module, args) -> Callable[[dict], torch.Tensor | None]:
    """The Trainer's count of a batch's loss items (``num_items_in_batch``: a causal LM's shifted labels, for a model
    whose forward takes loss kwargs) for a training loop without the Trainer (``recipes/plain_loop.py``), by the
    Trainer's own private method on a bare instance that holds what it reads. The loss then divides by that input,
    as in the Trainer run: the same value, and under torch.compile the same graph (whose dtype depends on the
    transformers version)."""
    from transformers import Trainer
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    counter = object.__new__(Trainer)
    counter.args, counter.model, counter.compute_loss_func = args, model, None
    counter.accelerator, counter.is_deepspeed_enabled = SimpleNamespace(parallelism_config=None), False
    if hasattr(model, "accepts_loss_kwargs"):  # as Trainer.__init__ decides it
        counter.model_accepts_loss_kwargs = model.accepts_loss_kwargs
    else:
        params = inspect.signature(model.forward).parameters.values()
        counter.model_accepts_loss_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    config = getattr(model, "config", None)
    counter._loss_shifts_labels = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss and not (
        getattr(config, "is_encoder_decoder", False)
    )
    return lambda batch: counter._get_num_items_in_batch([batch], args.device)


# ``Trainer._maybe_log_save_evaluate``'s parameters as tested: ApexTrainer defers a logging step's log through it
# only where it has them; elsewhere the run logs as the stock Trainer does.
LOG_SAVE_EVALUATE_PARAMETERS = (
    "self",
    "tr_loss",
    "grad_norm",
    "model",
    "trial",
    "epoch",
    "ignore_keys_for_eval",
    "start_time",
    "learning_rate",
)


def can_defer_logs(trainer_cls: type | None = None) -> bool:
    """Whether ``trainer_cls``'s ``_maybe_log_save_evaluate`` (the stock Trainer's by default) takes the arguments
    ApexTrainer's deferred log passes."""
    if trainer_cls is None:
        from transformers import Trainer as trainer_cls
    method = getattr(trainer_cls, "_maybe_log_save_evaluate", None)
    if method is None:
        return False
    return tuple(inspect.signature(method).parameters) == LOG_SAVE_EVALUATE_PARAMETERS


def valid_dict_fields(cls) -> list[str]:
    """The fields a ``TrainingArguments`` class parses from JSON strings in its ``__post_init__``."""
    return list(cls._VALID_DICT_FIELDS)


# ------------------------------------------------------------------------------------------------------ accelerate


def reset_accelerate_state() -> None:
    """Drop accelerate's process-wide state (precision, compile), so that the next ``Accelerator`` sets its own; the
    distributed state (``PartialState``) stays."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def fp32_output_conversion(model: nn.Module):
    """accelerate's conversion of ``model``'s outputs to FP32 around its forward, where the model it prepared under
    native AMP has one (autocast inside, ``ConvertOutputsToFp32`` outside); else None. Its ``model_forward`` is the
    autocast forward, unbound when the forward was a method, as accelerate found it."""
    from accelerate.utils.operations import ConvertOutputsToFp32

    converting = getattr(model.__dict__.get("forward"), "__wrapped__", None)
    if "_original_forward" not in model.__dict__ or not isinstance(converting, ConvertOutputsToFp32):
        return None
    return converting
