"""What a compiled training step keeps for its backward, per token and layer, under the partitioner's settings.

    python benchmarks/scripts/saved_activations.py [--model bert|gpt2|llama] [SETTING=VALUE ...]

e.g. `python benchmarks/scripts/saved_activations.py ban_recompute_materialized_backward=False`. A SETTING is a field
of `torch._functorch.config` (which decides what AOTAutograd's min-cut partitioner saves and what it recomputes). The
bench model's layer (BERT-base, GPT-2 124M, the Llama-architecture 124M; two layers of it) runs one forward and
backward under torch.compile with BF16 autocast on the CPU, through AOTAutograd's partitioner as Inductor uses it but
without generating code (a causal LM with `fastest`'s loss, which keeps no logits). It prints the bytes the forward
graph hands to the backward per token and layer, tensors that scale with the tokens only (weights and their BF16 copies
apart), largest first. The same maths whatever is saved: what is not saved is recomputed in the backward. On a GPU the
attention differs (cuDNN keeps its output and log-sum-exp, as the CPU's flash kernel does here); the rest is the same
partitioner on the same graph.
"""

from __future__ import annotations

import argparse
import ast
import collections
import sys
from pathlib import Path

import torch
import torch._functorch.config as functorch_config
from functorch.compile import min_cut_rematerialization_partition
from torch._functorch.aot_autograd import aot_module_simplified

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import bench  # noqa: E402

from hf_apex.kernels.attention import one_sequence_per_row, use_static_masks  # noqa: E402
from hf_apex.kernels.loss import fuse_linear_cross_entropy  # noqa: E402

BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.bool: 1, torch.int64: 8}
LAYERS, BATCH, TOKENS = 2, 8, 128


def build(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    spec = bench.MODELS[name]
    config = AutoConfig.for_model(spec["model_type"])
    if spec.get("overrides"):
        config.update_from_string(spec["overrides"])
    layers = "num_hidden_layers" if hasattr(config, "num_hidden_layers") else "n_layer"
    setattr(config, layers, LAYERS)
    config.update({k: 0.0 for k in ("hidden_dropout_prob", "attention_probs_dropout_prob") if hasattr(config, k)})
    config.update({k: 0.0 for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop") if hasattr(config, k)})
    auto = AutoModelForSequenceClassification if spec["model_type"] == "bert" else AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation="sdpa").train()
    model.config.use_cache = False  # as the Trainer sets it
    use_static_masks(model)
    if spec["model_type"] != "bert":
        assert fuse_linear_cross_entropy(model) is None  # as fastest: the loss keeps no logits
    return model


def saved(model, causal: bool) -> collections.Counter:
    kept = collections.Counter()

    def forward_compiler(gm, example_inputs):
        for value in next(n for n in gm.graph.nodes if n.op == "output").args[0]:
            meta = getattr(value, "meta", {}).get("val")
            if isinstance(meta, torch.Tensor) and meta.ndim and meta.shape[0] in (BATCH, BATCH * TOKENS):
                kept[(str(meta.dtype).replace("torch.", ""), tuple(meta.shape), str(value.target))] += (
                    meta.numel() * BYTES.get(meta.dtype, 4)
                )
        return gm.forward

    def backend(gm, example_inputs):
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=forward_compiler,
            bw_compiler=lambda gm, _: gm.forward,
            partition_fn=min_cut_rematerialization_partition,
        )

    ids = torch.randint(0, 30000, (BATCH, TOKENS))
    batch = {"input_ids": ids, "labels": ids if causal else torch.arange(BATCH) % 2}
    if not causal:  # BERT's SST-2 batches are padded
        batch["attention_mask"] = torch.ones_like(ids)
        batch["attention_mask"][0, TOKENS // 2 :] = 0
    torch._dynamo.reset()
    with torch.autocast("cpu", torch.bfloat16), one_sequence_per_row(causal):
        torch.compile(model, backend=backend)(**batch).loss.backward()
    torch._dynamo.reset()
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(bench.MODELS), default="bert")
    parser.add_argument(
        "settings", nargs="*", help="torch._functorch.config fields, e.g. activation_memory_budget=0.8"
    )
    opts = parser.parse_args()
    for item in opts.settings:
        field, _, value = item.partition("=")
        if not hasattr(functorch_config, field):
            sys.exit(f"torch._functorch.config has no setting {field!r}")
        setattr(functorch_config, field, ast.literal_eval(value))
    torch.manual_seed(0)
    kept = saved(build(opts.model), causal=opts.model != "bert")
    per = BATCH * TOKENS * LAYERS
    settings = " ".join(opts.settings) or "torch's defaults"
    print(
        f"{opts.model}, {settings}: {sum(kept.values()) / per:,.0f} bytes per token and layer saved for the backward"
    )
    for (dtype, shape, op), size in kept.most_common(12):
        print(f"  {size / per:8,.0f}  {dtype:9s} {str(shape):18s} {op}")


if __name__ == "__main__":
    main()
