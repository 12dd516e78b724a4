"""A causal LM whose training loss is :func:`~hf_apex.kernels.ops.lm_loss.causal_lm_loss`, without FP32 logits.

:func:`fuse_linear_cross_entropy` swaps a model's class, on that instance only, for a subclass whose forward
computes its training loss that way (``print(model)`` says so); evaluation, generation and calls without labels
run the stock forward. :func:`unsupported` says which models it fits and why not the others.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ...internals import uncompiled
from ..ops.lm_loss import _register_row_kernel, causal_lm_loss
from ..swap import Swap, restore, stock_class, swap

# Families whose LM forward is exactly ``loss_function(lm_head(base_model(...).last_hidden_state), labels)``.
SUPPORTED = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "olmo", "gpt_neox")
# Config attributes that put something between the head and the softmax in some families.
_LOGIT_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers causal LM by its class: a ``...ForCausalLM`` or a ``...LMHeadModel``
    (GPT-2's)."""
    return type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))


def settle_problem_type(model: nn.Module, labels) -> str | None:
    """A classifier's ``config.problem_type`` decided from ``labels`` by transformers' own rule (regression for one
    label, single-label for integer labels, multi-label otherwise), where it is still None and the model's forward
    would set it (:func:`sets_problem_type`); returns it. Under ``torch.compile`` the first forward's graph guards
    on it being None, and the second step compiles again."""
    from transformers import PreTrainedModel

    base = uncompiled(model)
    while not isinstance(base, PreTrainedModel) and isinstance(getattr(base, "module", None), nn.Module):
        base = base.module  # (DDP's and FSDP1's wrappers)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base  # (PEFT's wrapper)
    config = getattr(base, "config", None)
    if not isinstance(base, PreTrainedModel) or not torch.is_tensor(labels):
        return None
    if getattr(config, "problem_type", "") is None and sets_problem_type(base):
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    return getattr(config, "problem_type", None)


def sets_problem_type(model: nn.Module) -> bool:
    """Whether ``model``'s forward sets ``config.problem_type`` when it is None: its own code says so (BERT's and
    most text classifiers'), or it calls transformers' ``ForSequenceClassificationLoss`` (Llama's, the image and
    audio classifiers'). Some classifiers do neither (wav2vec2's cross-entropy): their config is left alone."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForSequenceClassificationLoss

    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    if "problem_type" in source:
        return True
    if "self.loss_function" not in source or "_loss_function" in vars(model):  # (a loss function of your own)
        return False
    return LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForSequenceClassificationLoss


def unsupported(model: nn.Module) -> str | None:
    """Why ``model``'s training loss cannot be computed by :func:`causal_lm_loss`, or None when it can: a
    transformers causal LM (``...ForCausalLM``, or GPT-2's ``GPT2LMHeadModel``) of a family in ``SUPPORTED``, whose
    forward is its base model then a bias-free linear head and nothing between the head and the softmax. Wrappers
    (PEFT's, say) and models with other heads are left alone."""
    from transformers import PreTrainedModel

    name = type(model).__name__
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model, PreTrainedModel) or not is_causal_lm(model):
        return f"{name}: not a transformers causal LM (...ForCausalLM)"
    if model_type not in SUPPORTED:
        return f"{name}: only causal LMs of {', '.join(SUPPORTED)} (not {model_type})"
    base = model.base_model
    if base is model or not isinstance(base, PreTrainedModel):
        return f"{name}: no base model apart from the head"
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return f"{name}: the LM head is not a bias-free nn.Linear"
    if getattr(model, "loss_type", None) not in (None, "ForCausalLM"):
        return f"{name}: its loss is {model.loss_type}, not the causal-LM cross-entropy"
    extras = [a for a in _LOGIT_EXTRAS if getattr(config, a, None) not in (None, 1, 1.0)]
    if extras:
        return f"{name}: its logits are transformed before the loss ({', '.join(extras)})"
    return None


class _FusedLossLM(Swap):
    """The forward of a model whose training loss is :func:`causal_lm_loss` (mixed in before its own class)."""

    def forward(self, *args, labels=None, **kwargs):
        # FP16 autocast keeps the stock loss: the chunks' gradients would be summed in FP16 before the GradScaler's
        # scale applies (the stock path lets the scaler lower the scale where this could only overflow).
        fp16 = (
            torch.is_autocast_enabled(self.device.type) and torch.get_autocast_dtype(self.device.type) == torch.float16
        )
        if labels is None or not self.training or not torch.is_grad_enabled() or fp16:
            return super().forward(*args, labels=labels, **kwargs)
        loss_kwargs = {k: kwargs.pop(k) for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in kwargs}
        kwargs.pop("logits_to_keep", None)
        outputs = self.base_model(*args, **kwargs)
        loss = causal_lm_loss(outputs[0], self.get_output_embeddings().weight, labels, **loss_kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,  # never computed
            hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
        )

    def extra_repr(self) -> str:
        return "training loss: chunked LM head + cross-entropy (hf_apex; no FP32 logits, vocabulary padded to x64)"

    @classmethod
    def swap_members(cls, stock_cls: type) -> dict:
        """The stock class's name, which ``save_pretrained`` writes into ``config.architectures`` for other tools to
        load by, and its forward's signature and docs: the Trainer keeps the dataset columns that the signature
        names. ``print(model)`` shows the swap in its first line inside."""

        @functools.wraps(stock_cls.forward)
        def forward(self, *args, **kwargs):
            return _FusedLossLM.forward(self, *args, **kwargs)

        return {**super().swap_members(stock_cls), "forward": forward}


def is_fused(model: nn.Module) -> bool:
    return isinstance(model, _FusedLossLM)


def stock_model_class(model: nn.Module) -> type:
    """The class ``model`` had before :func:`fuse_linear_cross_entropy` (wrappers that subclassed the swapped class
    since, such as FSDP2's, are not it)."""
    return stock_class(model, _FusedLossLM) or type(model)


def fuse_linear_cross_entropy(model: nn.Module) -> str | None:
    """Compute ``model``'s training loss with :func:`causal_lm_loss` (a class swap on this instance; idempotent).
    Returns None when done, else why not (the model is left as it was)."""
    if is_fused(model):
        return None
    reason = unsupported(model)
    if reason is None:
        swap(model, _FusedLossLM)
        _register_row_kernel()  # (here, before torch.compile traces the loss)
    return reason


def unfuse_linear_cross_entropy(model: nn.Module) -> bool:
    """Give ``model`` back its stock class; False (and nothing done) where a wrapper (FSDP2's) has subclassed the
    fused class since, which only that wrapper could undo."""
    return not is_fused(model) or restore(model, _FusedLossLM)
