"""Run a recipe with transformers' SDPA attention handed contiguous heads: an experiment, not hf_apex's path.

usage: python benchmarks/scripts/contiguous_heads.py recipes/finetune.py [flags...]
       (or WRAPPER=benchmarks/scripts/contiguous_heads.py with benchmarks/scripts/run_variant.py)

GPT-2 hands SDPA its query, key and value as strided views into one (batch, tokens, 3 x width) projection. In a
`fastest` GPT-2 step on an H200 (2026-12-01) cuDNN's attention took 1.13 ms per layer, forward and backward, where
the same call on contiguous heads took 0.575 ms alone (benchmarks/h200-2026-12-01-ladder). This registers, for the
run, an `sdpa` attention that copies the three to contiguous heads first (the same values, so the same maths), to
see what the step gains; benchmarks/scripts/sdpa_backends.py times the attention alone the same way. Without
dropout the layout matters more there: 0.607 ms in GPT-2's layout against 0.414 ms on contiguous heads (H200,
2026-12-01, benchmarks/h200-2026-12-01-loss-test). Under torch.compile hf_apex runs the model with its own attention
name (`hf_apex.kernels.attention.STATIC_MASKS`), which it registers with transformers' `sdpa_attention_forward` when a
run starts; so this replaces that function in its module too, before the recipe imports hf_apex.
"""

import os
import runpy
import sys

import transformers.integrations.sdpa_attention as sdpa_attention
from transformers import AttentionInterface

sdpa_attention_forward = sdpa_attention.sdpa_attention_forward  # transformers' own, before the replacement below


def contiguous_heads_sdpa(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(
        module, query.contiguous(), key.contiguous(), value.contiguous(), attention_mask, **kwargs
    )


if __name__ == "__main__":
    # Registered from this file imported under its own name: runpy puts the recipe in sys.modules["__main__"], and a
    # function of this __main__ would have torch.compile's guards look its globals up in the recipe (2026-12-01, H200:
    # "module '__main__' has no attribute 'sdpa_attention_forward'").
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import contiguous_heads

    AttentionInterface.register("sdpa", contiguous_heads.contiguous_heads_sdpa)
    sdpa_attention.sdpa_attention_forward = contiguous_heads.contiguous_heads_sdpa  # what hf_apex registers (above)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
