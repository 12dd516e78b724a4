"""Run a recipe with its weight gradients written in FP32 by the matmul itself: an experiment, not hf_apex's path.

usage: python benchmarks/scripts/fp32_weight_grads.py recipes/finetune.py [flags...]
       (or WRAPPER=benchmarks/scripts/fp32_weight_grads.py with benchmarks/scripts/run_variant.py)

Under BF16 autocast a linear's weight gradient is a BF16 matmul, ``mm(grad_out.T, input)``, and then a cast to the
FP32 parameter's dtype. In GPT-2's compiled backward (H200, torch 2.11, benchmarks/h200-2026-12-03-bench) each of
the 48 casts is a Triton kernel of its own that reads the BF16 gradient and writes it again in FP32: 85 M elements
a step, about 0.5 GB. cuBLAS can write a BF16 matmul's FP32 accumulator as it is (``torch.mm(a, b,
out_dtype=torch.float32)``, CUDA only), with no cast after it. This sets an Inductor post-grad pass for the run
that, in a backward graph (one with tangents), replaces ``convert_element_type(mm(a, b), float32)`` by that matmul
where the cast's only user is the graph's output (a gradient the graph returns) and the matmul's only user is the
cast. The gradient then skips one rounding to BF16: the same sum, rounded once instead of twice. Activation
gradients keep BF16 (their casts are fused into the kernels that read them). It logs how many it replaced.
"""

import os
import runpy
import sys

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten, prims = torch.ops.aten, torch.ops.prims
HALF = (torch.bfloat16, torch.float16)


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def fp32_weight_grads(graph: fx.Graph, devices=("cuda",)) -> int:
    """Rewrite ``graph`` in place as the module says; the number of matmuls rewritten."""
    if not any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
        return 0  # a forward graph: its outputs are what the model computes, left as they are
    output = graph.output_node()
    done = 0
    for cast in list(graph.nodes):
        if cast.op != "call_function" or cast.target is not prims.convert_element_type.default:
            continue
        mm = cast.args[0]
        if cast.args[1] is not torch.float32 or not isinstance(mm, fx.Node) or mm.target is not aten.mm.default:
            continue
        a, b = mm.args
        va, vb = _val(a), _val(b)
        if va is None or vb is None or va.dtype not in HALF or vb.dtype != va.dtype or va.device.type not in devices:
            continue
        if set(cast.users) != {output} or set(mm.users) != {cast}:
            continue
        with graph.inserting_before(cast):
            fused = graph.call_function(aten.mm.dtype, (a, b, torch.float32))
        fused.meta = dict(cast.meta)
        cast.replace_all_uses_with(fused)
        graph.erase_node(cast)
        graph.erase_node(mm)
        done += 1
    if done:
        print(f"fp32_weight_grads: {done} gradients written in FP32 by their matmul", file=sys.stderr, flush=True)
    return done


class FP32WeightGrads(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        fp32_weight_grads(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((os.path.abspath(__file__),))


if __name__ == "__main__":
    # Imported under its own name, not as runpy's __main__ (which becomes the recipe's): Inductor's cache keys on the
    # pass's uuid and pickles nothing of it, but the pass must outlive the replacement of __main__.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fp32_weight_grads as this

    torch._inductor.config.post_grad_custom_post_pass = this.FP32WeightGrads()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
