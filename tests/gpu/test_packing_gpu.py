"""Packed documents and length buckets on a GPU: the same per-token losses as the padded run in BF16 under
torch.compile, and ``fastest`` on natural lengths in one compiled shape (buckets: one graph dynamic in the length).

Tolerance: the padded reference runs eager, the packed run compiled (Inductor fuses and reorders), both under BF16
autocast, whose 8-bit mantissa rounds each matmul's inputs to about 0.4 %; over two layers a token's loss moves by
far less than 2 % (what the CPU test holds exactly in FP32, tests/test_data.py)."""

import json
import random

import pytest
import torch
import torch.nn.functional as F

from hf_apex import ApexTrainer, ApexTrainingArguments
from hf_apex.data import PackedCollator, pack_documents
from hf_apex.measure.report import METRICS_FILENAME
from tests.testing_utils import VOCAB, TokenDataset, require_apex, require_cuda, tiny_model

pytestmark = [pytest.mark.gpu, require_cuda, require_apex]


def documents(n=24, lo=3, hi=60, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class Examples(torch.utils.data.Dataset):
    def __init__(self, docs):
        self.docs = docs

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return {"input_ids": self.docs[i]}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_compiled_packed_documents_match_the_padded_run_in_bf16(family):
    torch._dynamo.reset()
    model = tiny_model(family).cuda()
    docs = documents()
    rows = pack_documents(Examples(docs), 64)
    batch = {k: v.cuda() for k, v in PackedCollator(64, len(rows))(list(rows)).items() if torch.is_tensor(v)}
    compiled = torch.compile(model)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        packed = compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        width = max(map(len, docs))
        ids = torch.zeros(len(docs), width, dtype=torch.long, device="cuda")
        mask = torch.zeros_like(ids)
        for i, d in enumerate(docs):
            ids[i, : len(d)], mask[i, : len(d)] = torch.tensor(d), 1
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    for r, row in enumerate(rows.rows):
        at = 0
        for piece in row:
            size = piece.stop - piece.start
            p = F.cross_entropy(packed[r, at : at + size - 1].float(), batch["input_ids"][r, at + 1 : at + size])
            d = docs[piece.example]
            q = F.cross_entropy(padded[piece.example, : len(d) - 1].float(), ids[piece.example, 1 : len(d)])
            assert p.item() == pytest.approx(q.item(), rel=2e-2)
            at += size
    torch._dynamo.reset()


def _fastest(tmp_path, model, dataset, collator=None, batch=4, **kw):
    args = ApexTrainingArguments(
        output_dir=str(tmp_path),
        stage="fastest",
        stage_recipe={"min_steps": 0},
        report_to="none",
        max_steps=24,
        per_device_train_batch_size=batch,
        logging_steps=4,
        save_strategy="no",
        learning_rate=1e-3,
        metrics_warmup_steps=4,
        disable_tqdm=True,
        seed=0,
        **kw,
    )
    ApexTrainer(model=model.train(), args=args, train_dataset=dataset, data_collator=collator).train()
    return json.loads((tmp_path / METRICS_FILENAME).read_text())


def test_fastest_packs_natural_lengths_into_the_graphs_of_one_fixed_shape(tmp_path):
    fixed = _fastest(tmp_path / "fixed", tiny_model("llama"), TokenDataset(n=128, seq=64))
    packed = _fastest(tmp_path / "packed", tiny_model("llama"), Examples(documents(n=400)), packing_length=64)
    assert fixed["batches"]["layout"] == "off"  # blocks of one length: nothing to pack
    assert packed["batches"]["layout"] == "documents" and packed["batches"]["shapes_trained"] == [[4, 64]]
    assert packed["batches"]["compiled_graphs"] <= fixed["batches"]["compiled_graphs"]
    assert packed["batches"]["cuda_graphs"] <= fixed["batches"]["cuda_graphs"]
    assert packed["padding_share"] < 0.1
    losses = [h["loss"] for h in packed["loss_history"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_fastest_buckets_an_encoder_in_one_compiled_graph(tmp_path):
    class Sentences(Examples):
        def __getitem__(self, i):
            return {"input_ids": self.docs[i], "attention_mask": [1] * len(self.docs[i]), "labels": i % 2}

    class Pad:
        def __call__(self, features):
            width = max(len(f["input_ids"]) for f in features)
            pad = [width - len(f["input_ids"]) for f in features]
            return {
                "input_ids": torch.tensor([f["input_ids"] + [0] * n for f, n in zip(features, pad)]),
                "attention_mask": torch.tensor([f["attention_mask"] + [0] * n for f, n in zip(features, pad)]),
                "labels": torch.tensor([f["labels"] for f in features]),
            }

    fixed = _fastest(tmp_path / "fixed", tiny_model("bert"), TokenDataset(n=128, seq=32, task="cls"), batch=8)
    data = Sentences(documents(n=400, lo=2, hi=60))
    buckets = _fastest(tmp_path / "buckets", tiny_model("bert"), data, Pad(), batch=8, packing="buckets")
    shapes = buckets["batches"]["shapes_trained"]
    assert {s[1] for s in shapes} <= set(buckets["batches"]["buckets"])
    # one compiled graph for every bucket (its length marked dynamic from the first step), as many as for one shape;
    # CUDA graphs recorded once a shape
    assert buckets["batches"]["compiled_graphs"] == fixed["batches"]["compiled_graphs"]
    assert buckets["batches"]["cuda_graphs"] <= len(shapes) * fixed["batches"]["cuda_graphs"]
    assert buckets["padding_share"] < 0.35
