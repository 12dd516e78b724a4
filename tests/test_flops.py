"""MFU's FLOP count, checked against torch's own FLOP counter; GPU peaks; the profiler's kernel classification."""

import pytest
from torch.utils.flop_counter import FlopCounterMode

from hf_apex.kernels.trace import classify_kernels, sdpa_backends_seen
from hf_apex.measure.flops import flops_per_token, lookup_peak_tflops, model_shape
from hf_apex.measure.report import percentiles
from tests.testing_utils import tiny_inputs, tiny_model


def test_n_counts_matmul_parameters():
    model = tiny_model("gpt2")
    weights = sum(p.numel() for p in model.parameters() if p.ndim == 2)  # tied lm_head counted once; no biases
    shape = model_shape(model)
    # GPT-2: position embeddings out; the word embeddings stay, since they are also the (tied) LM head.
    assert shape["matmul_params"] == weights - model.transformer.wpe.weight.numel()
    assert (shape["n_layers"], shape["attention_width"]) == (2, 32)
    # BERT classification: position and word embeddings are lookups only (token types are tiny lookups too,
    # but kept, as the formula only names position embeddings and untied input embeddings).
    bert = tiny_model("bert")
    embeddings = bert.bert.embeddings
    expected = sum(p.numel() for p in bert.parameters() if p.ndim == 2) - embeddings.position_embeddings.weight.numel()
    assert model_shape(bert)["matmul_params"] == expected - embeddings.word_embeddings.weight.numel()


def test_attention_width_is_heads_times_head_dim():
    # Qwen3-style: 4 heads of 16 on a hidden size of 32, so the attention is twice as wide as the hidden state.
    model = tiny_model("qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    shape = model_shape(model)
    assert (shape["hidden_size"], shape["attention_width"]) == (32, 64)


@pytest.mark.parametrize(
    "family, overrides",
    [("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)), ("gpt2", {}), ("llama", {})],
)
def test_flops_per_token_matches_torchs_flop_counter(family, overrides):
    """An independent count: torch's FlopCounterMode over a real forward + backward (eager attention, so the
    score and value matmuls are counted over the full T x T matrix, the convention of the formula)."""
    model = tiny_model(family, attn_implementation="eager", **overrides).train()
    batch, seq = 2, 64
    inputs = tiny_inputs(family, batch=batch, seq=seq)
    with FlopCounterMode(display=False) as counter:
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
    # Neither counts what is no matmul (norms, softmax, the loss, the embedding lookup).
    assert flops_per_token(model_shape(model), seq) * batch * seq == pytest.approx(counter.get_total_flops(), rel=1e-3)


def test_encoder_decoder_models_are_not_counted():
    shape = model_shape(tiny_model("t5"))
    assert shape["encoder_decoder"] and flops_per_token(shape, 16) is None


def test_flops_per_token_formula():
    shape = {"matmul_params": 124_000_000, "n_layers": 12, "attention_width": 768}
    assert flops_per_token(shape, 1024) == 6 * 124e6 + 12 * 12 * 768 * 1024
    assert flops_per_token({"matmul_params": 10, "n_layers": None, "attention_width": 8}, 16) is None


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Tesla T4", None),
        (None, None),
    ],
)
def test_peak_lookup(name, peak):
    assert lookup_peak_tflops(name) == peak


def test_percentiles():
    p = percentiles([float(x) for x in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p20"] == pytest.approx(20.8) and p["p80"] == pytest.approx(80.2)
    assert percentiles([]) == {}


def test_kernel_classification_tells_apex_from_torch():
    names = [
        "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float, float, long>, float>(long, int)",
        "void at::native::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor<float, 4>>",
        "void cuApplyLayerNorm<float, float, float>(float*, float*, float*, float const*, int, int, float)",
        "void cuApplyRMSNorm<c10::BFloat16, float, c10::BFloat16>(c10::BFloat16*)",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float)",
        "void LAMBStage1Functor<float>",
        # the backward of both apex norms (as a Llama's profile named it on an H200): it tells neither
        "void cuComputeGradInput<c10::BFloat16, float, c10::BFloat16, false>(c10::BFloat16 const*, int)",
    ]
    found = classify_kernels(names)
    assert set(found) == {"fused_adam", "layer_norm", "rms_norm", "fused_lamb", "norm_backward"}
    assert classify_kernels(names[3:4] + names[-1:]) == {"rms_norm": names[3:4], "norm_backward": names[-1:]}
    assert len(found["fused_adam"]) == 1 and "at::native" not in found["fused_adam"][0]
    assert classify_kernels(names[1:2] + names[4:5]) == {}


def test_sdpa_kernel_names_tell_the_backend():
    cudnn = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_..."  # as an H200 profile named it
    flash = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, bf16>>"
    efficient = "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<...>)"
    softmax = "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, Epilogue>"
    assert sdpa_backends_seen([cudnn]) == ["cudnn"]  # its "flash_fprop" is not the flash backend
    assert sdpa_backends_seen([flash, efficient, softmax]) == ["efficient", "flash"]
    assert sdpa_backends_seen([softmax]) == []  # the math backend leaves no name of its own
