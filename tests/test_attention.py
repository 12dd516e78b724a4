"""attention_backend: the model's first SDPA call is captured, each backend that can run it is timed, the fastest
whose results match the math backend's is put first for every step (hf_apex/kernels/models/attention.py; the timing
probe: hf_apex/autotune/probes.py)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_apex import ApexTrainer, ApexTrainingArguments
from hf_apex.autotune import Autotuner, DecisionCache, attention_probe
from hf_apex.kernels.models import attention
from hf_apex.measure.report import METRICS_FILENAME
from tests.test_trainer import train_args
from tests.testing_utils import TokenDataset, record_sdpa_calls_as_eager, sdpa_call_recorder, tiny_inputs, tiny_model

MATH_OP, CPU_FLASH_OP = "aten::_scaled_dot_product_attention_math", "aten::_scaled_dot_product_flash_attention_for_cpu"


def sdpa_ops(fn) -> set[str]:
    """The SDPA implementations ``fn`` runs, as the profiler names them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name in (MATH_OP, CPU_FLASH_OP)}


def fake_timer(ms: dict[str, float]):
    def timer(fn, budget_s):
        fn()
        return ms[fn.backend]

    return timer


def test_capture_records_the_first_call_and_leaves_the_model_and_rng_alone():
    model = tiny_model("gpt2").train()  # attention dropout 0.1, causal
    inputs = tiny_inputs("gpt2")
    rng = torch.get_rng_state()
    call = attention.capture(lambda: model(**inputs, labels=inputs["input_ids"]).loss.backward())
    assert torch.equal(torch.get_rng_state(), rng)  # the dropout masks of the real step stay as they were
    assert all(p.grad is None for p in model.parameters())  # stopped at the first attention, without gradients
    heads, dim = model.config.n_head, model.config.n_embd // model.config.n_head
    assert call.query == call.key == call.value == (2, heads, 16, dim)
    assert call.dtype == torch.float32 and call.is_causal and call.mask is None
    assert call.dropout_p == pytest.approx(model.config.attn_pdrop)
    model.eval()
    assert attention.capture(lambda: model(**inputs)).dropout_p == 0.0  # what an evaluation step would run

    bert = tiny_model("bert").train()
    padded = tiny_inputs("bert")
    padded["attention_mask"][0, 10:] = 0
    masked = attention.capture(lambda: bert(**padded))
    assert masked.mask is not None and not masked.is_causal and masked.describe()["mask"]["shape"][0] == 2

    eager = tiny_model("gpt2", attn_implementation="eager")
    assert attention.capture(lambda: eager(**inputs)) is None  # no SDPA call: nothing to choose


def test_under_autocast_the_call_is_recorded_in_the_dtype_sdpa_runs_in():
    """A Llama reaches SDPA with FP32 queries and keys (its rotary embedding multiplies by FP32 cos/sin) and BF16
    values; autocast runs the call in BF16, so that is what the probe must time and check."""
    for family in ("llama", "gpt2"):
        model, inputs = tiny_model(family).train(), tiny_inputs(family)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            call = attention.capture(lambda model=model, inputs=inputs: model(**inputs))
        assert call.dtype == torch.bfloat16, family
    bert = tiny_model("bert").train()
    padded = tiny_inputs("bert")
    padded["attention_mask"][0, 10:] = 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        masked = attention.capture(lambda: bert(**padded))
    assert masked.mask is not None and masked.dtype == torch.bfloat16
    assert masked.mask.dtype in (torch.bool, torch.bfloat16)  # a float mask is cast with the call
    candidates, parity = attention_probe(masked)
    assert "math" in candidates and parity("math")


def test_probe_offers_the_backends_that_run_the_call_and_checks_them_against_math():
    model = tiny_model("llama").train()  # no attention dropout: the CPU flash kernel can run it
    call = attention.capture(lambda: model(**tiny_inputs("llama")))
    candidates, parity = attention_probe(call)
    assert list(candidates) == ["torch", "flash", "math"]  # no CUDA here: no cuDNN, no memory-efficient kernel
    assert parity("flash") and parity("math")
    assert sdpa_ops(candidates["flash"]) == {CPU_FLASH_OP} and sdpa_ops(candidates["math"]) == {MATH_OP}
    dropout = attention.capture(lambda: tiny_model("gpt2").train()(**tiny_inputs("gpt2")))
    assert list(attention_probe(dropout)[0]) == ["torch", "math"]  # CPU flash takes no dropout


def test_the_probe_replays_the_call_in_the_models_memory_layout(monkeypatch):
    """GPT-2 hands SDPA its heads as views into one (batch, tokens, 3 x width) projection; the probe times the
    backends on inputs laid out the same way, and the output's gradient with heads inside tokens, as the model's
    output projection gives it back."""
    model = tiny_model("gpt2", use_cache=False).train()
    call = attention.capture(lambda: model(**tiny_inputs("gpt2")))
    batch, heads, tokens, dim = call.query
    view = (tokens * 3 * heads * dim, dim, 3 * heads * dim, 1)  # q, k, v: thirds of c_attn's output
    assert call.strides == (view, view, view) and call.describe()["strides"] == [list(view)] * 3
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append(tuple(t.stride() for t in (q, k, v)))
        out = real(q, k, v, **kwargs)
        out.register_hook(lambda grad: seen.append(grad.stride()))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    candidates, _ = attention_probe(call)
    seen.clear()
    candidates["math"]()
    assert seen == [(view, view, view), (tokens * heads * dim, dim, heads * dim, 1)]
    contiguous = dataclasses.replace(call, strides=None)
    seen.clear()
    attention_probe(contiguous)[0]["math"]()
    assert seen[0][0] == torch.empty(call.query).stride()
    # a key and value expanded over the heads (stride 0: one memory location for many elements) replay contiguous
    expanded = (tokens * dim, 0, dim, 1)
    seen.clear()
    attention_probe(dataclasses.replace(call, strides=(view, expanded, expanded)))[0]["math"]()
    assert seen[0] == (view, torch.empty(call.key).stride(), torch.empty(call.value).stride())


def test_a_backend_whose_results_are_off_fails_parity(monkeypatch):
    call = attention.AttentionCall(
        (2, 4, 64, 32),
        (2, 4, 64, 32),
        (2, 4, 64, 32),
        torch.bfloat16,
        torch.device("cpu"),
        None,
        0.0,
        True,
        None,
        False,
    )
    assert attention_probe(call)[1]("flash")  # a BF16 kernel against the FP32 reference: within tolerance
    real = torch.nn.functional.scaled_dot_product_attention

    def off_unless_math(*args, **kwargs):  # every kernel but math's 3 % off
        out = real(*args, **kwargs)
        return (
            out
            if torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
            else out * 1.03
        )

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", off_unless_math)
    _, parity = attention_probe(call)
    assert not parity("flash") and parity("math")


def test_the_autotuner_keeps_the_fastest_backend_and_caches_it(tmp_path):
    call = attention.capture(lambda: tiny_model("llama").train()(**tiny_inputs("llama")))
    cache = tmp_path / "cache.json"
    tuner = Autotuner(DecisionCache(cache), timer=fake_timer({"torch": 3.0, "flash": 2.0, "math": 1.0}))
    assert tuner.choose_attention(call) == "math" and tuner.state() == {"attention": "math"}
    (decision,) = tuner.report()
    assert decision["component"] == "attention" and decision["key"]["is_causal"] and not decision["cached"]
    assert decision["times_ms"] == {"torch": 3.0, "flash": 2.0, "math": 1.0}
    again = Autotuner(DecisionCache(cache), timer=fake_timer({}))  # would fail if it timed anything
    assert again.choose_attention(call) == "math" and again.report()[0]["cached"]
    # Nothing to time: PyTorch's own choice, with the reason.
    plain = Autotuner(DecisionCache(tmp_path / "other.json"))
    assert plain.choose_attention(call) == "torch"  # CUDA events cannot time a CPU call
    assert plain.report()[0]["reason"] == "not timed: CUDA events time CUDA only"
    assert Autotuner(DecisionCache(tmp_path / "3.json")).choose_attention(None) == "torch"
    # A resumed run keeps its checkpoint's decision (Autotuner.state() is saved with each checkpoint).
    resumed = Autotuner(DecisionCache(tmp_path / "4.json"), timer=fake_timer({}))
    resumed.begin_run(pinned={"attention": "flash"})
    assert resumed.choose_attention(call) == "flash" and resumed.report()[0]["reason"] == "resumed checkpoint"


def test_timing_the_attention_leaves_the_random_streams_alone(tmp_path):
    call = attention.capture(lambda: tiny_model("gpt2").train()(**tiny_inputs("gpt2")))  # dropout 0.1
    tuner = Autotuner(DecisionCache(tmp_path / "cache.json"), timer=fake_timer({"torch": 2.0, "math": 1.0}))
    rng = torch.get_rng_state()
    assert tuner.choose_attention(call) == "math"  # its dropout calls ran (the fake timer calls each once)
    assert torch.equal(torch.get_rng_state(), rng)


def test_preferring_puts_the_backend_first_and_falls_back_where_it_cannot_run():
    model = tiny_model("llama").train()
    inputs = tiny_inputs("llama")
    assert sdpa_ops(lambda: model(**inputs)) == {CPU_FLASH_OP}  # PyTorch's choice here
    with attention.preferring("math"):
        assert sdpa_ops(lambda: model(**inputs)) == {MATH_OP}
    with attention.preferring("efficient"):  # not on a CPU: the next in line runs
        assert sdpa_ops(lambda: model(**inputs)) == {CPU_FLASH_OP}
    with attention.preferring(None), attention.preferring("torch"):
        assert sdpa_ops(lambda: model(**inputs)) == {CPU_FLASH_OP}
    assert sdpa_ops(lambda: model(**inputs)) == {CPU_FLASH_OP}  # and nothing is left changed
    # After the preferred backend, the others keep PyTorch's own order.
    default = torch._C._get_sdp_priority_order()
    fused = [int(b) for b in attention.BACKENDS.values()]
    with attention.preferring("efficient"):
        order = torch._C._get_sdp_priority_order()
    assert order[0] == int(attention.BACKENDS["efficient"])
    assert [b for b in order if b in fused][1:] == [b for b in default if b in fused and b != order[0]]
    assert torch._C._get_sdp_priority_order() == default


# A compiled training step in a process of its own, under a preference; prints the SDPA ops it ran.
COMPILED_STEP = """
import sys, torch
from hf_apex.kernels.models import attention
from tests.testing_utils import tiny_inputs, tiny_model
inputs = tiny_inputs("llama")
inputs.pop("attention_mask")
model = torch.compile(tiny_model("llama").train())
with attention.preferring(sys.argv[1]):
    model(**inputs, labels=inputs["input_ids"]).loss.backward()  # compiled here
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
print(sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name}))
"""


def test_a_compiled_graph_cached_on_disk_does_not_override_the_preferred_backend(tmp_path):
    """AOTAutograd's disk cache keys a graph without SDPA's priority: under a preference it is left alone, so a run
    that prefers math does not get the flash graph an earlier process compiled under PyTorch's choice."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),  # shared by both processes, as by a bench's runs
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "CUDA_VISIBLE_DEVICES": "",
    }

    def ops(backend: str) -> str:
        out = subprocess.run([sys.executable, "-c", COMPILED_STEP, backend], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    assert CPU_FLASH_OP.removeprefix("aten::") in ops("torch")  # compiled and cached under PyTorch's choice
    assert CPU_FLASH_OP.removeprefix("aten::") not in ops("math")  # (Inductor decomposes math attention)


def test_the_fastest_stage_times_the_attention_and_a_value_of_yours_wins(tmp_path):
    assert ApexTrainingArguments(output_dir=str(tmp_path), stage="fastest", use_cpu=True).attention_backend == (
        "fastest"
    )
    mine = ApexTrainingArguments(output_dir=str(tmp_path), stage="fastest", use_cpu=True, attention_backend="flash")
    assert mine.attention_backend == "flash"
    assert ApexTrainingArguments(output_dir=str(tmp_path), stage="compiled", use_cpu=True).attention_backend is None
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ApexTrainingArguments(output_dir=str(tmp_path), attention_backend="flash3", use_cpu=True)


def train(tmp_path, name: str, **kw):
    """A tiny Llama trained 4 steps; then the SDPA kernels one more training step and an evaluation run."""
    args = train_args(tmp_path / name, max_steps=4, **kw)
    data = TokenDataset()
    trainer = ApexTrainer(model=tiny_model("llama").train(), args=args, train_dataset=data, eval_dataset=data)
    if trainer.autotuner is not None:  # CUDA events cannot time CPU work: a timer that makes math the fastest
        trainer.autotuner.timer = fake_timer({"torch": 3.0, "flash": 2.0, "math": 1.0})
    trainer.train()
    metrics = json.loads((tmp_path / name / METRICS_FILENAME).read_text())
    batch = trainer.data_collator([data[i] for i in range(4)])
    step = sdpa_ops(lambda: trainer.training_step(trainer.model_wrapped, batch))
    return trainer, step, sdpa_ops(trainer.evaluate), [h["loss"] for h in metrics["loss_history"]], metrics


def test_the_trainer_trains_and_evaluates_with_the_backend_it_chose(tmp_path, own_hf_apex_cache):
    _, step, evaluation, losses, metrics = train(tmp_path, "default")
    assert step == evaluation == {CPU_FLASH_OP} and "attention_backend" not in metrics["kernels"]
    trainer, step, evaluation, fastest_losses, metrics = train(tmp_path, "fastest", attention_backend="fastest")
    assert trainer.plan.sdpa_backend == "math" and metrics["kernels"]["attention_backend"] == "math"
    assert step == evaluation == {MATH_OP}
    decision = next(d for d in metrics["autotune"] if d["component"] == "attention")
    assert decision["backend"] == "math" and decision["cached"] is False
    assert fastest_losses == pytest.approx(losses, rel=1e-5)  # the same attention, another kernel
    _, step, evaluation, named_losses, metrics = train(tmp_path, "named", attention_backend="math")
    assert step == evaluation == {MATH_OP} and metrics["kernels"]["attention_backend"] == "math"
    assert metrics["autotune"] == [] and named_losses == pytest.approx(losses, rel=1e-5)


def test_a_model_in_eval_mode_is_timed_on_its_training_call(tmp_path, own_hf_apex_cache):
    """from_pretrained returns a model in eval mode; the attention is timed as the training steps run it, with
    dropout."""
    model = tiny_model("gpt2")  # eval mode
    args = train_args(tmp_path, max_steps=2, attention_backend="fastest")
    trainer = ApexTrainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.autotuner.timer = fake_timer({"torch": 2.0, "math": 1.0})
    trainer.train()
    (decision,) = [d for d in trainer.autotuner.report() if d["component"] == "attention"]
    assert decision["key"]["dropout_p"] == pytest.approx(model.config.attn_pdrop)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])  # (on a CPU Inductor records no CUDA graphs)
def test_under_torch_compile_the_graph_is_traced_with_the_chosen_backend(tmp_path, mode, own_hf_apex_cache):
    kw = dict(attention_backend="fastest", torch_compile=True, torch_compile_mode=mode)
    trainer, step, evaluation, _, metrics = train(tmp_path, "c", **kw)
    assert metrics["run"]["torch_compile"] and metrics["run"]["torch_compile_mode"] == mode
    assert trainer.plan.sdpa_backend == "math"
    assert step == evaluation == {MATH_OP}  # PyTorch's own choice here is the flash kernel (test above)


def _sdpa_masks_compiled(model, inputs) -> tuple[list[tuple[bool, bool]], torch.Tensor]:
    """(mask given?, is_causal) of each SDPA call in ``model``'s compiled graph, and its output."""
    calls, backend = sdpa_call_recorder()
    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(**inputs).logits
    torch._dynamo.reset()
    return calls, out


@pytest.fixture
def transformers_cannot_skip_masks(monkeypatch):
    """transformers as 5.17 (any release on torch < 2.14) runs under torch.compile: it never leaves a mask out."""
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    monkeypatch.setattr(masking_utils, "_ignore_bidirectional_mask_sdpa", lambda *a, **k: False)


@pytest.mark.parametrize("family,causal", [("gpt2", True), ("llama", True), ("bert", False)])
def test_static_masks_leave_a_plain_mask_out_under_torch_compile(family, causal, transformers_cannot_skip_masks):
    stock, inputs = tiny_model(family), tiny_inputs(family)
    inputs.pop("attention_mask")  # (as the collator leaves an all-ones one out)
    padded = {**inputs, "attention_mask": torch.ones_like(inputs["input_ids"])}
    padded["attention_mask"][0, 10:] = 0
    calls, _ = _sdpa_masks_compiled(stock, inputs)
    assert calls and all(mask and not is_causal for mask, is_causal in calls)  # the whole square, masked

    model = tiny_model(family)
    assert attention.static_masks_blocker(model) is None and attention.use_static_masks(model)
    assert model.config._attn_implementation == attention.STATIC_MASKS
    calls, out = _sdpa_masks_compiled(model, inputs)
    assert calls and all(not mask and is_causal == causal for mask, is_causal in calls)
    torch.testing.assert_close(out, stock(**inputs).logits)  # the same attention
    calls, out = _sdpa_masks_compiled(model, padded)
    assert calls and all(mask for mask, _ in calls)  # padding: the mask is built
    torch.testing.assert_close(out, stock(**padded).logits)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_training_step_without_position_ids_gets_is_causal_under_torch_compile(family):
    # As the Trainer runs the model: no KV cache (use_cache=False), and no mask (an all-ones one left out). Then
    # transformers asks the position ids whether rows are packed, and under torch.compile, unable to tell, masks as
    # if they were: the whole square, masked. A batch without position_ids has the model's own: one sequence a row.
    inputs = tiny_inputs(family)
    inputs.pop("attention_mask")
    stock, model = tiny_model(family, use_cache=False), tiny_model(family, use_cache=False)
    assert attention.use_static_masks(model)
    calls, _ = _sdpa_masks_compiled(model, inputs)
    assert calls and all(mask and not is_causal for mask, is_causal in calls)  # (transformers' own decision)
    with attention.one_sequence_per_row():
        calls, out = _sdpa_masks_compiled(model, inputs)
        assert calls and all(not mask and is_causal for mask, is_causal in calls)
    torch.testing.assert_close(out, stock(**inputs).logits)  # the same attention
    assert attention.masking_utils.find_packed_sequence_indices is not attention._one_sequence_per_row  # restored


def test_the_trainer_hands_its_compiled_steps_is_causal(tmp_path, monkeypatch):
    """Training and evaluation steps through ApexTrainer under torch.compile: each SDPA call of the graphs Dynamo
    traced has no mask and is_causal (a graph-recording stand-in for the eager backend)."""
    calls = record_sdpa_calls_as_eager(monkeypatch)
    torch._dynamo.reset()
    args = train_args(tmp_path, max_steps=2, stage="compiled", torch_compile_backend="eager")
    data = TokenDataset()
    trainer = ApexTrainer(model=tiny_model("llama").train(), args=args, train_dataset=data, eval_dataset=data)
    trainer.train()
    trainer.evaluate()
    torch._dynamo.reset()
    assert trainer.plan.masks.report and calls and all(not mask and is_causal for mask, is_causal in calls), calls
    # A batch with position ids of its own (a flattening collator packs rows with them) is left to transformers
    batch = trainer.data_collator([data[i] for i in range(2)])
    assert trainer.plan.one_sequence_per_row(batch)
    assert not trainer.plan.one_sequence_per_row({**batch, "position_ids": torch.arange(16).repeat(2, 1)})
    kernels = json.loads((tmp_path / METRICS_FILENAME).read_text())["kernels"]
    said = kernels["attention_masks"]
    assert "one sequence per row" in said and "a padded batch keeps its mask" in said and "no padding" not in said


def test_static_masks_never_read_a_padding_mask_to_decide(monkeypatch):
    """Eager transformers asks whether the padding mask is all ones (`.all()`: a device sync per forward); with
    static masks a mask that reaches the model is built as it is, and the outputs are the same."""
    from transformers import masking_utils

    for family in ("gpt2", "bert"):
        stock, model, inputs = tiny_model(family), tiny_model(family), tiny_inputs(family)
        inputs["attention_mask"][0, 10:] = 0
        expected = stock(**inputs).logits
        assert attention.use_static_masks(model)
        with monkeypatch.context() as patch:
            for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
                patch.setattr(masking_utils, name, lambda *a, **k: pytest.fail("read the padding mask"))
            torch.testing.assert_close(model(**inputs).logits, expected)


def test_static_masks_leave_other_attention_alone_and_switch_back():
    eager = tiny_model("gpt2", attn_implementation="eager")
    assert "'eager'" in attention.static_masks_blocker(eager) and not attention.use_static_masks(eager)
    assert eager.config._attn_implementation == "eager"
    model = tiny_model("gpt2")
    assert attention.use_static_masks(model) and attention.use_static_masks(model)  # (twice: the same)
    assert not attention.use_static_masks(model, on=False) and model.config._attn_implementation == "sdpa"


def test_static_masks_leave_a_model_that_tests_for_the_name_sdpa_alone(tmp_path, monkeypatch):
    """Such a model's code takes another path under any other name (Falcon's, in transformers 5.17)."""
    (tmp_path / "sdpa_by_name.py").write_text(
        "from transformers import GPT2LMHeadModel\n\n\n"
        "class ByName(GPT2LMHeadModel):\n"
        "    def fast_path(self):\n"
        '        return self.config._attn_implementation == "sdpa"\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import sdpa_by_name

    model = sdpa_by_name.ByName(tiny_model("gpt2").config)
    assert "sdpa_by_name tests for the name 'sdpa'" in attention.static_masks_blocker(model)
    assert not attention.use_static_masks(model) and model.config._attn_implementation == "sdpa"
