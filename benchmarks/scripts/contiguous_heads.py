"""Run a recipe with transformers' SDPA attention handed contiguous heads: an experiment, not hf_apex's path.

usage: python benchmarks/scripts/contiguous_heads.py recipes/finetune.py [flags...]
       (or WRAPPER=benchmarks/scripts/contiguous_heads.py with benchmarks/scripts/run_variant.py)

GPT-2 hands SDPA its query, key and value as strided views into one (batch, tokens, 3 x width) projection. In a
`fastest` GPT-2 step on an H200 (2026-12-01) cuDNN's attention took 1.13 ms per layer, forward and backward, where
the same call on contiguous heads took 0.575 ms alone (benchmarks/h200-2026-12-01-ladder). This registers, for the
run, an `sdpa` attention that copies the three to contiguous heads first (the same values, so the same maths), to
see what the step gains; benchmarks/scripts/sdpa_backends.py times the attention alone the same way.
"""

import os
import runpy
import sys

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward


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
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
