"""Do eager and compiled runs of a random-init BERT on SST-2 follow one loss curve? With dropout and without.

    python benchmarks/scripts/bert_plateau_curves.py --data_dir ../shared/data [--out_dir .plateau] [--steps 200]

Runs recipes/finetune.py (BF16 autocast; on CPU with --use_cpu) for `torch_fused` and `compiled` at dropout 0.1 and
0, and `torch_fused` at dropout 0.1 with another seed (init, dropout and data order all differ: the run-to-run
spread), on a 4-layer, 256-wide BERT at 64 x 64 tokens, learning rate 1e-4. Prints each run's 20-step loss means and
its evaluation. It asks whether a gap between the compiled and eager curves comes from their dropout masks (Inductor
draws its own random numbers) or from their arithmetic: tests/gpu/test_fast_stage_gpu.py trains BERT without
dropout for this reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import finetune  # noqa: E402

from hf_apex.measure.report import METRICS_FILENAME  # noqa: E402

RUNS = [
    ("torch_fused", 0.1, 0),
    ("compiled", 0.1, 0),
    ("torch_fused", 0.0, 0),
    ("compiled", 0.0, 0),
    ("torch_fused", 0.1, 1),
]


def run(stage: str, dropout: float, seed: int, opts) -> dict:
    out = Path(opts.out_dir) / f"{stage}-dropout{dropout}-seed{seed}"
    data = Path(opts.data_dir)
    model = "num_hidden_layers=4,hidden_size=256,num_attention_heads=4,intermediate_size=1024"
    args = [
        *("--task", "sst2", "--model_type", "bert", "--stage", stage),
        *("--config_overrides", f"{model},hidden_dropout_prob={dropout},attention_probs_dropout_prob={dropout}"),
        *("--tokenizer_name", str(data / "tokenizers" / "bert-base-uncased"), "--data_dir", str(data)),
        *("--pad_to_max_length", "--max_seq_length", "64"),
        *("--per_device_train_batch_size", "64", "--per_device_eval_batch_size", "64"),
        *("--max_steps", str(opts.steps), "--max_train_samples", str(opts.steps * 64), "--max_eval_samples", "512"),
        *("--metrics_warmup_steps", "0", "--learning_rate", "1e-4", "--warmup_steps", "0.1", "--weight_decay", "0.01"),
        *("--seed", str(seed), "--logging_steps", "1", "--save_strategy", "no", "--save_final_model", "false"),
        *("--report_to", "none", "--disable_tqdm", "true", "--output_dir", str(out)),
        *([] if torch.cuda.is_available() else ["--use_cpu", "true"]),
    ]
    torch._dynamo.reset()
    finetune.main(args)
    metrics = json.loads((out / METRICS_FILENAME).read_text())
    losses = [h["loss"] for h in metrics["loss_history"]]
    means = [round(statistics.mean(losses[i : i + 20]), 4) for i in range(0, len(losses), 20)]
    return {"stage": stage, "dropout": dropout, "seed": seed, "means_of_20": means, "eval": metrics["eval"]}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True, help="holds sst2/ and tokenizers/bert-base-uncased")
    parser.add_argument("--out_dir", default=".plateau")
    parser.add_argument("--steps", type=int, default=200)
    opts = parser.parse_args(argv)
    results = []
    for stage, dropout, seed in RUNS:
        results.append(run(stage, dropout, seed, opts))
        print("RESULT", json.dumps(results[-1]), flush=True)
    return results


if __name__ == "__main__":
    main()
