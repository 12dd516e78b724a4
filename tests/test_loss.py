"""The causal-LM loss without logits (hf_apex.kernels.ops.lm_loss, its model swap in hf_apex.kernels.models.loss):
the same loss and gradients as transformers' own, in FP32 and under BF16 autocast, with ignored labels,
gradient-accumulation divisors, several chunks and a vocabulary that is not a multiple of 64; the model swap; and the
Trainer switch."""

import copy
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._inductor.compile_fx import compile_fx
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_apex import ApexTrainer, ApexTrainingArguments
from hf_apex.kernels.models import loss as fused
from hf_apex.kernels.ops import lm_loss
from tests.testing_utils import TokenDataset, tiny_model


def reference(hidden, weight, labels, **kwargs):
    """transformers' path: the LM head's logits, then ForCausalLMLoss."""
    return ForCausalLMLoss(hidden @ weight.T, labels, vocab_size=weight.shape[0], **kwargs)


def inputs(vocab=100, d=16, batch=3, seq=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, d, generator=g, requires_grad=True)
    weight = (0.5 * torch.randn(vocab, d, generator=g)).requires_grad_(True)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :4] = -100  # padding: no loss there
    return hidden, weight, labels


def loss_and_grads(fn, hidden, weight, labels, scale=1.0, **kwargs):
    h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    loss = fn(h, w, labels, **kwargs)
    (loss * scale).backward()  # (a GradScaler's scale, or any loss weighting, reaches backward as grad_loss)
    return loss.detach(), h.grad, w.grad


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("chunk_elements", [lm_loss.CHUNK_ELEMENTS, 5 * 128])  # one chunk; 8 chunks of 4-5 positions
@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # the mean over the counted positions
        {"num_items_in_batch": torch.tensor(40)},  # a sum over a whole accumulated batch of 40 targets
        {"ignore_index": 7},  # another ignored label (7 occurs in the labels)
        {"shift_labels": torch.randint(-1, 100, (3, 11), generator=torch.Generator().manual_seed(3))},
    ],
    ids=["mean", "num_items", "ignore_index", "shift_labels"],
)
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_same_loss_and_gradients_as_transformers_in_fp32(chunk_elements, kwargs, scale, monkeypatch):
    monkeypatch.setattr(lm_loss, "CHUNK_ELEMENTS", chunk_elements)
    hidden, weight, labels = inputs(vocab=100)  # padded to 128 rows inside
    if "ignore_index" in kwargs:
        labels[labels == -100] = 7
        labels[1, 2:6] = 7
    if "shift_labels" in kwargs:
        kwargs = {"shift_labels": kwargs["shift_labels"], "ignore_index": -1}
    got = loss_and_grads(lm_loss.causal_lm_loss, hidden, weight, labels, scale, **kwargs)
    ref = loss_and_grads(reference, hidden, weight, labels, scale, **kwargs)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if "shift_labels" not in kwargs:
        assert got[1][:, -1].abs().max() == 0  # the last position predicts nothing


def test_same_loss_and_gradients_under_bf16_autocast():
    hidden, weight, labels = inputs(vocab=100, d=32, seq=33)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(lm_loss.causal_lm_loss, hidden, weight, labels)
        ref = loss_and_grads(reference, hidden, weight, labels)
    # both round the logits to BF16 before an FP32 softmax: the loss agrees to FP32 summation order
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    # gradients: BF16 matmuls, ours summing the head's gradient over chunks in FP32 (theirs rounds it once to BF16)
    for a, b in zip(got[1:], ref[1:]):
        assert a.dtype == b.dtype == torch.float32
        assert rel_err(a, b) < 5e-3  # BF16's 8-bit mantissa: one rounding is 2**-9 = 2e-3 relative
    fp32 = loss_and_grads(lm_loss.causal_lm_loss, hidden, weight, labels)
    assert not torch.equal(fp32[1], got[1])  # autocast really changed the matmuls


def test_under_fp16_autocast_small_gradients_are_not_flushed_to_zero():
    """The stock loss's FP16 gradient is scaled by the GradScaler before it is rounded to FP16; one divided by a large
    ``num_items_in_batch`` first would fall below FP16's smallest number. So in FP16 the chunks' gradients are
    divided in FP32 after the matmuls: as close to the FP32 gradients as the stock loss's."""
    hidden, weight, labels = inputs(vocab=2000, d=32, batch=2, seq=1024)
    weight = weight / 10  # near-uniform softmax: most probabilities about 1 / 2000
    kwargs = {"num_items_in_batch": 8192}  # (a whole accumulated batch: 1 / 2000 / 8192 is FP16's smallest number)
    fp32 = loss_and_grads(reference, hidden, weight, labels, **kwargs)
    with torch.autocast("cpu", dtype=torch.float16):
        got = loss_and_grads(lm_loss.causal_lm_loss, hidden, weight, labels, 65536.0, **kwargs)
        ref = loss_and_grads(reference, hidden, weight, labels, 65536.0, **kwargs)
    for a, b, exact in zip(got[1:], ref[1:], fp32[1:]):
        assert rel_err(b / 65536, exact) < 5e-3  # the stock loss
        assert rel_err(a / 65536, exact) < 5e-3  # FP16's 11-bit mantissa: 2**-11 = 5e-4 a rounding


@pytest.mark.parametrize("divisor", [0, torch.tensor(0)])
def test_a_divisor_of_zero_gives_nan_loss_and_no_error(divisor):
    """All labels ignored in a batch (or ``num_items_in_batch`` 0): the stock loss is NaN; so is this one, without
    raising, and no position gets a non-finite gradient from a chunk in which no target counts."""
    hidden, weight, labels = inputs()
    labels[:] = -100
    loss, grad_h, grad_w = loss_and_grads(lm_loss.causal_lm_loss, hidden, weight, labels, num_items_in_batch=divisor)
    assert loss.isnan()
    assert torch.equal(grad_h, torch.zeros_like(grad_h)) and torch.equal(grad_w, torch.zeros_like(grad_w))


def test_under_torch_compile_each_chunk_is_pointwise_with_the_same_loss_and_gradients(monkeypatch):
    """Compiled, a chunk's gradient is one expression of its logits (measured faster on an H200: Inductor fuses it
    into the softmax); an indexed in-place update in the graph would keep it apart. The maths stays the stock one."""
    monkeypatch.setattr(lm_loss, "CHUNK_ELEMENTS", 5 * 128)  # several chunks
    graphs = []

    def recording_inductor(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))  # with the autograd.Function's body
        return compile_fx(gm, example_inputs)

    hidden, weight, labels = inputs(vocab=100)
    torch._dynamo.reset()
    got = loss_and_grads(torch.compile(lm_loss.causal_lm_loss, backend=recording_inductor), hidden, weight, labels)
    ref = loss_and_grads(reference, hidden, weight, labels)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    code = "\n".join(graphs)
    assert "masked_fill" in code and "logsumexp" in code  # the loss's chunks are in the graph
    assert "setitem" not in code and "index_put" not in code


@pytest.fixture
def interpreted_row_kernel(monkeypatch):
    """The CUDA row kernel (`lm_loss._rows_kernel`) run on CPU tensors by Triton's interpreter (tests/conftest.py
    chooses it on a machine without a GPU; with one, tests/gpu runs the kernel itself), 32 columns a load."""
    pytest.importorskip(
        "triton", reason="Triton is not installed: the row kernel's maths is checked in its interpreter"
    )
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off (a GPU machine): tests/gpu/test_loss_gpu.py runs the kernel")
    try:
        torch.library.wrap_triton(lm_loss._rows_kernel())
    except RuntimeError as error:  # torch 2.11 refuses the interpreter's kernels; 2.13 takes them
        pytest.skip(f"torch {torch.__version__} cannot run Triton's interpreter through wrap_triton ({error})")
    monkeypatch.setattr(lm_loss, "_row_op", lambda hidden: lm_loss._rows_op())
    monkeypatch.setattr(lm_loss, "ROW_BLOCK", 32)  # 100 columns of 128: four loads, the last one partial
    lm_loss._rows_kernel.cache_clear()
    yield
    lm_loss._rows_kernel.cache_clear()


@pytest.mark.parametrize("chunk_bytes", [lm_loss.ROW_CHUNK_BYTES, 5 * 128 * 4])  # one chunk; 8 in FP32, 4 in BF16
def test_the_row_kernel_gives_transformers_loss_and_gradients(interpreted_row_kernel, chunk_bytes, monkeypatch):
    """On a GPU each chunk's log-sum-exp, loss and gradient come from one Triton kernel, the gradient written over
    the logits: the stock maths, with the padding columns and the ignored positions out of it."""
    monkeypatch.setattr(lm_loss, "ROW_CHUNK_BYTES", chunk_bytes)
    hidden, weight, labels = inputs(vocab=100)  # padded to 128 rows inside; labels[0, :4] ignored
    got = loss_and_grads(lm_loss.causal_lm_loss, hidden, weight, labels, 3.0)
    ref = loss_and_grads(reference, hidden, weight, labels, 3.0)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the gradient is written in the logits' BF16
        got = loss_and_grads(lm_loss.causal_lm_loss, hidden, weight, labels)
        ref = loss_and_grads(reference, hidden, weight, labels)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    # twice test_same_loss_and_gradients_under_bf16_autocast's bound: the interpreter truncates FP32 to BF16 where
    # the GPU rounds to nearest (tests/gpu/test_loss_gpu.py holds the kernel to torch's rounding)
    assert all(rel_err(a, b) < 1e-2 for a, b in zip(got[1:], ref[1:]))


def test_the_row_kernel_without_gradients_leaves_the_logits_as_they_were(interpreted_row_kernel):
    logits = torch.randn(6, 128).to(torch.bfloat16)
    targets = torch.tensor([0, 99, -100, 5, 50, 7])
    kept = logits.clone()
    losses = lm_loss._rows_op()(logits, targets, torch.tensor(0.5), 100, -100, False)
    assert torch.equal(logits, kept)
    ref = torch.nn.functional.cross_entropy(logits[:, :100].float(), targets, reduction="none")
    torch.testing.assert_close(losses, ref, rtol=1e-5, atol=1e-5)  # 0 where the target is ignored


# Compiles the row kernel for sm_90 (H100/H200) as Triton's launcher would specialise it for GPT-2's padded logits:
# the pointers and the row stride and width (50,304) divisible by 16, the vocabulary (50,257) not; prints the PTX's
# global loads. Run without Triton's interpreter, which the CPU tests otherwise use.
_SM90_LOADS = textwrap.dedent(
    r"""
    import re, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from hf_apex.kernels.ops import lm_loss as loss
    names = ["logits", "row_stride", "targets", "losses", "scale", "vocab", "cols", "ignore_index"]
    types = ["*bf16", "i32", "*i64", "*fp32", "*fp32", "i32", "i32", "i32"]
    signature = dict(zip(names, types)) | {"GRAD": "constexpr", "BLOCK": "constexpr"}
    by_16 = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in ("vocab", "ignore_index")}
    source = ASTSource(loss._rows_kernel(), signature, {"GRAD": True, "BLOCK": loss.ROW_BLOCK}, by_16)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": loss.ROW_WARPS}).asm["ptx"]
    print(" ".join(re.findall(r"ld\.global\.[\w.]+", ptx)))
    """
)


def test_the_row_kernel_reads_the_logits_16_bytes_at_a_time():
    """The row kernel masks its loads at the padded width and sets the columns past the vocabulary to -inf in
    registers: compiled for an H200 (here, by Triton, without a GPU), it loads GPT-2's logits in 16-byte vectors.
    Masked at the vocabulary, which is not a multiple of 16, every load was 2 bytes, and the kernel took 0.396 ms a
    chunk against 0.349 (46ca0e8:benchmarks/h200-2026-12-03-vector)."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend compiles the kernel for sm_90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", _SM90_LOADS], env=env, cwd=repo, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    loads = run.stdout.split()
    assert "ld.global.v4.b32" in loads, loads  # the logits, 8 BF16 values a load
    assert loads.count("ld.global.b16") <= 1, loads  # only the target's logit, one value


@torch.library.custom_op("hf_apex_test::softmax_xent_rows_", mutates_args={"logits"})
def rows_in_torch(
    logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, vocab: int, ignore_index: int, grad: bool
) -> torch.Tensor:
    """The row kernel's contract in torch's ops, an op as opaque to the compiler as the kernel's: the rows' losses,
    and with ``grad`` their gradient times ``scale`` written over the logits."""
    x = logits.float().masked_fill(torch.arange(logits.shape[1]) >= vocab, float("-inf"))
    lse = x.logsumexp(-1)
    counted = targets != ignore_index
    target = targets.where(counted, 0)
    if grad:
        g = (x - lse[:, None]).exp()
        g[torch.arange(len(target)), target] -= 1
        logits.copy_(g * counted[:, None] * scale)
    return torch.where(counted, lse - x.gather(1, target[:, None]).squeeze(1), 0.0)


@rows_in_torch.register_fake
def _(logits, targets, scale, vocab, ignore_index, grad):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


def test_dynamo_traces_the_loss_with_the_row_kernels_op_in_one_piece(monkeypatch):
    """Where the row kernel runs, the loss asks only whether its op is registered (`_row_op`), so Dynamo traces the
    chunks, the op and the backward in one graph: no piece of the loss runs eagerly between compiled ones. The op
    here is the kernel's contract in torch's ops (Triton's interpreter cannot run under the compiler's fake
    tensors); tests/gpu/test_loss_gpu.py checks the same with the kernel on a GPU."""
    monkeypatch.setattr(lm_loss, "_row_op", lambda hidden: rows_in_torch)
    monkeypatch.setattr(lm_loss, "ROW_CHUNK_BYTES", 5 * 128 * 4)  # several chunks
    hidden, weight, labels = inputs(vocab=100)
    explained = torch._dynamo.explain(lm_loss.causal_lm_loss)(hidden, weight, labels)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    got = loss_and_grads(torch.compile(lm_loss.causal_lm_loss, backend="aot_eager"), hidden, weight, labels)
    torch._dynamo.reset()
    for a, b in zip(got, loss_and_grads(reference, hidden, weight, labels)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_without_gradients_only_the_loss_and_a_frozen_head_gets_none():
    hidden, weight, labels = inputs()
    with torch.no_grad():
        torch.testing.assert_close(lm_loss.causal_lm_loss(hidden, weight, labels), reference(hidden, weight, labels))
    h = hidden.detach().requires_grad_(True)
    lm_loss.causal_lm_loss(h, weight.detach(), labels).backward()  # LoRA-style: the head is frozen
    ref_h = hidden.detach().requires_grad_(True)
    reference(ref_h, weight.detach(), labels).backward()
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", fused.SUPPORTED)
def test_a_swapped_model_trains_on_the_same_loss_and_gradients(family, tmp_path):
    stock = tiny_model(family).train()
    for m in stock.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model = tiny_model(family).train()
    model.load_state_dict(stock.state_dict())
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    assert fused.fuse_linear_cross_entropy(model) is None and fused.fuse_linear_cross_entropy(model) is None
    assert fused.is_fused(model) and isinstance(model, type(stock)) and type(model) is not type(stock)
    first, second = repr(model).splitlines()[:2]
    assert first == f"{type(stock).__name__}(" and second.strip().startswith("training loss: chunked LM head")
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, :5] = -100
    out, ref = model(input_ids=ids, labels=labels), stock(input_ids=ids, labels=labels)
    assert out.logits is None  # never computed
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    ref.loss.backward()
    theirs = dict(stock.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    model.eval()  # evaluation and calls without labels: the stock forward, logits and all
    torch.testing.assert_close(model(input_ids=ids, labels=labels).logits, stock.eval()(input_ids=ids).logits)
    with torch.autocast("cpu", dtype=torch.float16):  # FP16 autocast: the stock loss, logits and all
        assert model.train()(input_ids=ids, labels=labels).logits is not None
    model.compile()  # (nn.Module.compile keeps a compiled call that does not pickle: it must be left out)
    clone = pickle.loads(pickle.dumps(model))
    assert type(clone) is type(model)
    model.save_pretrained(tmp_path)  # the stock class's name, for every tool that loads by config.architectures
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [type(stock).__name__]
    assert fused.unfuse_linear_cross_entropy(model) and type(model) is type(stock)


def test_models_it_cannot_take_are_left_as_they_are():
    import transformers

    bert = tiny_model("bert")
    assert "not a transformers causal LM" in fused.fuse_linear_cross_entropy(bert) and not fused.is_fused(bert)
    double = transformers.GPT2DoubleHeadsModel(tiny_model("gpt2").config)  # a second head and loss: not ours
    assert "not a transformers causal LM" in fused.fuse_linear_cross_entropy(double)

    class Wrapper(torch.nn.Module):  # PEFT-style: delegates config and heads, its base_model is the whole LM
        def __init__(self, model):
            super().__init__()
            self.base_model, self.config = model, model.config

        def get_output_embeddings(self):
            return self.base_model.get_output_embeddings()

    assert "not a transformers causal LM" in fused.fuse_linear_cross_entropy(Wrapper(tiny_model("gpt2")))
    gpt2 = tiny_model("gpt2")
    gpt2.config.logit_scale = 0.5
    assert "transformed before the loss (logit_scale)" in fused.fuse_linear_cross_entropy(gpt2)


def test_the_trainer_switch_trains_records_and_warns(tmp_path, caplog):
    def run(model, name, task="lm", **switches):
        args = ApexTrainingArguments(
            output_dir=str(tmp_path / name),
            use_cpu=True,
            report_to="none",
            max_steps=3,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            save_strategy="no",
            logging_steps=1,
            seed=0,
            disable_tqdm=True,
            **switches,
        )
        trainer = ApexTrainer(model=model, args=args, train_dataset=TokenDataset(n=16, task=task))
        trainer.train()
        metrics = json.loads((tmp_path / name / "hf_apex_metrics.json").read_text())
        return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h], metrics

    model = tiny_model("gpt2")
    trainer, losses, metrics = run(model, "fused", fused_linear_cross_entropy=True)
    assert fused.is_fused(trainer.model)
    assert metrics["lm_loss"] == {"fused_linear_cross_entropy": True, "reason": None} and metrics["loss"]["last"]
    _, stock_losses, stock_metrics = run(tiny_model("gpt2"), "stock")
    assert stock_metrics["lm_loss"] is None and stock_metrics["loss"]["last"] is not None
    assert losses == pytest.approx(stock_losses, rel=1e-5)  # the same training, step by step
    run(model, "reused")  # the switch off: a model reused from the fused run goes back to the stock class
    assert not fused.is_fused(model)
    with caplog.at_level("WARNING", logger="hf_apex"):
        _, _, metrics = run(tiny_model("bert"), "bert", task="cls", fused_linear_cross_entropy=True)
    assert caplog.text.count("fused_linear_cross_entropy is on but not used") == 1  # not again when train() re-applies
    assert metrics["lm_loss"]["fused_linear_cross_entropy"] is False


@pytest.mark.parametrize(
    "num_labels, labels",
    [
        (2, torch.tensor([0, 1, 1])),  # single-label
        (1, torch.tensor([0.5, -1.0, 2.0])),  # regression
        (3, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])),  # multi-label
    ],
)
def test_a_classifier_problem_type_is_settled_as_its_first_forward_would(num_labels, labels):
    """Settled before the first compiled forward, the problem type is the one the model's own forward picks: the
    compiled graph then has no guard on it being None left to fail at the second step."""
    settled, forward = tiny_model("bert", num_labels=num_labels), tiny_model("bert", num_labels=num_labels)
    assert settled.config.problem_type is None
    forward(input_ids=torch.tensor([[5, 6, 7]] * 3), labels=labels)
    wrapped = torch.nn.Module()
    wrapped.module = settled  # (as DDP and FSDP1 hold the model)
    assert fused.settle_problem_type(wrapped, labels) == forward.config.problem_type is not None
    assert settled.config.problem_type == forward.config.problem_type


def test_a_classifier_through_transformers_loss_function_is_settled_too():
    """Llama's classifier sets the problem type in transformers' ForSequenceClassificationLoss, not in its forward."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        pad_token_id=0,
        num_labels=1,
    )
    settled, forward = (transformers.LlamaForSequenceClassification(config) for _ in range(2))
    settled.config = copy.deepcopy(config)
    labels = torch.tensor([1.0, 0.0])
    forward(input_ids=torch.tensor([[5, 6, 7]] * 2), labels=labels)
    assert fused.settle_problem_type(settled, labels) == forward.config.problem_type == "regression"


def test_problem_type_is_left_alone_where_the_forward_would_not_set_it():
    import transformers

    lm = tiny_model("gpt2")
    assert fused.settle_problem_type(lm, torch.tensor([[1, 2, 3]])) is None
    assert getattr(lm.config, "problem_type", None) is None
    config = transformers.Wav2Vec2Config(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=(8,),
        conv_stride=(5,),
        conv_kernel=(10,),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        classifier_proj_size=8,
    )
    audio = transformers.Wav2Vec2ForSequenceClassification(config)  # (its own cross-entropy, whatever the labels)
    assert fused.settle_problem_type(audio, torch.tensor([[1.0, 0.0]])) is None
    assert audio.config.problem_type is None
