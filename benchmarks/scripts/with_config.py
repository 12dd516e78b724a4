"""Run a recipe with torch.compile's settings changed for the run: an experiment, not hf_apex's path.

usage: TORCH_CONFIG="<module>.<name>=<value>;..." python benchmarks/scripts/with_config.py SCRIPT [flags...]
       (SCRIPT: e.g. recipes/finetune.py; or WRAPPER=benchmarks/scripts/with_config.py with run_variant.py)

Each setting names a config module of torch and one of its fields, e.g.
`torch._functorch.config.activation_memory_budget=0.5` (the compiler recomputes activations in the backward until
the saved ones fit that fraction of what it would save otherwise: less memory for more compute, the same maths) or
`torch._inductor.config.coordinate_descent_tuning=True`. Values are Python literals. An unknown module or field is
an error before the recipe starts, so a typo cannot pass for a measurement.
"""

import ast
import importlib
import os
import runpy
import sys


def apply(spec: str) -> dict[str, object]:
    """Set each ``module.field=value`` of ``spec`` (separated by ';'); returns what was set."""
    done = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        target, _, value = item.partition("=")
        module_name, _, field = target.strip().rpartition(".")
        module = importlib.import_module(module_name)
        if not hasattr(module, field):
            raise SystemExit(f"with_config: {module_name} has no setting {field!r}")
        setattr(module, field, ast.literal_eval(value.strip()))
        done[target.strip()] = getattr(module, field)
    return done


if __name__ == "__main__":
    print(f"with_config: {apply(os.environ.get('TORCH_CONFIG', ''))}", flush=True)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
