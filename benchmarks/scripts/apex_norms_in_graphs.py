"""Run a recipe compiled, with an eager stage's switches and hf_apex's swapped norms calling apex's own traceable entry
point inside the graphs: an experiment, not hf_apex's path (which runs the stock op under torch.compile, for Inductor
to fuse).

usage: STAGE_SWITCHES=<stage> python benchmarks/scripts/apex_norms_in_graphs.py SCRIPT [flags...]
       (SCRIPT: e.g. recipes/finetune.py; or WRAPPER=benchmarks/scripts/apex_norms_in_graphs.py with run_variant.py)

The recipe's `--stage` is replaced by the switches of STAGE_SWITCHES (e.g. `fused_full`: apex FusedAdam, apex's norms,
BF16) with `torch_compile` on; pass `--torch_compile_backend cudagraphs` to replay the traced kernels under CUDA
graphs without Inductor. A swapped LayerNorm or RMSNorm then calls apex's `torch.library` custom op
(`apex::fused_layer_norm_affine_fwd` or `apex::fused_rms_norm_affine_fwd`), after the cast to the autocast dtype that
hf_apex's eager path makes, where it would run the stock op. With apex's dispatch cost off the host (the graphs replay
it), this asks what apex's norms buy on a step that no longer waits on the host (BERT-base 128 x 128 on an H200: eager
`fused_full` reached a device floor of ~30 ms, against `torch_fused`'s ~35 ms, and ran at 40-50 ms)."""

import os
import runpy
import sys

import torch
from apex.normalization.fused_layer_norm import fused_layer_norm_affine_fwd, fused_rms_norm_affine_fwd

from hf_apex import STAGES
from hf_apex.kernels import norms


def stage_flags(name: str) -> list[str]:
    """The command-line switches of stage ``name``, with torch_compile on."""
    settings = STAGES[name].settings() | {"torch_compile": True}
    return [arg for key, value in settings.items() if value is not None for arg in (f"--{key}", str(value))]


def without_stage(argv: list[str]) -> list[str]:
    if "--stage" not in argv:
        return argv
    i = argv.index("--stage")
    return argv[:i] + argv[i + 2 :]


_stock_forward = norms._ApexNorm.forward


def forward(self, x):
    if not torch.compiler.is_compiling():
        return _stock_forward(self, x)
    if self.hf_apex_component == "layer_norm" and getattr(self, "weight", None) is not None:
        op, tensors, rest = fused_layer_norm_affine_fwd, (x, self.weight, self.bias), (self.eps,)
        shape = list(self.normalized_shape)
    elif self.hf_apex_component == "rms_norm":
        op, tensors, rest = fused_rms_norm_affine_fwd, (x, self.weight), (norms.rms_norm_eps(self),)
        shape = list(self.weight.shape)
    else:
        return _stock_forward(self, x)
    # apex's semantics, as hf_apex's eager path has them: under autocast, input, weight and bias in its dtype
    if torch.is_autocast_enabled("cuda"):
        tensors = tuple(t.to(torch.get_autocast_dtype("cuda")) for t in tensors)
    with torch.autocast("cuda", enabled=False):
        return op(*tensors, shape, *rest)[0]


if __name__ == "__main__":
    # runpy hands `__main__` to the recipe, and Dynamo's guards look this function's globals up by module name:
    # take it from this file imported under its own name
    import apex_norms_in_graphs

    norms._ApexNorm.forward = apex_norms_in_graphs.forward
    script, *argv = sys.argv[1:]
    sys.argv = [script, *without_stage(argv), *stage_flags(os.environ.get("STAGE_SWITCHES", "fused_full"))]
    print(f"apex_norms_in_graphs: {' '.join(sys.argv[1:])}", flush=True)
    runpy.run_path(script, run_name="__main__")
