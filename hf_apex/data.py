"""The batches a run trains on, in a few fixed shapes: packed documents for causal LMs, length buckets for the rest.

Fine-tuning data comes in natural lengths. Padded per batch to its longest example, as the stock collators do, half
to nine tenths of what a step computes is padding, and every new batch length is a new shape, which ``torch.compile``
compiles again and CUDA graphs record again. Two layouts remove most of it (``ApexTrainingArguments.packing``;
``"auto"`` picks one by the model and the data):

- ``"documents"`` (causal LMs): the examples are packed, best fit decreasing, into rows of ``packing_length``
  tokens (:func:`pack_documents`); each batch is ``per_device_train_batch_size`` such rows, always the same shape
  (:class:`PackedCollator`). Positions restart at every document, so transformers' masks keep attention inside each
  document (``find_packed_sequence_indices``: a causal mask per document, for SDPA, FlexAttention and eager alike),
  and the first token of each document is not a target of the one before: each document's tokens count once in the
  loss, with the same per-token losses as the padded run on the same examples. An example longer than a row is cut
  into pieces of a row each. What is left of a row after its documents is padding, a segment of its own whose labels
  are ignored.
- ``"buckets"`` (encoders, per-example losses): batches of examples of similar length (transformers'
  ``group_by_length`` sampler), each padded to the shortest of a few lengths that holds it (:func:`bucket_lengths`,
  :class:`BucketCollator`): a few shapes. Under ``torch.compile`` their length is dynamic from the first step
  (:func:`~hf_apex.runtime.mark_lengths_dynamic`), so one graph serves every bucket unless the compiler's guards on
  sizes split it, and CUDA graphs record once a bucket.
  A batch keeps its attention mask where it is all ones, so that each shape has one call signature.

A trainer with a data pipeline of its own keeps it; where that pipeline is padding-free (TRL's packing: one
flattened row a batch, as long as its examples), :func:`as_rows` lays each batch out as rows of one shape instead.

All three count the batch's real tokens on the host (``REAL_TOKENS``, taken out of the batch before the model sees
it) for the metrics' real tokens/s. Everything here is deterministic, so a run resumed from a checkpoint sees the same
rows in the same order (the Trainer's sampler restores its place).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import dataclasses
import logging
import math
import re
from collections.abc import Mapping, Sequence

import torch

from .internals import train_batch_size

logger = logging.getLogger("hf_apex")

LAYOUTS = ("off", "documents", "buckets", "auto")
REAL_TOKENS = "num_real_tokens"  # the batch's real (non-padding) tokens, an int: taken out before the forward
IGNORE_INDEX = -100
BUCKET_STEP = 16  # bucket lengths are multiples of this many tokens
BUCKET_GROWTH = 1.25  # each bucket at most this much longer than the one before (and 16 tokens at least)


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of at most ``capacity`` holding every index of ``lengths`` (each at most ``capacity``): the longest item
    first, each into the fullest bin it fits (a new bin where none does). Deterministic: ties keep index order."""
    if any(n > capacity or n < 0 for n in lengths):
        raise ValueError(f"every length must be between 0 and the capacity {capacity}")
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin) sorted: the fullest bin that fits is the first >= n
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            bins.append([i])
            room, b = capacity - n, len(bins) - 1
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            room -= n
        bisect.insort(free, (room, b))
    return bins


@dataclasses.dataclass(frozen=True)
class Piece:
    """Tokens ``start`` to ``stop`` of example ``example``: one document of a packed row."""

    example: int
    start: int
    stop: int


class PackedRows(torch.utils.data.Dataset):
    """Rows of documents (:class:`Piece`) over the examples' ``input_ids`` (and ``labels``, where they differ): item
    ``i`` is row ``i`` as lists of token ids, labels and positions (restarting at each document), for
    :class:`PackedCollator`."""

    def __init__(self, input_ids: list, labels: list | None, rows: list[list[Piece]], length: int):
        self.input_ids, self.labels, self.rows, self.length = input_ids, labels, rows, length

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ids, labels, positions = [], [], []
        for p in self.rows[i]:
            ids += self.input_ids[p.example][p.start : p.stop]
            source = self.labels[p.example] if self.labels is not None else self.input_ids[p.example]
            labels += source[p.start : p.stop]
            positions += range(p.stop - p.start)
        return {"input_ids": ids, "labels": labels, "position_ids": positions}

    @property
    def documents(self) -> int:
        return sum(len(r) for r in self.rows)

    @property
    def tokens(self) -> int:
        return sum(p.stop - p.start for r in self.rows for p in r)

    def __repr__(self) -> str:
        return f"PackedRows({len(self)} rows of {self.length} tokens, {self.documents} documents)"


def column(dataset, key: str) -> list | None:
    """Every example's ``key`` as a list (None where the examples have none): a ``datasets.Dataset``'s column, or
    ``dataset[i][key]`` for any other dataset with a length."""
    names = getattr(dataset, "column_names", None)
    if names is not None:
        return [list(v) for v in dataset[key]] if key in names else None
    if not hasattr(dataset, "__len__") or len(dataset) == 0 or not isinstance(dataset[0], Mapping):
        return None
    if key not in dataset[0]:
        return None
    return [list(dataset[i][key]) for i in range(len(dataset))]


def pack_documents(dataset, length: int) -> PackedRows:
    """``dataset``'s examples (``input_ids``, and ``labels`` where given) packed into rows of ``length`` tokens,
    best fit decreasing; an example longer than a row is cut into pieces of ``length`` tokens. Empty examples are
    left out."""
    if length < 2:
        raise ValueError(f"packing_length must be at least 2 tokens, got {length}")
    input_ids = column(dataset, "input_ids")
    if input_ids is None:
        raise ValueError("packing='documents' needs a tokenized dataset: examples with 'input_ids'")
    labels = column(dataset, "labels")
    if labels is not None and any(len(a) != len(b) for a, b in zip(labels, input_ids)):
        raise ValueError("packing='documents' needs per-token labels as long as each example's input_ids")
    if labels is not None and labels == input_ids:
        labels = None  # the usual case: the targets are the inputs (shifted by the model's loss)
    pieces = [
        Piece(e, at, min(at + length, len(ids)))
        for e, ids in enumerate(input_ids)
        for at in range(0, len(ids), length)
    ]
    bins = best_fit_decreasing([p.stop - p.start for p in pieces], length)
    rows = [sorted((pieces[i] for i in b), key=lambda p: (p.example, p.start)) for b in bins]
    rows.sort(key=lambda r: (r[0].example, r[0].start))  # in the data's order (the sampler shuffles them)
    return PackedRows(input_ids, labels, rows, length)


class PackedCollator:
    """Packed rows (:class:`PackedRows` items) into one batch of always the same shape: ``rows`` x ``length``
    ``input_ids``, ``labels`` and ``position_ids`` (restarting at each document), a short last batch filled up with
    rows of padding (an evaluation batch of more rows keeps them). The first token of each document, and all
    padding, are ignored by the loss (``-100``); the padding after a row's documents is a segment of its own.
    ``REAL_TOKENS``: the documents' tokens."""

    def __init__(self, length: int, rows: int, pad_token_id: int = 0):
        self.length, self.rows, self.pad_token_id = length, rows, pad_token_id

    def __call__(self, features: list[dict]) -> dict:
        shape = (max(self.rows, len(features)), self.length)  # (an evaluation batch may hold more rows)
        ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        positions = torch.arange(self.length).repeat(shape[0], 1)
        real = 0
        for r, row in enumerate(features):
            n = len(row["input_ids"])
            if n > self.length:
                raise ValueError(f"PackedCollator: a row of {n} tokens, longer than {self.length}")
            ids[r, :n] = torch.tensor(row["input_ids"], dtype=torch.long)
            labels[r, :n] = torch.tensor(row["labels"], dtype=torch.long)
            positions[r, :n] = torch.tensor(row["position_ids"], dtype=torch.long)
            positions[r, n:] = torch.arange(self.length - n)  # the padding: a segment of its own
            real += n
        labels[positions == 0] = IGNORE_INDEX  # a document's first token is no target of the one before
        return {"input_ids": ids, "labels": labels, "position_ids": positions, REAL_TOKENS: real}

    def __repr__(self) -> str:
        return f"PackedCollator({self.rows} rows x {self.length} tokens)"


# What a padding-free batch says of its one flattened row (flash attention's variable-length bounds, linear
# attention's sequence index): rows of one shape leave them out, and the model reads the documents from the positions.
FLAT_ROW_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})


class RowsCollator:
    """A padding-free collator (TRL's, which flattens a batch into one row as long as its examples together) made to
    give batches of ``rows`` x ``length``: each example collated alone, as that collator makes it (its labels, its
    positions restarting per document), then one example to a row as :class:`PackedCollator` lays them out. One
    shape for the whole run, and attention within rows of ``length`` rather than across one long row."""

    def __init__(self, collator, rows: int, length: int, pad_token_id: int = 0):
        self.collator, self.packed = collator, PackedCollator(length, rows, pad_token_id)

    def __call__(self, features: list[dict]) -> dict:
        rows = []
        for feature in features:
            one = self.collator([feature])
            left = set(one) - {"input_ids", "labels", "position_ids"} - FLAT_ROW_KEYS
            if left:
                raise ValueError(f"RowsCollator: {type(self.collator).__name__}'s batches hold {sorted(left)} too")
            rows.append({k: one[k][0].tolist() for k in ("input_ids", "labels", "position_ids")})
        return self.packed(rows)

    def __repr__(self) -> str:
        return f"RowsCollator({type(self.collator).__name__}, {self.packed.rows} rows x {self.packed.length} tokens)"


def bucket_lengths(longest: int, step: int = BUCKET_STEP, growth: float = BUCKET_GROWTH) -> list[int]:
    """The padded lengths of :class:`BucketCollator` up to ``longest``: multiples of ``step``, each at most
    ``growth`` times the one before (16, 32, 48, 64, 80, 112, 144, 192, ...): few shapes, little padding."""
    out = [step]
    while out[-1] < longest:
        out.append(max(out[-1] + step, math.ceil(out[-1] * growth / step) * step))
    return out


# What padding means, per key of a padded batch: input ids take the pad token, labels of a token are ignored.
_PAD_VALUES = {"attention_mask": 0, "token_type_ids": 0, "special_tokens_mask": 1, "labels": IGNORE_INDEX}


class BucketCollator:
    """A padding collator's batches padded further, to the shortest of ``buckets`` that holds them: the 2-D tensors
    of the batch (input ids, attention mask, token type ids, per-token labels) get more padding on the right. With
    examples grouped by length (the ``group_by_length`` sampler), few shapes and little padding. With ``rows`` (for
    training: the run's per-device batch size), a batch of fewer examples, the epoch's last, gets rows of padding
    that change nothing (:meth:`fill_rows`), so that it is no new shape; without, each batch keeps its examples only,
    as evaluation needs (its predictions are per row). ``REAL_TOKENS``: the attention mask's ones, the real rows'."""

    def __init__(
        self,
        collator,
        buckets: Sequence[int],
        pad_token_id: int = 0,
        rows: int | None = None,
        example_labels: bool = False,
    ):
        self.collator, self.buckets, self.pad_token_id = collator, sorted(buckets), pad_token_id
        self.rows, self.example_labels = rows, example_labels

    def __call__(self, features: list[dict]) -> dict:
        batch = dict(self.collator(features))
        ids = batch.get("input_ids")
        if not torch.is_tensor(ids) or ids.ndim != 2:
            return batch
        width = ids.shape[1]
        target = next((b for b in self.buckets if b >= width), width)
        if target > width:
            for key, value in batch.items():
                if torch.is_tensor(value) and value.ndim == 2 and value.shape == ids.shape:
                    fill = _PAD_VALUES.get(key, self.pad_token_id)
                    batch[key] = torch.nn.functional.pad(value, (0, target - width), value=fill)
        mask = batch.get("attention_mask")
        real = int(mask.sum()) if torch.is_tensor(mask) else ids.numel()
        batch = self.fill_rows(batch)
        batch[REAL_TOKENS] = real
        return batch

    def fill_rows(self, batch: dict) -> dict:
        """``batch`` with rows of padding up to ``rows``, where every key has a padding the loss ignores: the pad
        token, ``_PAD_VALUES`` (masks 0, per-token labels ``-100``), and ``-100`` for an example's one integer label
        where the model's loss ignores it (``example_labels``: :func:`ignores_example_labels`). The loss is then the
        short batch's (the mean is over the labels not ignored), and so is ``num_items_in_batch``. Anything else (a
        float label: regression, multi-label targets; a key of unknown meaning) leaves the batch short."""
        n, width = batch["input_ids"].shape
        if self.rows is None or n >= self.rows:
            return batch
        fills = {}
        for key, value in batch.items():
            if not torch.is_tensor(value) or value.shape[:1] != (n,):
                return batch
            integer = not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool
            if key == "input_ids":
                fills[key] = self.pad_token_id
            elif key in _PAD_VALUES and value.shape == (n, width) and (key != "labels" or integer):
                fills[key] = _PAD_VALUES[key]
            elif key == "labels" and value.shape == (n,) and integer and self.example_labels:
                fills[key] = IGNORE_INDEX
            else:
                return batch
        more = self.rows - n
        return {k: torch.cat([v, v.new_full((more, *v.shape[1:]), fills[k])]) for k, v in batch.items()}

    def __repr__(self) -> str:
        rows = f", rows={self.rows}" if self.rows is not None else ""
        return f"BucketCollator({self.collator!r}, buckets={self.buckets}{rows})"


def ignores_example_labels(model) -> bool:
    """Whether ``model``'s loss ignores an example whose one label is ``-100``: transformers' single-label sequence
    classification, a cross-entropy (``ignore_index=-100``) over integer labels. Its regression (one label, the
    default for ``num_labels=1``) would take ``-100`` for a target."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if not type(base).__name__.endswith("ForSequenceClassification") or config is None:
        return False
    problem = getattr(config, "problem_type", None)
    return problem == "single_label_classification" or (problem is None and getattr(config, "num_labels", 1) > 1)


@contextlib.contextmanager
def training_collator(trainer):
    """``trainer.data_collator`` made the training batches' while the training loader is built: the layout's
    training collator (:attr:`Batches.train_collator`: a short batch of buckets filled with rows the loss ignores;
    packed rows: the layout's one collator) takes the layout collator's place inside the trainer's (which may wrap
    it), filling to the batch size the loader is built with (``auto_find_batch_size`` may have lowered it since).
    Evaluation, built from the same attribute, keeps its real rows only."""
    batches, collator = getattr(trainer, "batches", None), trainer.data_collator
    layout = None if batches is None else batches.train_collator or batches.collator
    if getattr(layout, "rows", None) is None:
        yield
        return
    train = copy.copy(layout)
    train.rows = train_batch_size(trainer)
    trainer.data_collator = _replacing(collator, batches.collator, train)
    try:
        yield
    finally:
        trainer.data_collator = collator


def wraps(collator, cls: type) -> bool:
    """Whether ``collator`` is a ``cls`` or wraps one (``.collator``, where hf_apex's collators keep the one below)."""
    while collator is not None:
        if isinstance(collator, cls):
            return True
        collator = getattr(collator, "collator", None)
    return False


def _replacing(collator, old, new):
    """``collator`` with ``old`` replaced by ``new``, where ``old`` is it or a collator it wraps (``.collator``); a
    wrapper is copied only where something below it is replaced."""
    if collator is old:
        return new
    inner = getattr(collator, "collator", None)
    replaced = _replacing(inner, old, new) if inner is not None else inner
    if replaced is inner:
        return collator
    outer = copy.copy(collator)
    outer.collator = replaced
    return outer


def take_real_tokens(inputs):
    """``inputs`` without ``REAL_TOKENS``, and its value (None where the batch has none)."""
    if not isinstance(inputs, Mapping) or REAL_TOKENS not in inputs:
        return inputs, None
    inputs = dict(inputs)
    return inputs, int(inputs.pop(REAL_TOKENS))


def replaces(collator) -> str | None:
    """Why packing documents would drop something ``collator`` does (None: it only pads, as the packed rows do
    without it): a collator of yours may make labels (a completion-only mask) or other inputs."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding, default_data_collator

    if collator is None or collator is default_data_collator or type(collator) is DataCollatorWithPadding:
        return None
    if type(collator) is DataCollatorForLanguageModeling and not collator.mlm:
        return None
    return f"the collator {type(collator).__name__} may do more than pad, which packed rows would leave out"


def packs_documents(model) -> str | None:
    """Why ``model`` cannot train on packed documents, or None when it can: a transformers causal LM (PEFT's wrapper
    looked through) whose masks come from transformers' masking utilities, which read documents from the position
    ids."""
    import inspect
    import sys

    from .kernels.models.loss import is_causal_lm

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not is_causal_lm(base):
        return f"{type(base).__name__} is not a causal LM"
    module = sys.modules.get(type(base).__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        source = ""
    if not re.search(r"create_(sliding_window_)?causal_mask\(", source):
        return f"{type(base).__name__} builds its attention masks itself, not from the position ids"
    return None


@dataclasses.dataclass
class Batches:
    """What a run trains and evaluates on under a layout: the datasets, the collator, the sampler strategy
    (``group_by_length`` for buckets) and what the metrics JSON says of it. ``train_collator``, where given, is the
    training batches' (buckets: a short batch filled up with rows of padding); ``collator`` then serves evaluation,
    whose batches keep their real rows only."""

    layout: str
    train_dataset: object
    eval_dataset: object
    collator: object
    sampling: str | None
    report: dict
    train_collator: object = None

    def arguments(self, args):
        """``args``, or a copy that samples the training set as this layout needs (buckets: grouped by length)."""
        if not self.sampling or args.train_sampling_strategy == self.sampling:
            return args
        args = copy.copy(args)
        args.train_sampling_strategy = self.sampling
        return args


def default_collator(processing_class):
    """The collator ``Trainer`` takes when given none: padding with the tokenizer, else ``default_data_collator``."""
    from transformers import DataCollatorWithPadding, default_data_collator

    if processing_class is not None and hasattr(processing_class, "pad"):
        return DataCollatorWithPadding(processing_class)
    return default_data_collator


def for_run(args, model, train_dataset, eval_dataset, collator, processing_class) -> Batches | None:
    """The batches of a run whose arguments ask for a layout (``args.packing``), else None. Without a collator of
    yours, the one ``Trainer`` would take."""
    if getattr(args, "packing", None) in (None, "off"):
        return None
    return arrange(
        args.packing,
        model,
        train_dataset,
        eval_dataset,
        collator or default_collator(processing_class),
        rows=args.per_device_train_batch_size,
        length=args.packing_length,
        pad_token_id=getattr(processing_class, "pad_token_id", None),
    )


def arrange(layout, model, train_dataset, eval_dataset, collator, *, rows, length=None, pad_token_id=None) -> Batches:
    """The run's batches under ``layout`` (one of ``LAYOUTS``; ``"auto"``: packed documents for a causal LM that can
    take them, else buckets; nothing where every example has one length). ``rows``: examples (or packed rows) per
    batch (a short training batch of buckets is filled up to it); ``length``: a packed row's tokens (default: the
    model's maximum positions, at most 1024). Packed documents are packed for evaluation too (the collator serves
    both)."""
    lengths = column(train_dataset, "input_ids") if layout != "off" else None
    pad = pad_token_id if pad_token_id is not None else getattr(getattr(model, "config", None), "pad_token_id", None)
    pad = pad if isinstance(pad, int) else 0
    off = Batches("off", train_dataset, eval_dataset, collator, None, {"layout": "off"})
    if layout == "off":
        return off
    if lengths is None:
        why = "the training set has no 'input_ids' (not tokenized, or not a dataset of examples with a length)"
        if layout != "auto":
            raise ValueError(f"packing={layout!r}: {why}")
        return dataclasses.replace(off, report={"layout": "off", "why": why})
    sizes = [len(ids) for ids in lengths]
    if layout == "auto":
        if len(set(sizes)) <= 1:
            why = f"every training example has {sizes[0] if sizes else 0} tokens: no padding to remove"
            return dataclasses.replace(off, report={"layout": "off", "why": why})
        if model is None:
            return dataclasses.replace(off, report={"layout": "off", "why": "no model yet (model_init)"})
        blocker = packs_documents(model) or replaces(collator)
        layout = "documents" if blocker is None else "buckets"
        why = "a causal LM: documents packed" if blocker is None else f"buckets: {blocker}"
    else:
        why = "asked for"
        if layout == "documents" and (blocker := packs_documents(model)):
            raise ValueError(f"packing='documents': {blocker}; use packing='buckets'")
        if layout == "documents" and (blocker := replaces(collator)):
            logger.warning("hf_apex: packing='documents': %s; the packed rows' labels come from the dataset.", blocker)
    if layout == "documents":
        positions = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 1024
        length = length or min(positions, 1024)
        if length > positions:
            raise ValueError(f"packing_length={length} is longer than the model's {positions} positions")
        train = pack_documents(train_dataset, length)
        if isinstance(eval_dataset, Mapping):  # several evaluation sets, by name
            evaluation = {name: pack_documents(ds, length) for name, ds in eval_dataset.items()}
        else:
            evaluation = pack_documents(eval_dataset, length) if eval_dataset is not None else None
        cut = sum(n > length for n in sizes)
        report = {
            "layout": "documents",
            "why": why,
            "row_length": length,
            "rows_per_batch": rows,
            "documents": len(sizes),
            "rows": len(train),
            "examples_cut": cut,  # longer than a row: cut into pieces of a row each
            "padding_share_of_rows": round(1 - train.tokens / (len(train) * length), 4) if len(train) else None,
        }
        return Batches("documents", train, evaluation, PackedCollator(length, rows, pad), None, report)
    buckets = bucket_lengths(max(sizes))
    report = {"layout": "buckets", "why": why, "buckets": buckets, "sampler": "group_by_length"}
    if why != "asked for":
        logger.warning(
            "hf_apex: packing='auto' puts this run's examples in length buckets: less padding and few shapes, but "
            "batches grouped by length, not drawn at random, which can cost accuracy (docs/data.md); "
            "packing='off' keeps your collator's random batches."
        )
    evaluation = BucketCollator(collator, buckets, pad)
    train = BucketCollator(collator, buckets, pad, rows=rows, example_labels=ignores_example_labels(model))
    return Batches("buckets", train_dataset, eval_dataset, evaluation, "group_by_length", report, train)


def as_rows(trainer_name: str, args, collator) -> Batches | None:
    """A trainer's own padding-free batches (TRL's ``padding_free``, which its packing turns on) as rows of one shape
    (:class:`RowsCollator`), the row as long as the trainer's ``max_length``; None where the collator is not
    padding-free or the length is not known."""
    length = getattr(args, "max_length", None)
    if not getattr(collator, "padding_free", False) or not isinstance(length, int):
        return None
    rows = args.per_device_train_batch_size
    report = {
        "layout": "rows",
        "why": f"{trainer_name}'s padding-free batches (one row of varying length) laid out one example to a row of "
        f"max_length tokens: one shape",
        "row_length": length,
        "rows_per_batch": rows,
    }
    collator = RowsCollator(collator, rows, length, getattr(collator, "pad_token_id", None) or 0)
    return Batches("rows", None, None, collator, None, report)
