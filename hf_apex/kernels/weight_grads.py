"""Weight gradients written in FP32 by their matmuls under ``torch.compile``.

Under BF16 autocast a linear's weight gradient is a BF16 matmul, ``mm(grad_out.T, input)``, then a cast to the FP32
parameter's dtype. In a compiled backward each cast is a kernel of its own that reads the BF16 gradient and writes it
again in FP32 (GPT-2 124M: 48 of them, 85 M elements a step). cuBLAS can write the matmul's FP32 accumulator as it is
(``torch.mm(a, b, out_dtype=torch.float32)``, CUDA only), with no cast after it.

:class:`FP32WeightGrads` is an Inductor post-grad pass (``torch._inductor.config.post_grad_custom_post_pass``). In a
backward graph (one with tangents) it replaces ``convert_element_type(mm(a, b), float32)`` by that matmul where the
operands are BF16 or FP16 CUDA tensors, the cast's only user is the graph's output (a gradient the graph returns) and
the matmul's only user is the cast: the weight gradients of linears and GPT-2's Conv1D, and the gradient of any FP32
graph input made that way. The result is the same sum, rounded once (to FP32) instead of twice (to BF16, then exactly
to FP32). A gradient that is a slice of a larger matmul's (a fused projection's weights, `hf_apex.kernels.projections`)
keeps its matmul and cast; forward graphs are left alone. Inductor caches the compiled graphs, rewrite included: a
graph from its cache does not run the pass again.
"""

from __future__ import annotations

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .availability import has_mm_out_dtype

aten, prims = torch.ops.aten, torch.ops.prims
HALF = (torch.bfloat16, torch.float16)


def _value(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def fp32_weight_grads(graph: fx.Graph, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Rewrite ``graph`` in place as the module says, for operands on ``devices``; the number of matmuls rewritten."""
    if not has_mm_out_dtype() or not any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
        return 0  # (a forward graph: its outputs are what the model computes, left as they are)
    output = graph.output_node()
    done = 0
    for cast in list(graph.nodes):
        if cast.op != "call_function" or cast.target is not prims.convert_element_type.default:
            continue
        mm = cast.args[0]
        if cast.args[1] is not torch.float32 or not isinstance(mm, fx.Node) or mm.target is not aten.mm.default:
            continue
        a, b = mm.args
        va, vb = _value(a), _value(b)
        if va is None or vb is None or va.dtype not in HALF or vb.dtype != va.dtype or va.device.type not in devices:
            continue
        if set(cast.users) != {output} or set(mm.users) != {cast}:
            continue
        with graph.inserting_before(cast):
            fp32 = graph.call_function(aten.mm.dtype, (a, b, torch.float32))
        fp32.meta = dict(cast.meta)
        cast.replace_all_uses_with(fp32)
        graph.erase_node(cast)
        graph.erase_node(mm)
        done += 1
    return done


class FP32WeightGrads(CustomGraphPass):
    """:func:`fp32_weight_grads` as Inductor's post-grad pass. Stateless; its ``uuid`` (the hash of this file) keys
    Inductor's caches."""

    def __call__(self, graph: fx.Graph) -> None:
        fp32_weight_grads(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


FP32_WEIGHT_GRADS = FP32WeightGrads()  # (one instance, equal to itself across runs)
