"""Attention's kernels inside a training step (eager, compiled, compiled with one sequence per row) and alone.

    python benchmarks/scripts/attention_in_step.py [--model llama|gpt2] [--no_dropout] [--out OUT.json]

On an H200 (2026-12-01, benchmarks/h200-2026-12-01-loss-test) cuDNN's forward kernel took 84 us alone and 218 us per
layer in Llama's `fastest` step, its backward 224 and 506 us, with the same kernel names; the full causal mask of
compiled training steps was why (benchmarks/h200-2026-12-01-causal-steps: 787.9 against 358.7 us per layer, forward
and backward, without and with `one_sequence_per_row`). This takes the bench model
(random init, 16 x 1024 tokens, BF16 autocast, hf_apex's static masks as `fastest` sets them, no Trainer) and
profiles the attention kernels of a forward + backward in six settings, each the mean over 3 steps per layer:

1. `eager`: the model without torch.compile;
2. `compiled`: the model under torch.compile (torch's default mode), as ApexTrainer ran it before
   `one_sequence_per_row` (on a CPU its SDPA calls got a full mask and no `is_causal`);
3. `compiled, one sequence per row`: the same under `hf_apex.kernels.attention.one_sequence_per_row`, as ApexTrainer
   runs a batch without position ids now;
4. `alone`: one SDPA call, forward + backward under the step's BF16 autocast, on tensors of the shapes, strides,
   dtype and flags that the eager model handed SDPA in its first layer (recorded by wrapping
   `F.scaled_dot_product_attention`, before autocast casts them);
5. `alone, contiguous`: the same on contiguous heads;
6. `alone, after load`: `alone` right after 0.5 s of large matmuls, at the clock and power of a long run.

It also prints each SDPA call of the code Inductor generated (its arguments show `is_causal`, the mask, dropout),
the eager call's flags, and the SM clock idle and after the load. Setting 1 against 4 tells the model's context from
the kernel; 2 and 3 against 1 what compiling changes; 6 against 4 what the clock under load costs.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import bench  # noqa: E402

from hf_apex.kernels.attention import one_sequence_per_row, use_static_masks  # noqa: E402

ATTENTION = ("sdpa", "flash", "fmha", "attention", "dot_do_o", "convert_dq")  # parts of the attention kernels' names
BATCH, TOKENS = 16, 1024


def build(name: str, no_dropout: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = bench.MODELS[name]
    config = AutoConfig.for_model(spec["model_type"])
    if spec.get("overrides"):
        config.update_from_string(spec["overrides"])
    if no_dropout:
        config.update({k: 0.0 for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop") if hasattr(config, k)})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda().train()
    model.config.use_cache = False  # as Trainer.__init__ sets it (TrainingArguments.use_cache): no KV cache built
    assert use_static_masks(model), "hf_apex's static masks do not apply to this model"
    return model


def training_step(model, ids):
    with torch.autocast("cuda", torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def attention_kernels(fn, calls: int, reps: int = 3, before=None) -> dict:
    """Device µs per attention call of each attention kernel ``fn`` runs, and the whole device time per rep;
    ``before``: run inside the profile just ahead of each rep (its own kernels are not attention's)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if before is not None:
                before()
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_kernel = collections.Counter()
    for e in events:
        if any(part in e.name.lower() for part in ATTENTION):
            per_kernel[e.name[:90]] += e.device_time_total / (reps * calls)
    return {
        "kernels_us": dict(per_kernel),
        "attention_us_per_call": sum(per_kernel.values()),
        "device_ms_per_rep": sum(e.device_time_total for e in events) / reps / 1e3,  # (with ``before``'s kernels)
    }


def record_first_call(model, ids) -> dict:
    """What the model's first SDPA call was handed: shapes, strides, dtype and flags."""
    seen = []
    original = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if not seen:
            seen.append(
                {
                    "shapes": [list(t.shape) for t in (q, k, v)],
                    "strides": [list(t.stride()) for t in (q, k, v)],
                    "dtype": str(q.dtype),
                    "mask": None if attn_mask is None else list(attn_mask.shape),
                    "dropout_p": dropout_p,
                    "is_causal": bool(is_causal),
                    "scale": scale,
                    "kwargs": sorted(kwargs),
                }
            )
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs)

    F.scaled_dot_product_attention = recording
    try:
        training_step(model, ids)
    finally:
        F.scaled_dot_product_attention = original
    return seen[0]


def alone(call: dict, contiguous: bool):
    """A forward + backward of one SDPA call like ``call`` (fresh values: the kernels' time does not hang on them)."""
    if call["mask"] is not None or call["kwargs"]:
        raise SystemExit(f"the model's SDPA call had a mask or other arguments this does not replay: {call}")
    dtype = getattr(torch, call["dtype"].split(".")[-1])
    leaves, heads = [], []
    b, h, t, d = call["shapes"][0]
    if not contiguous and all(st == [t * 3 * h * d, d, 3 * h * d, 1] for st in call["strides"]):
        # GPT-2's views into one (batch, tokens, 3 x width) projection: one tensor, as the step's backward has it
        qkv = torch.randn(b, t, 3 * h * d, device="cuda", dtype=dtype, requires_grad=True)
        leaves, heads = [qkv], [x.view(b, t, h, d).transpose(1, 2) for x in qkv.split(h * d, dim=2)]
    for shape, stride in zip(call["shapes"], call["strides"]) if not leaves else ():
        size = 1 + sum((n - 1) * s for n, s in zip(shape, stride))  # the storage the strided view spans
        base = torch.randn(size, device="cuda", dtype=dtype, requires_grad=True)
        leaves.append(base)
        heads.append(base.as_strided(shape, stride))
    if contiguous:
        leaves = heads = [torch.randn(h.shape, device="cuda", dtype=dtype, requires_grad=True) for h in heads]
    grad = torch.randn(call["shapes"][0], device="cuda", dtype=torch.bfloat16)  # (the output's dtype under autocast)

    def step():
        # under the step's autocast: the model hands SDPA FP32 tensors (recorded before autocast casts them), and
        # autocast runs it in BF16 (without it, 2026-12-01's H200 ran FP32 memory-efficient kernels here, 2.95 ms)
        with torch.autocast("cuda", torch.bfloat16):
            out = F.scaled_dot_product_attention(
                *heads, dropout_p=call["dropout_p"], is_causal=call["is_causal"], scale=call["scale"]
            )
        torch.autograd.grad(out, leaves, grad)

    return step


def load(ms: float = 500.0):
    """Large matmuls for about ``ms``; the last few stay queued, so that what is launched next follows at once."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > ms:
            break
    for _ in range(20):
        a @ a


def sm_clock() -> int | None:
    """The SM clock now (MHz), or None where torch cannot read it (it asks NVML through pynvml)."""
    try:
        return torch.cuda.clock_rate()
    except Exception:
        return None


def inductor_sdpa_calls() -> list[str]:
    from torch._inductor.codecache import PyCodeCache

    modules = PyCodeCache.modules if isinstance(PyCodeCache.modules, list) else list(PyCodeCache.modules.values())
    lines = []
    for module in modules:
        for line in Path(module.__file__).read_text().splitlines():
            if "aten._scaled_dot_product" in line and "= " in line and not line.lstrip().startswith("#"):
                lines.append(line.strip()[:240])
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    parser.add_argument(
        "--no_dropout", action="store_true", help="GPT-2 without any of its dropout (a diagnosis only; Llama has none)"
    )
    parser.add_argument("--out")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_in_step.py needs CUDA")
    torch.manual_seed(0)
    model = build(opts.model, opts.no_dropout)
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (BATCH, TOKENS), device="cuda")
    result = {"model": opts.model, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    result["first_call"] = call = record_first_call(model, ids)
    print("eager SDPA call:", json.dumps(call), flush=True)
    settings = {
        "eager": (lambda: training_step(model, ids), layers),
        "alone": (alone(call, contiguous=False), 1),
        "alone, contiguous": (alone(call, contiguous=True), 1),
    }
    for name, (fn, calls) in settings.items():
        result[name] = attention_kernels(fn, calls)
    compiled = torch.compile(model)
    result["compiled"] = attention_kernels(lambda: training_step(compiled, ids), layers)
    result["inductor_sdpa_calls"] = {"compiled": inductor_sdpa_calls()}

    def one_sequence_step():
        with one_sequence_per_row():  # as ApexTrainer runs a batch without position_ids since it has this
            training_step(compiled, ids)

    result["compiled, one sequence per row"] = attention_kernels(one_sequence_step, layers)
    seen = set(result["inductor_sdpa_calls"]["compiled"])
    result["inductor_sdpa_calls"]["compiled, one sequence per row"] = [
        line for line in inductor_sdpa_calls() if line not in seen
    ]
    result["clock_mhz_idle"] = sm_clock()
    result["alone, after load"] = attention_kernels(alone(call, contiguous=False), 1, reps=2, before=load)
    result["clock_mhz_after_load"] = sm_clock()
    names = ("eager", "compiled", "compiled, one sequence per row", "alone", "alone, contiguous", "alone, after load")
    for name in names:
        r = result[name]
        print(f"{name:18s} {r['attention_us_per_call']:8.1f} us of attention kernels per call", flush=True)
        for kernel, us in sorted(r["kernels_us"].items(), key=lambda kv: -kv[1]):
            print(f"{'':20s}{us:8.1f} us  {kernel}")
    for name, lines in result["inductor_sdpa_calls"].items():
        print(f"Inductor's SDPA calls, {name}:", *lines[:4], sep="\n  ")
    clocks = result["clock_mhz_idle"], result["clock_mhz_after_load"]
    print("SM clock MHz idle / after load (None: no pynvml):", *clocks)
    if opts.out:
        Path(opts.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
