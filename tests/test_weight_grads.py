"""Weight gradients written in FP32 by their matmuls (hf_apex.kernels.weight_grads): which nodes of a compiled
backward the pass rewrites (tests/test_trainer.py: that the trainer sets it for its compiled steps). The rewritten
matmul (``aten::mm.dtype``) runs on CUDA only; tests/gpu/test_fast_stage_gpu.py trains with it on a GPU."""

import pytest
import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from hf_apex.kernels import weight_grads
from hf_apex.kernels.availability import has_mm_out_dtype
from tests.testing_utils import tiny_inputs, tiny_model

pytestmark = pytest.mark.skipif(not has_mm_out_dtype(), reason="this torch has no torch.mm(..., out_dtype=)")


class Recording(CustomGraphPass):
    """Inductor's post-grad pass slot, recording a copy of each graph as the pass receives it (the copy is what the
    tests rewrite: on a CPU the rewritten matmul could not run)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph: fx.Graph) -> None:
        copy = fx.Graph()
        copy.output(copy.graph_copy(graph, {}))
        self.graphs.append(copy)

    def uuid(self) -> bytes:
        return b"recording"


def post_grad_graphs(family: str, autocast: bool) -> dict[str, fx.Graph]:
    """The forward and backward graphs of one compiled training step of a tiny ``family`` model, as Inductor hands
    them to its post-grad pass."""
    import torch._inductor.config as inductor

    model = tiny_model(family).train()
    recording = Recording()
    torch._dynamo.reset()
    step = torch.compile(lambda **kw: model(**kw).loss)
    inputs = tiny_inputs(family)
    with inductor.patch(post_grad_custom_post_pass=recording, force_disable_caches=True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            step(**inputs, labels=inputs["input_ids"]).backward()
    torch._dynamo.reset()
    backward = [g for g in recording.graphs if any(n.name.startswith("tangents") for n in g.nodes)]
    forward = [g for g in recording.graphs if g not in backward]
    assert forward and backward
    return {"forward": forward, "backward": backward}


def casts(graphs) -> int:
    return sum(n.target is torch.ops.prims.convert_element_type.default for g in graphs for n in g.nodes)


def weights_in_matmuls(family: str) -> int:
    """The model's linear weights (nn.Linear, GPT-2's Conv1D) apart from a head tied to the input embeddings, whose
    gradient is a sum with the embeddings' and so no matmul's alone."""
    from transformers.pytorch_utils import Conv1D

    model = tiny_model(family)
    embeddings = model.get_input_embeddings().weight
    return sum(isinstance(m, (torch.nn.Linear, Conv1D)) and m.weight is not embeddings for m in model.modules())


@pytest.mark.parametrize("family, expected", [("gpt2", 8), ("llama", 15)])
def test_each_weight_gradient_of_a_bf16_backward_comes_from_one_fp32_matmul(family, expected):
    # GPT-2's 2 layers: 4 Conv1D weights each (their weight is (in, out)), its head tied; the tiny Llama's: q, k, v,
    # o, gate, up and down, nn.Linear's (out, in), and its own head
    assert weights_in_matmuls(family) == expected
    graphs = post_grad_graphs(family, autocast=True)
    before = casts(graphs["backward"])
    # on the CPU's graphs, as the pass treats CUDA ones (mm.dtype runs on CUDA only; nothing runs here)
    done = sum(weight_grads.fp32_weight_grads(g, devices=("cpu",)) for g in graphs["backward"])
    assert done == expected  # the embeddings' gradients come from elsewhere, the activations' stay BF16
    assert before - casts(graphs["backward"]) == expected
    rewritten = [n for g in graphs["backward"] for n in g.nodes if n.target is torch.ops.aten.mm.dtype]
    assert len(rewritten) == expected
    for node in rewritten:
        assert set(node.users) == {node.graph.output_node()} and node.args[2] is torch.float32
        assert node.meta["val"].dtype == torch.float32
        node.graph.lint()
    assert sum(weight_grads.fp32_weight_grads(g, devices=("cpu",)) for g in graphs["forward"]) == 0  # left alone


def test_fp32_and_other_devices_are_left_alone():
    graphs = post_grad_graphs("gpt2", autocast=False)
    assert sum(weight_grads.fp32_weight_grads(g, devices=("cpu",)) for g in graphs["backward"]) == 0  # no casts
    graphs = post_grad_graphs("gpt2", autocast=True)
    assert sum(weight_grads.fp32_weight_grads(g) for g in graphs["backward"]) == 0  # CUDA only: CPU tensors here
