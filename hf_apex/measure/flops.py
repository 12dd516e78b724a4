"""The maths behind MFU: matmul parameters, FLOPs per position, and GPU peaks."""

from __future__ import annotations

from torch import nn

MFU_FORMULA = (
    "FLOPs per position = 6*N + 12*L*A*T (PaLM, appendix B): N the matmul weights (no biases or norm weights, "
    "no position embeddings, no input embeddings unless tied to the output head), L layers, A the attention "
    "width (query heads x head dim), T the sequence length; attention is counted over the full T x T score "
    "matrix, causal models included (no halving, as PaLM and nanoGPT count); positions include padding; "
    "MFU = FLOPs/s / (peak dense BF16 x GPUs). Encoder-decoder models are not counted (MFU None)."
)

# Dense BF16 tensor-core peaks (TFLOP/s) from the vendors' datasheets; override with --peak_tflops.
# Matched in order against torch.cuda.get_device_name(), so the more specific names come first.
PEAK_TFLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756.0),
    ("H800 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
]


def lookup_peak_tflops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    for key, peak in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def matmul_params(model: nn.Module) -> int:
    """N for MFU: the (unique) weights that enter a matmul: every parameter of two or more dimensions except
    position embeddings, and except the input embeddings unless they are tied to the output head (a lookup does
    no matmul; a tied head does). Biases and norm weights are left out: they are no matmul."""
    skip = set()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, nn.Embedding) and ("position" in leaf or leaf in ("wpe", "embed_positions")):
            skip.update(id(p) for p in module.parameters())
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    inputs = get_in() if callable(get_in) else None
    outputs = get_out() if callable(get_out) else None
    if isinstance(inputs, nn.Embedding) and not (outputs is not None and outputs.weight is inputs.weight):
        skip.add(id(inputs.weight))
    return sum(p.numel() for p in model.parameters() if p.ndim >= 2 and id(p) not in skip)


def model_shape(model: nn.Module) -> dict:
    """N, L and the attention width A = heads x head_dim (not the hidden size: they differ in Qwen3-style
    models), for :func:`flops_per_token`."""
    config = _text_config(model)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    return {
        "matmul_params": matmul_params(model),  # the N of MFU_FORMULA: no embeddings, norms or biases
        "n_layers": getattr(config, "num_hidden_layers", None),
        "hidden_size": hidden,
        "attention_width": heads * head_dim if heads and head_dim else None,
        "encoder_decoder": bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)),
    }


def flops_per_token(shape: dict, seq_len: int) -> float | None:
    """Training FLOPs per position (see :data:`MFU_FORMULA`); None when it cannot be counted honestly."""
    if shape.get("encoder_decoder") or not shape.get("n_layers") or not shape.get("attention_width"):
        return None
    return 6.0 * shape["matmul_params"] + 12.0 * shape["n_layers"] * shape["attention_width"] * seq_len


class TrainerFlops:
    """The stock ``Trainer.floating_point_ops`` (6 x tokens x parameters without embeddings, for ``total_flos``) with
    the parameter count kept per model: the stock method walks every parameter on each micro-batch (0.3-0.5 ms of
    host time for BERT-base). None where the stock method must count (no main input, no ``num_parameters``)."""

    def __init__(self):
        self.model, self.params = None, 0

    def __call__(self, model: nn.Module, inputs) -> int | None:
        main_input = getattr(model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(model, "num_parameters"):
            return None
        if self.model is not model:
            self.model, self.params = model, model.num_parameters(exclude_embeddings=True)
        return 6 * inputs[main_input].numel() * self.params
