"""How far length-grouped batches (the buckets' sampler, transformers' LengthGroupedSampler) move each batch's labels
from the data set's, against batches drawn at random: whether grouping by length hands the model batches of one class;
and what each costs in padding, at the bucket widths hf_apex pads to.

usage: python benchmarks/scripts/length_groups.py DATA_DIR [--examples 20000] [--batch 32] [--seeds 5] [--mega 2,4]

DATA_DIR holds sst2/train.tsv and tokenizers/bert-base-uncased (a copy of ../shared/data). Prints, per sampler, the
spread (standard deviation) of the batches' mean label and their mean distance from the set's, over the seeds, and the
padding share of the batches padded to hf_apex's buckets; and the mean label by length decile. ``--mega``: the
sampler's megabatches (``mega_batch_mult``: how many batches it sorts by length together); ``default``, what the
Trainer uses, is transformers' rule (the set's batches / 4, at most 50). CPU only, a few seconds.
"""

import argparse
import csv
import statistics
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer
from transformers.trainer_pt_utils import get_length_grouped_indices

from hf_apex.data import bucket_lengths


def batch_label_means(order: np.ndarray, labels: np.ndarray, batch: int) -> np.ndarray:
    return np.array([labels[order[i : i + batch]].mean() for i in range(0, len(order) - batch + 1, batch)])


def padding_share(order: np.ndarray, lengths: np.ndarray, batch: int, buckets: list[int]) -> float:
    """The share of the positions computed that are padding, each batch padded to the shortest bucket that holds it."""
    real = computed = 0
    for i in range(0, len(order) - batch + 1, batch):
        b = lengths[order[i : i + batch]]
        real += int(b.sum())
        computed += batch * next(w for w in buckets if w >= b.max())
    return 1 - real / computed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--examples", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument(
        "--mega", default="default", help="the sampler's megabatches, comma-separated; default: transformers' rule"
    )
    opts = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(opts.data_dir / "tokenizers" / "bert-base-uncased")
    with open(opts.data_dir / "sst2" / "train.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))[: opts.examples]
    lengths = np.array([len(tokenizer(r["sentence"])["input_ids"]) for r in rows])
    labels = np.array([int(r["label"]) for r in rows])
    print(
        f"{len(rows)} sentences, batch {opts.batch}: mean label {labels.mean():.3f}, "
        f"corr(length, label) {np.corrcoef(lengths, labels)[0, 1]:.3f}"
    )
    buckets = bucket_lengths(int(lengths.max()))
    for mega in ["random", *opts.mega.split(",")]:
        spread, distance, padding = [], [], []
        for seed in range(opts.seeds):
            if mega == "random":
                order = np.random.default_rng(seed).permutation(len(labels))
            else:
                generator = torch.Generator().manual_seed(seed)  # (LengthGroupedSampler's order, its megabatches set)
                order = np.array(
                    get_length_grouped_indices(
                        lengths.tolist(), opts.batch, None if mega == "default" else int(mega), generator
                    )
                )
            means = batch_label_means(order, labels, opts.batch)
            spread.append(means.std())
            distance.append(np.abs(means - labels.mean()).mean())
            padding.append(padding_share(order, lengths, opts.batch, buckets))
        name = mega if mega == "random" else f"grouped by {mega}"
        print(
            f"{name:>15}: std of the batches' mean label {statistics.mean(spread):.3f} "
            f"(seeds {min(spread):.3f}-{max(spread):.3f}), mean distance {statistics.mean(distance):.3f}, "
            f"padding at buckets {buckets}: {statistics.mean(padding):.3f}"
        )
    edges = np.quantile(lengths, np.linspace(0, 1, 11))
    deciles = [labels[(lengths >= a) & (lengths <= b)].mean() for a, b in zip(edges[:-1], edges[1:])]
    print("mean label by length decile: " + ", ".join(f"{m:.2f}" for m in deciles))


if __name__ == "__main__":
    main()
