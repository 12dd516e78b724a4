"""Packed documents and length buckets (hf_apex.data): the layout, the same maths as the padded run, the trainer."""

import json
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoTokenizer,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    default_data_collator,
)

from hf_apex import ApexTrainer, ApexTrainingArguments
from hf_apex.data import (
    IGNORE_INDEX,
    REAL_TOKENS,
    BucketCollator,
    PackedCollator,
    arrange,
    best_fit_decreasing,
    bucket_lengths,
    pack_documents,
)
from hf_apex.kernels.models.attention import use_static_masks
from hf_apex.measure.report import METRICS_FILENAME
from tests.testing_utils import SHARED_DATA, VOCAB, TokenDataset, require_shared_data, tiny_model, word_level_tokenizer

CAUSAL = ["gpt2", "llama", "qwen3", "gpt_neox"]


def documents(n=9, lo=2, hi=30, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class Examples(torch.utils.data.Dataset):
    """Tokenized examples of their own lengths, as a map over the raw text gives them (no padding, no labels)."""

    def __init__(self, docs, label=None):
        self.docs, self.label = docs, label

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        item = {"input_ids": self.docs[i], "attention_mask": [1] * len(self.docs[i])}
        if self.label is not None:
            item["labels"] = i % 2
        return item


def test_best_fit_decreasing_places_every_item_once_within_the_capacity():
    lengths = [random.Random(s).randint(1, 50) for s in range(200)]
    bins = best_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 64) + 3  # near the lower bound: BFD wastes little on such items
    assert best_fit_decreasing(lengths, 64) == bins  # deterministic
    assert best_fit_decreasing([5, 3, 4, 2, 8, 1], 8) == [[4], [0, 1], [2, 3, 5]]
    with pytest.raises(ValueError, match="capacity"):
        best_fit_decreasing([9], 8)


def test_packed_batches_have_one_shape_positions_per_document_and_no_cross_document_targets():
    docs = documents(n=7) + [list(range(3, 3 + 45))]  # the last is longer than a row: cut into two pieces
    rows = pack_documents(Examples(docs), 32)
    assert rows.tokens == sum(map(len, docs)) and rows.documents == len(docs) + 1
    collate = PackedCollator(32, rows=4)
    batches = [collate([rows[i] for i in range(s, min(s + 4, len(rows)))]) for s in range(0, len(rows), 4)]
    assert {tuple(b["input_ids"].shape) for b in batches} == {(4, 32)}  # a short last batch is filled up
    assert sum(b[REAL_TOKENS] for b in batches) == sum(map(len, docs))
    for b in batches:
        starts = b["position_ids"] == 0
        assert (b["labels"][starts] == IGNORE_INDEX).all()  # a document's first token: no target of the one before
        assert ((b["labels"] != IGNORE_INDEX).sum() + starts.sum()) >= b[REAL_TOKENS]
    # every document comes back whole (pieces of the long one in order), its positions counting from 0
    seen = []
    for r in range(len(rows)):
        row = rows[r]
        cuts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        seen += [row["input_ids"][a:b] for a, b in zip(cuts, cuts[1:])]
    assert sorted(seen) == sorted(docs[:-1] + [docs[-1][:32], docs[-1][32:]])


def _per_token_losses(logits, ids, labels):
    """Each position's loss on the next token (the model's own shift), NaN where it is ignored."""
    target = labels[:, 1:]
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), target.flatten(), reduction="none").view_as(target)
    return loss.masked_fill(target == IGNORE_INDEX, float("nan"))


def _losses_by_document(model, docs, length, **forward):
    """Per-token losses of each document, from one packed forward and from one padded forward (right padding,
    attention mask, padding ignored), in ``docs``' order."""
    rows = pack_documents(Examples(docs), length)
    batch = PackedCollator(length, rows=len(rows))(list(rows))
    forward = {"use_cache": False, **forward}  # (as the Trainer runs it: a cache turns the packing check off)
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **forward).logits
    packed = _per_token_losses(packed, batch["input_ids"], batch["labels"])
    by_doc = []
    for r, row in enumerate(rows.rows):
        at = 0
        for piece in row:
            size = piece.stop - piece.start
            by_doc.append((piece.example, packed[r, at : at + size - 1]))
            at += size
    by_doc = [losses for _, losses in sorted(by_doc, key=lambda x: x[0])]
    width = max(map(len, docs))
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)] = torch.tensor(d), 1
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    padded = _per_token_losses(model(input_ids=ids, attention_mask=mask, **forward).logits, ids, labels)
    return by_doc, [padded[i, : len(d) - 1] for i, d in enumerate(docs)]


@pytest.mark.parametrize("family", CAUSAL)
@pytest.mark.parametrize("attention", ["sdpa", "hf_apex_sdpa", "eager"])
def test_each_token_of_a_packed_document_has_the_padded_runs_loss(family, attention):
    model = tiny_model(family)
    if attention == "hf_apex_sdpa":
        assert use_static_masks(model)
    elif attention == "eager":
        model.set_attn_implementation("eager")
    docs = documents()
    with torch.no_grad():
        packed, padded = _losses_by_document(model, docs, 48)
    for p, q in zip(packed, padded):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)  # FP32: the same sums in other shapes


def test_under_torch_compile_the_masks_are_built_from_the_positions_too():
    # Traced, transformers cannot ask the positions whether rows hold several documents: it masks as if they do.
    model = tiny_model("llama")
    use_static_masks(model)
    compiled = torch.compile(model, backend="eager", fullgraph=False)
    docs = documents(seed=3)
    with torch.no_grad():
        packed, padded = _losses_by_document(compiled, docs, 48)
    for p, q in zip(packed, padded):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def _no_dropout(model):
    for m in model.modules():  # passes that must differ only in the data
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


@pytest.mark.parametrize("family", CAUSAL)
def test_a_documents_gradients_do_not_depend_on_its_neighbour(family):
    model = _no_dropout(tiny_model(family).train())
    neighbour, other, second = documents(n=3, lo=12, hi=12, seed=5)

    def grads(first, positions=True):
        batch = PackedCollator(24, rows=1)([pack_documents(Examples([first, second]), 24)[0]])
        assert batch["input_ids"][0, 12:].tolist() == second  # the neighbour comes first in the row
        batch["labels"][0, :12] = IGNORE_INDEX  # the loss of the second document alone
        inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"], "use_cache": False}
        if positions:
            inputs["position_ids"] = batch["position_ids"]
        model.zero_grad()
        model(**inputs).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    for a, b in zip(grads(neighbour), grads(other)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # one sequence per row (no positions): the second document attends to its neighbour, and the test would fail
    assert any(not torch.allclose(a, b) for a, b in zip(grads(neighbour, False), grads(other, False)))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_document_after_a_neighbour_learns_the_same_as_alone(family):
    """The document that comes second in its row: its loss and gradients equal those of the same document alone."""
    model = _no_dropout(tiny_model(family).train())
    first, second = documents(n=2, lo=10, hi=10, seed=7)

    def grads(ids, positions, labels):
        model.zero_grad()
        inputs = {"input_ids": ids, "labels": labels, "use_cache": False}
        if positions is not None:
            inputs["position_ids"] = positions
        loss = model(**inputs).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    rows = pack_documents(Examples([first, second]), 20)
    batch = PackedCollator(20, rows=1)([rows[0]])
    row = rows[0]["input_ids"]
    at = 10 if row[:10] == first else 0  # where the second document sits in the row
    labels = batch["labels"].clone()
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[0, at + 1 : at + 10] = True
    labels[~keep] = IGNORE_INDEX
    alone = torch.tensor([second])
    loss_alone, grads_alone = grads(alone, None, alone.clone())
    loss_packed, grads_packed = grads(batch["input_ids"], batch["position_ids"], labels)
    torch.testing.assert_close(loss_packed, loss_alone, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_packed, grads_alone):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if at:  # without the positions the second document attends to the first: the loss changes (the test can fail)
        loss_unmasked, _ = grads(batch["input_ids"], None, labels)
        assert not torch.allclose(loss_unmasked, loss_alone, rtol=1e-4)


def test_buckets_pad_each_batch_to_one_of_a_few_lengths():
    assert bucket_lengths(66) == [16, 32, 48, 64, 80]
    assert bucket_lengths(512)[-1] >= 512 and len(bucket_lengths(512)) <= 14

    class Tok:
        pad_token_id = 0
        model_input_names = ["input_ids", "attention_mask"]

        def pad(self, features, **kw):
            width = max(len(f["input_ids"]) for f in features)
            ids = [f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features]
            mask = [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
            out = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
            if "labels" in features[0]:
                out["labels"] = torch.tensor([f["labels"] for f in features])
            return out

    collate = BucketCollator(Tok().pad, bucket_lengths(66))
    examples = [{"input_ids": d, "labels": 1} for d in documents(n=5, lo=17, hi=20)]
    batch = collate(examples)
    assert batch["input_ids"].shape[1] == 32 and batch["attention_mask"][:, 20:].sum() == 0
    assert batch["labels"].shape == (5,)  # one label per example: untouched
    assert batch[REAL_TOKENS] == sum(len(e["input_ids"]) for e in examples)


def sentences(docs, labels) -> list[dict]:
    """Tokenized examples as a tokenizer gives them (token types, special tokens mask), with ``labels``."""
    return [
        {
            "input_ids": d,
            "token_type_ids": [0] * len(d),
            "attention_mask": [1] * len(d),
            "special_tokens_mask": [0] * len(d),
            "labels": y,
        }
        for d, y in zip(docs, labels)
    ]


def test_a_short_training_batch_of_buckets_is_filled_up_to_the_batch_size_with_padding_rows():
    tok, docs = word_level_tokenizer(), documents(n=5, lo=2, hi=30, seed=5)
    batches = arrange(
        "buckets", tiny_model("bert"), Examples(docs, label=True), None, DataCollatorWithPadding(tok), rows=8
    )
    train, evaluation = batches.train_collator, batches.collator
    assert train.rows == 8 and train.example_labels and evaluation.rows is None  # evaluation: the real rows only
    features = sentences(docs, [i % 2 for i in range(5)])
    short, full = evaluation(features), train(features)
    width = short["input_ids"].shape[1]
    assert width in batches.report["buckets"] and short["input_ids"].shape == (5, width) and set(full) == set(short)
    assert full[REAL_TOKENS] == short[REAL_TOKENS] == sum(map(len, docs))
    fills = {
        "input_ids": tok.pad_token_id,
        "token_type_ids": 0,
        "attention_mask": 0,
        "special_tokens_mask": 1,
        "labels": IGNORE_INDEX,
    }
    for key, fill in fills.items():
        assert full[key].shape == (8, *short[key].shape[1:]) and full[key].dtype == short[key].dtype
        assert torch.equal(full[key][:5], short[key]) and (full[key][5:] == fill).all()
    assert train(features + features[:3])["input_ids"].shape[0] == 8  # a full batch as it was
    per_token = BucketCollator(DataCollatorForTokenClassification(tok), batches.report["buckets"], rows=8)
    tagged = per_token([{**f, "labels": [1] * len(f["input_ids"])} for f in features])  # token classification
    assert tagged["labels"].shape == (8, width) and (tagged["labels"][5:] == IGNORE_INDEX).all()
    unmasked = BucketCollator(default_data_collator, [16], rows=8, example_labels=True)  # no mask: every token counts
    blocks = unmasked([{"input_ids": d, "labels": 1} for d in documents(n=5, lo=16, hi=16)])
    assert blocks["input_ids"].shape == (8, 16) and blocks[REAL_TOKENS] == 5 * 16  # the real rows' only


@pytest.mark.parametrize("source", ["generated", pytest.param("sst2", marks=require_shared_data)])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_bert_learns_from_a_filled_batch_what_it_learns_from_the_short_one(source, attention):
    """FP32 on the CPU. The padding rows' labels are ignored (the mean is over the real rows) and their gradients are
    zeros, so the loss and the gradients are the short batch's up to rounding: the matrix products over 32 rows
    rather than 21 may sum in other blocks (the real rows' logits can differ in their last bits)."""
    if source == "sst2":  # as many sentences as SST-2's last batch at 32 a batch holds: 67,349 = 2,104 x 32 + 21
        lines = (SHARED_DATA / "sst2" / "train.tsv").read_text().splitlines()[1:]
        tok = AutoTokenizer.from_pretrained(SHARED_DATA / "tokenizers" / "bert-base-uncased")
        rows = [line.rsplit("\t", 1) for line in lines[len(lines) - len(lines) % 32 :]]
        features = [{**tok(text.strip()), "labels": int(label)} for text, label in rows]
    else:
        tok = word_level_tokenizer()
        docs = documents(n=21, lo=2, hi=40, seed=7)
        features = sentences(docs, [i % 2 for i in range(21)])
    assert len(features) == 21
    model = tiny_model("bert", vocab_size=len(tok), attn_implementation=attention)  # (eval(): no dropout)
    lengths = [len(f["input_ids"]) for f in features]
    batches = arrange(
        "buckets", model, Examples([[3] * n for n in lengths]), None, DataCollatorWithPadding(tok), rows=32
    )

    def step(batch):
        model.zero_grad()
        batch = {k: v for k, v in batch.items() if k != REAL_TOKENS}
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    short, full = batches.collator(features), batches.train_collator(features)
    assert short["input_ids"].shape[0] == 21 and full["input_ids"].shape == (32, short["input_ids"].shape[1])
    (loss, grads), (loss_full, grads_full) = step(short), step(full)
    torch.testing.assert_close(loss_full, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_full[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    counted = dict(full, labels=full["labels"].clamp(min=0))  # padding rows that are not ignored: the test can fail
    assert not torch.allclose(step(counted)[0], loss, rtol=1e-3)


def test_a_batch_whose_padding_rows_would_count_stays_short():
    tok, docs = word_level_tokenizer(), documents(n=5, lo=2, hi=30, seed=8)
    pad, buckets = DataCollatorWithPadding(tok), bucket_lengths(32)
    trusting = BucketCollator(pad, buckets, rows=8, example_labels=True)
    regression = sentences(docs, [0.5 * i for i in range(5)])  # float labels: an MSE would take -100 for a target
    assert trusting(regression)["input_ids"].shape[0] == 5
    multi_label = sentences(docs, [[1.0, 0.0, 1.0]] * 5)  # BCE over every label
    assert trusting(multi_label)["labels"].shape == (5, 3)
    spans = [{**f, "start_positions": 1} for f in sentences(docs, [0] * 5)]  # a key of unknown padding
    assert trusting(spans)["input_ids"].shape[0] == 5
    classes = sentences(docs, [i % 2 for i in range(5)])
    assert trusting(classes)["input_ids"].shape[0] == 8
    for model in (tiny_model("bert", num_labels=1), tiny_model("roberta"), None):  # regression, a masked LM, unknown
        train = arrange("buckets", model, Examples(docs, label=True), None, pad, rows=8).train_collator
        assert not train.example_labels and train(classes)["input_ids"].shape[0] == 5


def train_args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-3,
        metrics_warmup_steps=0,
        disable_tqdm=True,
        seed=0,
        stage="baseline",
    )
    return ApexTrainingArguments(**{**base, **kw})


def test_the_trainer_packs_documents_into_one_shape_and_counts_real_tokens(tmp_path):
    docs = documents(n=20, lo=3, hi=40)
    args = train_args(tmp_path, packing="documents", packing_length=48, num_train_epochs=1)
    trainer = ApexTrainer(model=tiny_model("gpt2").train(), args=args, train_dataset=Examples(docs))
    rows = len(trainer.train_dataset)
    assert rows < len(docs) and trainer.batches.layout == "documents"
    trainer.train()
    steps = trainer.stage_metrics.steps
    assert len(steps) == -(-rows // 2)
    assert sum(s.tokens for s in steps) == sum(map(len, docs))  # every real token once, no padding
    assert {s.positions for s in steps} == {2 * 48}
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    assert metrics["batches"]["layout"] == "documents" and metrics["batches"]["shapes_trained"] == [[2, 48]]
    assert metrics["padding_share"] == pytest.approx(1 - sum(map(len, docs)) / (len(steps) * 96))
    assert metrics["batches"]["documents"] == len(docs)


def test_packed_training_evaluates_accumulates_and_resumes_on_the_same_rows(tmp_path):
    docs, evaluation = documents(n=40, lo=3, hi=40, seed=1), documents(n=6, seed=2)

    def run(out, resume=None):
        args = train_args(
            out,
            packing="documents",
            packing_length=48,
            max_steps=6,
            gradient_accumulation_steps=2,
            save_strategy="steps",
            save_steps=3,
        )
        trainer = ApexTrainer(
            model=tiny_model("llama").train(),
            args=args,
            train_dataset=Examples(docs),
            eval_dataset=Examples(evaluation),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer, {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}

    straight, losses = run(tmp_path / "run")
    assert straight.stage_metrics.steps[0].positions == 2 * 2 * 48  # two micro-batches of two rows
    again, resumed = run(tmp_path / "run", resume=str(tmp_path / "run" / "checkpoint-3"))
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(losses[step], rel=1e-6, abs=1e-7)
    for p, q in zip(straight.model.parameters(), again.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    metrics = again.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))


def test_auto_packs_a_causal_lm_buckets_an_encoder_and_leaves_blocks_alone(tmp_path, caplog):
    lm = tiny_model("gpt2")
    assert arrange("auto", lm, Examples(documents()), None, None, rows=2).layout == "documents"
    fixed = arrange("auto", lm, TokenDataset(n=8), None, None, rows=2)
    assert fixed.layout == "off" and "no padding to remove" in fixed.report["why"]
    encoder = tiny_model("bert")
    assert "length buckets" not in caplog.text
    assert arrange("auto", encoder, Examples(documents()), None, None, rows=2).layout == "buckets"
    assert "not drawn at random, which can cost accuracy" in caplog.text  # (said where auto chose them)
    caplog.clear()
    assert arrange("buckets", encoder, Examples(documents()), None, None, rows=2).layout == "buckets"
    assert "length buckets" not in caplog.text  # (not where you asked for them)
    with pytest.raises(ValueError, match="not a causal LM.*buckets"):
        arrange("documents", encoder, Examples(documents()), None, None, rows=2)
    with pytest.raises(ValueError, match="input_ids"):
        arrange("documents", lm, [{"text": "a"}], None, None, rows=2)


def test_an_encoder_trains_on_buckets_in_at_most_one_shape_per_bucket(tmp_path):
    class Tok:  # what DataCollatorWithPadding asks of a tokenizer
        pad_token_id = 0
        padding_side = "right"
        model_input_names = ["input_ids", "attention_mask"]

        def pad(self, features, return_tensors="pt", **kw):
            width = max(len(f["input_ids"]) for f in features)
            return {
                "input_ids": torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features]),
                "attention_mask": torch.tensor(
                    [f["attention_mask"] + [0] * (width - len(f["input_ids"])) for f in features]
                ),
                "labels": torch.tensor([f["labels"] for f in features]),
            }

    docs = documents(n=48, lo=2, hi=60, seed=4)
    args = train_args(tmp_path, packing="auto", per_device_train_batch_size=4, num_train_epochs=1)
    trainer = ApexTrainer(
        model=tiny_model("bert").train(),
        args=args,
        train_dataset=Examples(docs, label=True),
        data_collator=DataCollatorWithPadding(Tok()),
    )
    assert trainer.batches.layout == "buckets" and trainer.args.train_sampling_strategy == "group_by_length"
    trainer.train()
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    widths = {shape[1] for shape in metrics["batches"]["shapes_trained"]}
    assert widths <= set(metrics["batches"]["buckets"]) and len(widths) <= len(metrics["batches"]["buckets"])
    assert sum(s.tokens for s in trainer.stage_metrics.steps) == sum(map(len, docs))
    assert metrics["padding_share"] < 0.5  # grouped by length: far less than a random batch's padding


def test_an_encoder_on_buckets_predicts_on_the_real_rows_only(tmp_path):
    docs, evaluation = documents(n=12, lo=2, hi=40, seed=9), documents(n=6, lo=2, hi=40, seed=10)
    args = train_args(tmp_path, packing="buckets", per_device_train_batch_size=4, per_device_eval_batch_size=4)
    trainer = ApexTrainer(
        model=tiny_model("bert"),
        args=args,
        train_dataset=Examples(docs, label=True),
        eval_dataset=Examples(evaluation, label=True),
        data_collator=DataCollatorWithPadding(word_level_tokenizer()),
    )
    assert trainer.batches.train_collator.rows == 4 and trainer.batches.collator.rows is None
    for loader in (trainer.get_eval_dataloader(), trainer.get_test_dataloader(trainer.eval_dataset)):
        assert sorted(len(batch["labels"]) for batch in loader) == [2, 4]  # 6 examples, 4 a batch: the last keeps 2
    out = trainer.predict(trainer.eval_dataset)  # (accelerate would cut rows past the set's end off the outputs)
    assert out.predictions.shape == (6, 2)
    assert sorted(out.label_ids.tolist()) == [0, 0, 0, 1, 1, 1]  # (grouped by length: in another order)


def test_the_trainer_fills_the_epochs_short_batch_and_evaluates_the_real_rows(tmp_path):
    """13 examples at 4 a batch: the training loader's last batch of each epoch is filled up to 4 rows (no new shape
    to compile), the evaluation loader's keeps its one real row; the real tokens counted are the examples'."""
    docs = documents(n=13, lo=2, hi=40, seed=11)
    args = train_args(tmp_path, packing="buckets", per_device_train_batch_size=4, num_train_epochs=2)
    args.per_device_eval_batch_size = 4
    trainer = ApexTrainer(
        model=tiny_model("bert").train(),
        args=args,
        train_dataset=Examples(docs, label=True),
        eval_dataset=Examples(docs, label=True),
        data_collator=DataCollatorWithPadding(word_level_tokenizer()),
    )
    assert {len(batch["labels"]) for batch in trainer.get_train_dataloader()} == {4}
    assert sorted(len(batch["labels"]) for batch in trainer.get_eval_dataloader()) == [1, 4, 4, 4]
    trainer.train()
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    assert {shape[0] for shape in metrics["batches"]["shapes_trained"]} == {4}
    assert sum(s.tokens for s in trainer.stage_metrics.steps) == 2 * sum(map(len, docs))  # the real rows' only
    assert trainer.evaluate()["eval_loss"] > 0


def test_a_compiled_run_on_buckets_keeps_a_full_mask_and_compiles_one_graph(tmp_path):
    """Batches padded to buckets keep their attention mask even where it is all ones: grouped by length, some batches
    hold examples of exactly a bucket's length, and one without its mask would be a second call signature of that
    bucket's graph, compiled again (benchmarks/reports/natural-lengths.md). Their length is dynamic from the first
    step, so one graph serves every bucket."""
    from hf_apex.runtime import DropFullAttentionMask

    rng = random.Random(13)
    lengths = [16] * 24 + [rng.randint(4, 12) for _ in range(12)] + [rng.randint(20, 30) for _ in range(12)]
    lengths += [rng.randint(36, 44) for _ in range(12)]
    docs = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]  # batches 16 wide, full or padded, 32, 48
    args = train_args(
        tmp_path,
        packing="buckets",
        per_device_train_batch_size=4,
        num_train_epochs=2,
        torch_compile=True,
        torch_compile_backend="aot_eager",
        stage=None,  # (a stage of your own: torch.compile on a CPU)
    )
    trainer = ApexTrainer(
        model=tiny_model("bert").train(),
        args=args,
        train_dataset=Examples(docs, label=True),
        data_collator=DataCollatorWithPadding(word_level_tokenizer()),
    )
    assert not isinstance(trainer.data_collator, DropFullAttentionMask)
    batches = list(trainer.get_train_dataloader())
    full = [b for b in batches if b["input_ids"].shape[1] == 16 and bool(b["attention_mask"].all())]
    assert full and all("attention_mask" in b for b in batches)
    torch.compiler.reset()
    trainer.train()
    metrics = json.loads((tmp_path / METRICS_FILENAME).read_text())
    widths = {shape[1] for shape in metrics["batches"]["shapes_trained"]}
    graphs = metrics["batches"]["compiled_graphs"]
    assert widths == {16, 32, 48} and graphs == 1, graphs  # the first graph dynamic in the length: one for all


@pytest.mark.parametrize("layout", ["buckets", "documents"])
def test_the_training_batches_follow_a_batch_size_the_trainer_lowers(layout, tmp_path):
    """auto_find_batch_size halves the Trainer's batch size after an out-of-memory error and builds the training
    loader again: its batches are then of the smaller size, not filled back up to the first one."""
    docs = documents(n=10, lo=3, hi=40, seed=12)
    args = train_args(tmp_path, packing=layout, packing_length=48, per_device_train_batch_size=4)
    model, data = (
        (tiny_model("bert"), Examples(docs, label=True))
        if layout == "buckets"
        else (tiny_model("gpt2"), Examples(docs))
    )
    collator = DataCollatorWithPadding(word_level_tokenizer()) if layout == "buckets" else None
    trainer = ApexTrainer(model=model, args=args, train_dataset=data, data_collator=collator)
    assert {len(batch["input_ids"]) for batch in trainer.get_train_dataloader()} == {4}
    trainer._train_batch_size = 2  # (as Trainer._update_auto_batch_size sets it)
    assert {len(batch["input_ids"]) for batch in trainer.get_train_dataloader()} == {2}


def test_auto_leaves_a_collator_that_may_do_more_than_pad_in_place():
    class CompletionOnly:  # a collator of yours: it makes the labels, which packing would not
        def __call__(self, features):
            return features

    lm, docs = tiny_model("gpt2"), Examples(documents())
    batches = arrange("auto", lm, docs, None, CompletionOnly(), rows=2)
    assert batches.layout == "buckets" and "CompletionOnly may do more than pad" in batches.report["why"]
    assert arrange("auto", lm, docs, None, DataCollatorWithPadding(object()), rows=2).layout == "documents"
    assert arrange("auto", None, docs, None, None, rows=2).layout == "off"  # (model_init: no model to ask yet)
