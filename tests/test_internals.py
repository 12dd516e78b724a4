"""hf_apex.internals: every reach into torch's, transformers' and accelerate's private API resolves at the installed
versions (CI runs this at both ends of the supported range), and no other module of the package or its recipes makes
one of its own."""

import importlib
import re
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from hf_apex import internals
from tests.testing_utils import tiny_model

REPO = Path(__file__).resolve().parents[1]


def resolve(dotted: str):
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def test_every_reach_resolves_at_the_installed_versions():
    # torch
    assert callable(internals.ATEN_LINEAR) and all(callable(resolve(f)) for f in internals.AUTOCAST_REGIONS)
    for module in (internals.INDUCTOR_CONFIG, internals.FUNCTORCH_CONFIG):
        assert hasattr(importlib.import_module(module), "patch")
    assert internals.inductor_config().pre_grad_custom_pass is None
    assert isinstance(internals.inductor_config().unsafe_marked_cacheable_functions, dict)
    assert hasattr(internals.functorch_config(), "ban_recompute_materialized_backward")
    assert internals.compile_mode_options("reduce-overhead")["triton.cudagraphs"] is True
    assert not internals.compile_mode_options("default").get("triton.cudagraphs")
    before = internals.dynamo_counters()["stats"]["unique_graphs"]
    torch.compile(lambda t: t * 2 + 1, backend="eager")(torch.ones(3))
    assert internals.dynamo_counters()["stats"]["unique_graphs"] == before + 1
    with internals.fresh_cache_artifacts():
        assert internals.cache_artifacts_new() is False  # a fresh record holds nothing yet
    graph_pass, hash_of_files = internals.custom_graph_pass()
    assert isinstance(graph_pass, type) and isinstance(hash_of_files((__file__,)), (str, bytes))
    assert not internals.is_fake_tensor(torch.zeros(1))
    assert internals.op_schema(torch.ops.aten.add_.Tensor).is_mutable
    assert internals.op_schema(print) is None
    assert sorted(internals.sdp_priority_order()) == sorted(set(internals.sdp_priority_order()))
    linear = torch.nn.Linear(2, 2)
    assert internals.uncompiled(torch.compile(linear)) is linear and internals.uncompiled(linear) is linear
    assert isinstance(internals.has_triton(), bool) and isinstance(internals.cpu_has_bf16_instructions(), bool)
    tree = {"a": torch.ones(1), "b": [torch.ones(2), 3]}
    doubled = internals.tree_map_only(torch.Tensor, lambda t: t * 2, tree)
    assert doubled["b"][1] == 3 and torch.equal(doubled["b"][0], torch.full((2,), 2.0))
    # transformers
    model = tiny_model("llama")
    assert internals.attn_implementation(model) == "sdpa" and internals.attn_implementation(linear) is None
    assert internals.can_set_attn_implementation(model) and not internals.can_set_attn_implementation(linear)
    assert internals.can_defer_logs(Trainer)
    assert "accelerator_config" in internals.valid_dict_fields(TrainingArguments)


def test_the_trainers_reaches_resolve(tmp_path):
    from hf_apex import ApexTrainer
    from tests.test_trainer import train_args
    from tests.testing_utils import TokenDataset

    args = train_args(tmp_path, stage="baseline", max_steps=1)
    data = TokenDataset()
    trainer = ApexTrainer(model=tiny_model("gpt2"), args=args, train_dataset=data)
    batch = trainer.data_collator([data[i] for i in range(2)])
    assert internals.prepare_inputs(trainer, batch)["input_ids"].shape == batch["input_ids"].shape
    trainer.train()
    assert internals.last_logged_step(trainer) == trainer.state.global_step == 1  # (train_args logs every step)
    assert internals.train_batch_size(trainer) == args.train_batch_size
    count = internals.loss_items_counter(trainer.model, args)
    assert int(count(batch)) == int(trainer._get_num_items_in_batch([batch], args.device))  # the Trainer's own count
    internals.reset_accelerate_state()  # (the next Accelerator sets its own)
    assert internals.fp32_output_conversion(trainer.model) is None  # FP32: accelerate wraps nothing


# A private name of torch, transformers or accelerate reached from code: a module path with a _name in it, a _name
# imported from one of them, a _name asked of an object by getattr/hasattr/setattr (hf_apex's own _hf_apex_* aside),
# or one of the private attributes of their objects that hf_apex uses. torch._foreach_* (its documented multi-tensor
# API) aside.
PRIVATE_REACH = re.compile(
    r"\b(?:torch|transformers|accelerate)(?:\.\w+)*\._(?!foreach_|_)\w"
    r"|\bfrom (?:torch|transformers|accelerate)[\w.]* import [^#]*\b_(?!_)\w"
    r"|\b(?:getattr|hasattr|setattr)\([^,]+, [\"']_(?!_|hf_apex)\w"
    r"|\.(?:_prepare_inputs|_globalstep_last_logged|_attn_implementation|_can_set_attn_implementation|_reset_state"
    r"|_get_num_items_in_batch|_loss_shifts_labels|_orig_mod|_schema|_local_tensor|_train_batch_size"
    r"|_name_or_path)\b"
    r"|[\"'](?:_attn_implementation|_orig_mod|_schema|_original_forward)[\"']"
    r"|\bConvertOutputsToFp32\b|\._VALID_DICT_FIELDS\b"
)


def private_reaches(text: str) -> list[tuple[int, str]]:
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if PRIVATE_REACH.search(line)]


def test_no_module_but_internals_reaches_into_private_names():
    files = [*(REPO / "hf_apex").rglob("*.py"), *(REPO / "recipes").glob("*.py")]
    found = {
        str(f.relative_to(REPO)): hits
        for f in files
        if f.name != "internals.py" and (hits := private_reaches(f.read_text()))
    }
    assert not found, f"private reaches outside hf_apex/internals.py: {found}"


def test_the_check_finds_each_kind_of_reach():
    for line in (
        "from torch._inductor import config",
        "import torch._functorch.config",
        "x = torch._C._nn.linear",
        "trainer._prepare_inputs(inputs)",
        'getattr(config, "_attn_implementation", None)',
        "AcceleratorState._reset_state()",
        "base._VALID_DICT_FIELDS + more",
        "from torch import _dynamo",
        "from torch.utils import _pytree",
        "local = p._local_tensor",
        'getattr(torch.cpu, "_is_amx_tile_supported", None)',
        'getattr(config, "_name_or_path", None)',
        "trainer._train_batch_size",
    ):
        assert private_reaches(line), line
    for line in (
        "torch._foreach_add_(xs, ys)",
        "torch.compiler.reset()",
        "self._deferred_log.write()",
        'getattr(model, "_hf_apex_rewired", None)',
        'getattr(on_log, "__module__", "")',
    ):
        assert not private_reaches(line), line
