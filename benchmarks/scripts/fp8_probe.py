"""What FP8 matmuls and BF16 weights with FP32 master weights buy a Llama's training step, measured in a plain compiled
loop before any of it is built into a stage (issue 56: "measure it first").

usage: python benchmarks/scripts/fp8_probe.py [--model llama1b|llama8bwide] [--layers N] [--batch B] [--seq S]
       [--steps N] [--variants bf16,fp8_tensorwise,...] [--out results.jsonl] [--emulate]

Each variant runs in a fresh process (its own peak memory), on the same random tokens (the step's cost does not depend
on their values), with the step a Trainer run takes: forward and loss under the variant's precision, backward,
clipping to norm 1.0, the optimizer, zeroed gradients; ``torch.compile`` on the model. Variants:

- ``bf16``: FP32 weights, BF16 autocast, torch's fused AdamW: the stock compiled Trainer's numerics.
- ``fp8_tensorwise`` / ``fp8_rowwise``: the same with torchao's float8 linears (``convert_to_float8_training``,
  that recipe), ``lm_head`` and linears whose sides are not multiples of 16 left in BF16.
- ``bf16_master``: BF16 weights and gradients, no autocast, apex's capturable Adam kernel with FP32 master weights
  (``amp_C.multi_tensor_adam_capturable_master``, :class:`BF16MasterAdam`): FP32 copies of the weights and the
  states. apex's ``FusedAdam(master_weights=True)`` keeps master copies for FP16 and FP32 parameters only (apex
  6424da3): its BF16 parameters are updated in place, without one.
- ``fp8_rowwise_master``: both.

One JSON line per variant: step times (p20/p50/p80 over the timed steps, CUDA events read once the steps are done),
tokens/s, peak memory, the last loss. ``--emulate`` runs torchao's float8 in emulation (any device, the CPU
included): a check of the script, not a timing. The ``_master`` variants need CUDA and apex; not run on a GPU yet."""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {
    # Llama-3.2-1B (recipes/bench.py's llama1b row): 1.24B parameters
    "llama1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    # Llama-3-8B's widths, as many layers as --layers says (random init)
    "llama8bwide": dict(
        hidden_size=4096,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    # a check of the script on a CPU (--emulate)
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
}
VARIANTS = ("bf16", "fp8_tensorwise", "fp8_rowwise", "bf16_master", "fp8_rowwise_master")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="llama1b")
    p.add_argument("--layers", type=int, help="layers (default: the shape's)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation among them)")
    p.add_argument("--variants", default=",".join(VARIANTS[:3]), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--out", default="fp8_probe.jsonl")
    p.add_argument("--emulate", action="store_true", help="float8 emulated: checks the script, times nothing")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # (the one variant a child process runs)
    opts = p.parse_args(argv)
    unknown = set(opts.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; pick from {', '.join(VARIANTS)}")
    if opts.steps < 1 or opts.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    return opts


def float8_filter(module, fqn: str) -> bool:
    """torchao's float8 for a linear whose sides are multiples of 16, never the LM head (its logits feed the loss)."""
    return "lm_head" not in fqn and module.in_features % 16 == 0 and module.out_features % 16 == 0


class BF16MasterAdam:
    """AdamW over BF16 weights that keeps FP32 master copies of them: apex's capturable kernel, which reads the BF16
    gradients, updates the FP32 masters and states, and writes the BF16 weights back, in one pass."""

    def __init__(self, params, lr: float, weight_decay: float, betas=(0.9, 0.999), eps=1e-8):
        import amp_C
        import torch
        from apex.multi_tensor_apply import multi_tensor_applier

        self.params = [p for p in params if p.requires_grad]
        device = self.params[0].device
        self.master = [p.detach().float() for p in self.params]
        self.exp_avg = [torch.zeros_like(w) for w in self.master]
        self.exp_avg_sq = [torch.zeros_like(w) for w in self.master]
        self.lr = torch.tensor([lr], dtype=torch.float32, device=device)
        self.steps = torch.zeros(1, dtype=torch.int, device=device)
        self.no_skip = torch.zeros(1, dtype=torch.int, device=device)
        self.inv_scale = torch.ones(1, dtype=torch.float32, device=device)
        self.kernel, self.applier = amp_C.multi_tensor_adam_capturable_master, multi_tensor_applier
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay

    def step(self):
        self.steps += 1
        lists = [[p.grad for p in self.params], self.params, self.exp_avg, self.exp_avg_sq, self.master]
        # (lr, beta1, beta2, eps, step, mode 1: AdamW, bias correction on, weight decay, 1 / loss scale)
        self.applier(
            self.kernel,
            self.no_skip,
            lists,
            self.lr,
            *self.betas,
            self.eps,
            self.steps,
            1,
            1,
            self.weight_decay,
            self.inv_scale,
        )

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def masters_hold_the_weights(self) -> bool:
        """Whether every BF16 weight is its FP32 master rounded: the masters are the ones updated."""
        return all(bool((p == w.to(p.dtype)).all()) for p, w in zip(self.params, self.master))


def run_variant(opts) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    variant = opts.variant
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    shape = {**SHAPES[opts.model], **({"num_hidden_layers": opts.layers} if opts.layers else {})}
    config = LlamaConfig(**shape, max_position_embeddings=max(opts.seq, 2048), attn_implementation="sdpa")
    with torch.device(device):  # (built where it trains: an 8B-wide model's FP32 init on a CPU takes minutes)
        model = LlamaForCausalLM(config)
    master = variant.endswith("_master")
    if master:
        model = model.to(torch.bfloat16)
    skipped = []
    if variant.startswith("fp8"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = Float8LinearConfig.from_recipe_name(variant.split("_")[1])
        recipe = dataclasses.replace(recipe, emulate=opts.emulate)

        def keep(module, fqn):
            ok = float8_filter(module, fqn)
            if not ok:
                skipped.append(fqn)
            return ok

        convert_to_float8_training(model, module_filter_fn=keep, config=recipe)
    if master:
        optimizer = BF16MasterAdam(model.parameters(), lr=1e-4, weight_decay=0.01)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda)
    compiled = torch.compile(model)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (opts.batch, opts.seq), generator=g) for _ in range(4)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not master)

    def step(ids):
        ids = ids.to(device, non_blocking=True)
        with autocast:
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(opts.warmup):
        step(batches[i % len(batches)])
    if cuda:
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    events, times = [], []
    for i in range(opts.steps):  # (each step's events read once all are done: no sync between the steps)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step(batches[i % len(batches)])
            end.record()
            events.append((start, end))
        else:
            t = time.perf_counter()
            loss = step(batches[i % len(batches)])
            times.append((time.perf_counter() - t) * 1e3)
    if cuda:
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    q = statistics.quantiles(times, n=5) if len(times) > 1 else times * 4
    p50 = statistics.median(times)
    return {
        "variant": variant,
        "model": opts.model,
        "layers": config.num_hidden_layers,
        "params": sum(p.numel() for p in model.parameters()),
        "batch": [opts.batch, opts.seq],
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "emulated": opts.emulate,
        "torch": torch.__version__,
        "step_ms_p20": round(q[0], 2),
        "step_ms_p50": round(p50, 2),
        "step_ms_p80": round(q[3], 2),
        "tokens_per_s": round(opts.batch * opts.seq / p50 * 1e3),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "warmup_s": round(warm_s, 1),
        "loss_last": round(float(loss), 4),
        "bf16_linears": skipped,
        "masters_hold_the_weights": optimizer.masters_hold_the_weights() if master else None,
    }


def main():
    opts = parse_args()
    if opts.variant:
        print(json.dumps(run_variant(opts)), flush=True)
        return
    argv = sys.argv[1:]
    for variant in opts.variants.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, *argv, "--variant", variant], capture_output=True, text=True, env=os.environ
        )
        rows = [line for line in proc.stdout.splitlines() if line.startswith('{"variant"')]
        row = (
            json.loads(rows[-1]) if rows else {"variant": variant, "rc": proc.returncode, "error": proc.stderr[-2000:]}
        )
        with open(opts.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print({k: v for k, v in row.items() if k != "bf16_linears"}, flush=True)


if __name__ == "__main__":
    main()
