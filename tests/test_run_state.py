"""State scoped to the run: what ApexTrainer changes outside its own objects is undone when train() returns or raises,
and trainers that take turns in one process get the results each gets alone. The stages that run on a CPU run here;
tests/gpu/test_subclass_gpu.py checks `fastest` and `auto` on the GPU."""

import os

import pytest
import torch
from transformers import TrainerCallback, masking_utils, set_seed
from transformers.modeling_utils import AttentionInterface

from hf_apex import STAGES, ApexTrainer
from hf_apex.kernels.models.attention import STATIC_MASKS
from tests.test_trainer import train_args
from tests.testing_utils import TokenDataset, tiny_model

# How each stage runs on a CPU: the compiled ones through aot_eager (their compile settings and static masks, without
# Inductor's C++ build), fastest at any length; auto's CUDA graphs need a GPU, so it runs its eager kernels here.
CPU = {
    "compiled": {"torch_compile_backend": "aot_eager"},
    "fastest": {"torch_compile_backend": "aot_eager", "stage_recipe": {"min_steps": 0}},
}


def process_state() -> dict:
    """What a run could change in the process and leave behind, as far as a test can read it."""
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config

    return {
        "tf32": tuple(
            b.fp32_precision
            for b in (torch.backends, torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn)
        ),
        "default_dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "sdpa": (
            tuple(int(b) for b in torch._C._get_sdp_priority_order()),
            torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.math_sdp_enabled(),
            torch.backends.cuda.cudnn_sdp_enabled(),
        ),
        "dynamo": torch._dynamo.config.get_config_copy(),
        "inductor": {k: repr(v) for k, v in torch._inductor.config.get_config_copy().items()},
        "functorch": torch._functorch.config.get_config_copy(),
        # transformers' mask and attention functions: hf_apex adds its own under a name of its own, which is kept
        "masking_utils": {k: v for k, v in vars(masking_utils).items() if callable(v)},
        "mask_functions": {k: v for k, v in masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.items() if k != STATIC_MASKS},
        "attention_functions": {k: v for k, v in AttentionInterface._global_mapping.items() if k != STATIC_MASKS},
        # the Trainer's accelerate sets ACCELERATE_* variables of its own; every other one must stay as it was
        "environ": {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")},
    }


def changed(before: dict, after: dict) -> dict:
    diff = {}
    for key in before:
        if isinstance(before[key], dict):
            names = set(before[key]) | set(after[key])
            inner = {
                n: (before[key].get(n), after[key].get(n)) for n in names if before[key].get(n) != after[key].get(n)
            }
            if inner:
                diff[key] = inner
        elif before[key] != after[key]:
            diff[key] = (before[key], after[key])
    return diff


def losses_of(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def data(family: str, n: int = 64) -> TokenDataset:
    return TokenDataset(n=n, task="lm" if family == "gpt2" else "cls")


def build(tmp_path, stage, family="gpt2", **kw):
    args = train_args(tmp_path, stage=stage, max_steps=3, metrics_warmup_steps=1, **{**CPU.get(stage, {}), **kw})
    return ApexTrainer(model=tiny_model(family).train(), args=args, train_dataset=data(family))


def train(trainer) -> list[float]:
    set_seed(0)  # (train() draws dropout's masks from the process's generator, wherever the last run left it)
    trainer.train()
    return losses_of(trainer)


def evaluate(trainer, family: str) -> float:
    return trainer.evaluate(data(family, n=8))["eval_loss"]


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_run_of_each_stage_leaves_the_process_as_it_found_it(stage, tmp_path):
    # Not torch's defaults, so that a run that sets torch's defaults back is caught too
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    trainer = build(tmp_path, stage)
    during = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            during.append(process_state())

    trainer.add_callback(Snapshot())
    before = process_state()
    train(trainer)
    assert changed(before, process_state()) == {}
    if trainer.args.tf32 is False:  # (the run itself did change it: strict FP32, as the stage asks)
        assert during[0]["tf32"][1:] == ("ieee", "ieee", "ieee")
    # and a run that raises undoes it too
    failing = build(tmp_path / "failing", stage)

    class Fail(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("a callback of yours failed")

    failing.add_callback(Fail())
    before = process_state()
    with pytest.raises(RuntimeError, match="a callback of yours failed"):
        failing.train()
    assert changed(before, process_state()) == {}
    assert failing.model.config._attn_implementation != STATIC_MASKS  # the model leaves with transformers' attention


def test_the_snapshot_sees_a_change_left_behind(tmp_path):
    """The snapshot above is only worth what it can see: a run that leaves TF32 changed, an SDPA backend preferred or
    an environment variable set is caught."""
    before = process_state()
    conv = torch.backends.cudnn.conv.fp32_precision
    torch.backends.cudnn.conv.fp32_precision = "tf32" if conv == "ieee" else "ieee"
    os.environ["HF_APEX_TEST_LEFT_BEHIND"] = "1"
    try:
        assert set(changed(before, process_state())) == {"tf32", "environ"}
    finally:
        del os.environ["HF_APEX_TEST_LEFT_BEHIND"]
        torch.backends.cudnn.conv.fp32_precision = conv


# Pairs that differ in what they change: precision and TF32, norms swapped or not, compiled with the stage's settings
# or eager, static masks or transformers' (BERT: a mask of its own).
PAIRS = [("baseline", "fused_full"), ("fastest", "fused_adam_ln"), ("compiled", "fastest")]


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_trainers_that_take_turns_get_what_each_gets_alone(first, second, tmp_path):
    alone = {}
    for name, stage, family in (("a", first, "gpt2"), ("b", second, "bert")):
        trainer = build(tmp_path / f"alone-{name}", stage, family)
        alone[name] = train(trainer), evaluate(trainer, family)
    # Built one after the other and trained in the other order; each evaluated after the other's run
    a = build(tmp_path / "a", first, "gpt2")
    b = build(tmp_path / "b", second, "bert")
    b_losses = train(b)
    a_losses = train(a)
    assert (a_losses, evaluate(a, "gpt2")) == alone["a"]
    assert (b_losses, evaluate(b, "bert")) == alone["b"]
