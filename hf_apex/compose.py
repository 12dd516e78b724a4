"""The stages for any ``Trainer`` subclass and its config: ``with_stages(SFTTrainer)``, ``with_stages(SFTConfig)``.

TRL's trainers (``SFTTrainer``, ``DPOTrainer``, ...) and their configs subclass transformers' ``Trainer`` and
``TrainingArguments`` as :class:`~hf_apex.ApexTrainer` and :class:`~hf_apex.ApexTrainingArguments` do. Mixing the
classes by hand trains, but quietly takes ``TrainingArguments``' defaults back over the subclass's (a dataclass
collects its fields along the MRO, and ``ApexTrainingArguments`` carries every stock default), and TRL replaces an
``ApexTrainingArguments`` it is given with its own config, dropping the stage. ``with_stages`` builds the mix so
that the subclass keeps its defaults, its own arguments (where it has one of hf_apex's names, TRL's ``packing``,
its meaning wins), its data pipeline, losses and metrics::

    from trl import SFTConfig, SFTTrainer
    from hf_apex import with_stages

    args = with_stages(SFTConfig)(output_dir="out", stage="fastest")
    trainer = with_stages(SFTTrainer)(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)

What a stage then leaves to the subclass, and why, the metrics JSON says (``batches.layout``, and
``lm_loss`` where the subclass computes its loss itself)."""

from __future__ import annotations

import dataclasses
import functools
import typing

from transformers import Trainer, TrainingArguments

from .internals import valid_dict_fields
from .trainer import ApexTrainer
from .training_args import ADDED_ARGUMENTS, ApexTrainingArguments


@functools.cache
def with_stages(cls: type) -> type:
    """``cls`` with hf_apex's stages: a ``TrainingArguments`` subclass gets :class:`ApexTrainingArguments`'
    arguments, a ``Trainer`` subclass :class:`ApexTrainer`'s behaviour. The same class comes back for the same
    ``cls`` (pickling and ``isinstance`` work as for any class of a module)."""
    if isinstance(cls, type) and issubclass(cls, (ApexTrainer, ApexTrainingArguments)):
        return cls  # (already has them)
    if cls is Trainer or cls is TrainingArguments:
        return ApexTrainer if cls is Trainer else ApexTrainingArguments
    if isinstance(cls, type) and issubclass(cls, TrainingArguments):
        return _config_with_stages(cls)
    if isinstance(cls, type) and issubclass(cls, Trainer):
        return _trainer_with_stages(cls)
    raise TypeError(f"with_stages takes a Trainer or TrainingArguments subclass, got {cls!r}")


def _copy_field(f: dataclasses.Field) -> dataclasses.Field:
    kwargs = {"default_factory": f.default_factory} if f.default is dataclasses.MISSING else {"default": f.default}
    return dataclasses.field(**kwargs, init=f.init, repr=f.repr, metadata=f.metadata)


def _config_with_stages(base: type[TrainingArguments]) -> type:
    # Every field of the subclass is declared again on the mix, so that its defaults (TRL's learning rate, logging
    # steps, ...) stand over the stock ones that ApexTrainingArguments carries; hf_apex's own fields come after,
    # except those the subclass has too (its meaning wins).
    theirs = {f.name: f for f in dataclasses.fields(base)}
    ours = [f for f in dataclasses.fields(ApexTrainingArguments) if f.name in ADDED_ARGUMENTS]
    fields = [*theirs.values(), *(f for f in ours if f.name not in theirs)]
    # the types resolved where each class is written (HfArgumentParser reads them; as strings they would be looked
    # up in this module)
    hints = {**typing.get_type_hints(ApexTrainingArguments), **typing.get_type_hints(base)}
    namespace = {
        "__module__": __name__,
        "__qualname__": f"Apex{base.__name__}",
        "__doc__": f"``{base.__name__}`` with hf_apex's stages (:func:`hf_apex.with_stages`).",
        "__annotations__": {f.name: hints[f.name] for f in fields},
        **{f.name: _copy_field(f) for f in fields},
        "_VALID_DICT_FIELDS": list(dict.fromkeys(valid_dict_fields(base) + valid_dict_fields(ApexTrainingArguments))),
        "BASE_OWNED": frozenset(f.name for f in ours if f.name in theirs),
    }
    mix = dataclasses.dataclass(type(f"Apex{base.__name__}", (ApexTrainingArguments, base), namespace))
    globals()[mix.__qualname__] = mix  # (pickled by reference, as the Trainer's checkpoints save the arguments)
    return mix


def graphs_blocker(base: type[Trainer]) -> str | None:
    """Why a Trainer subclass's steps cannot run under CUDA graphs, or None: TRL's losses select the labelled
    positions (its own LM head), shapes known only from the data, which a graph cannot record (on an H100, torch 2.11
    and TRL 1.16: "operation not permitted when stream is capturing" in ``masked_scatter_backward``)."""
    owner = next((c for c in base.__mro__ if "compute_loss" in vars(c)), None)
    if owner is not None and owner.__module__.split(".")[0] == "trl":
        return f"{owner.__name__}.compute_loss selects the labelled positions, shapes CUDA graphs cannot record"
    return None


def _trainer_with_stages(base: type[Trainer]) -> type:
    namespace = {
        "__module__": __name__,
        "__qualname__": f"Apex{base.__name__}",
        "__doc__": f"``{base.__name__}`` with hf_apex's stages (:func:`hf_apex.with_stages`).",
        "ARRANGES_BATCHES": False,  # the subclass's own data pipeline (TRL tokenizes, packs and collates)
        "GRAPHS_BLOCKED": graphs_blocker(base),
    }
    mix = type(f"Apex{base.__name__}", (ApexTrainer, base), namespace)
    globals()[mix.__qualname__] = mix
    return mix
