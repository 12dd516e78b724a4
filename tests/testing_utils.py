"""Tiny models built from configs, synthetic data, and the skip markers shared by the tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import transformers

from hf_apex.kernels.apex.availability import blocker

# The real data (../shared/data beside the checkout); HF_APEX_DATA_DIR points at a copy (a GPU machine's .deps/data).
SHARED_DATA = Path(os.environ.get("HF_APEX_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")

# On the GPU machine: HF_APEX_REQUIRE_KERNELS=1 turns "no CUDA / no apex kernels" skips into failures (conftest.py).
REQUIRE_KERNELS = os.environ.get("HF_APEX_REQUIRE_KERNELS") == "1"


def missing_kernels() -> str | None:
    """Why the GPU tests cannot run here (no GPU, apex's extensions not built), or None."""
    return blocker("fused_adam") or blocker("layer_norm")


require_cuda = pytest.mark.skipif(not REQUIRE_KERNELS and not torch.cuda.is_available(), reason="needs a CUDA GPU")
require_apex = pytest.mark.skipif(
    not REQUIRE_KERNELS and missing_kernels() is not None,
    reason=f"needs apex built with its C++/CUDA extensions: run `make apex` ({missing_kernels()})",
)
require_shared_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"real data folder {SHARED_DATA} is absent")

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# Shapes shared by the tiny configs (BERT-style and decoder-style names).
_ENCODER = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
_DECODER = {**_ENCODER, "num_key_value_heads": 2}

# family -> (config class, model class, config kwargs); tiny, but every norm type of the family is present.
TINY = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64}),
    "bert": ("BertConfig", "BertForSequenceClassification", {**_ENCODER, "num_labels": 2}),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", {**_ENCODER, "max_position_embeddings": 70}),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertForSequenceClassification",
        {"n_layers": 2, "dim": 32, "n_heads": 2, "hidden_dim": 64, "max_position_embeddings": 64},
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _DECODER),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DECODER),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_DECODER, "head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", _DECODER),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", _DECODER),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {**_ENCODER, "tie_word_embeddings": False}),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        {
            "num_layers": 2,
            "num_decoder_layers": 2,
            "d_model": 32,
            "d_kv": 16,
            "num_heads": 2,
            "d_ff": 64,
            "decoder_start_token_id": 0,
        },
    ),
}


def leave_worker(code: int = 0) -> None:
    """End a distributed test worker whose results are on disk and whose process group is torn down: flush, then
    leave without C++ static destructors, where a gloo thread still joinable aborts a finished run now and then
    ("terminate called without an active exception", seen in tests/test_fsdp.py under a loaded CPU)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def tiny_model(family: str, **overrides) -> torch.nn.Module:
    config_cls, model_cls, kwargs = TINY[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs, **overrides})
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).eval()


def word_level_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A tokenizer of ``VOCAB`` words (``[PAD]`` 0, ``[BOS]`` 1, ``[EOS]`` 2, then ``w3``...), for the trainers that
    want one (TRL's)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[PAD]")),
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
    )


def tiny_inputs(family: str, batch: int = 2, seq: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if family == "t5":
        inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (batch, seq // 2), generator=g)
    return inputs


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences with labels: causal-LM (labels = input_ids) or classification (0/1)."""

    def __init__(self, n: int = 64, seq: int = 16, task: str = "lm", seed: int = 0, vocab: int = VOCAB):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, vocab, (n, seq), generator=g)
        self.labels = self.ids if task == "lm" else torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def sdpa_call_recorder():
    """A Dynamo backend that notes (mask given?, is_causal) of each SDPA call in the graphs it is handed and runs them
    as traced, and the list it notes them in."""
    calls = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if "scaled_dot_product" in str(node.target):
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                calls.append((mask is not None, bool(node.kwargs.get("is_causal"))))
        return gm.forward

    return calls, backend


def record_sdpa_calls_as_eager(monkeypatch) -> list[tuple[bool, bool]]:
    """Dynamo's "eager" backend, which a Trainer can be given by name, replaced by :func:`sdpa_call_recorder`'s for
    this test; returns the list it notes the calls in."""
    import torch._dynamo.backends.registry as registry

    calls, backend = sdpa_call_recorder()
    registry.lookup_backend("eager")  # (registered before it is replaced)
    monkeypatch.setitem(registry._COMPILER_FNS, "eager", backend)
    return calls


def loss_curve_agreement(a: list[float], b: list[float], window: int = 20) -> dict[str, float]:
    """How closely two same-seed loss curves agree: the largest relative gap between their moving averages
    (``window`` steps, after the first window) and the relative gap between their last-window means; ``gaps``: the
    gap at each step from the first window's end on."""
    n = min(len(a), len(b))
    if n < window:
        raise ValueError(f"need at least {window} losses per curve, got {n}")

    def smooth(xs):
        return [sum(xs[i - window : i]) / window for i in range(window, n + 1)]

    sa, sb = smooth(a[:n]), smooth(b[:n])
    gaps = [abs(x - y) / abs(y) for x, y in zip(sa, sb)]
    return {"max_rel_gap_smoothed": max(gaps), "final_rel_gap": gaps[-1], "steps": n, "window": window, "gaps": gaps}
