"""Run a recipe with torch.compile's settings changed for the run: an experiment, not hf_apex's path.

usage: TORCH_CONFIG="<module>.<name>=<value>;..." python benchmarks/scripts/with_config.py SCRIPT [flags...]
       (SCRIPT: e.g. recipes/finetune.py; or WRAPPER=benchmarks/scripts/with_config.py with run_variant.py)

Each setting names a config module of torch and one of its fields, e.g.
`torch._functorch.config.activation_memory_budget=0.5` (the compiler recomputes activations in the backward until
the saved ones fit that fraction of what it would save otherwise: less memory for more compute, the same maths) or
`torch._inductor.config.triton.cudagraph_trees=False`. Values are Python literals. An unknown module or field is
an error before the recipe starts, so a typo cannot pass for a measurement.
"""

import ast
import importlib
import os
import runpy
import sys


def _resolve(target: str) -> tuple[object, str]:
    """The object holding a setting ``a.b.c.field`` (a module, or a class inside one such as Inductor's
    ``config.triton``) and the field's name."""
    path, _, field = target.rpartition(".")
    parts = path.split(".")
    for i in range(len(parts), 0, -1):  # the longest prefix that imports, then attributes
        try:
            holder = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            holder = getattr(holder, name)
        return holder, field
    raise SystemExit(f"with_config: nothing to import in {target!r}")


def apply(spec: str) -> dict[str, object]:
    """Set each ``module.field=value`` of ``spec`` (separated by ';'); returns what was set."""
    done = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        target, _, value = (part.strip() for part in item.partition("="))
        holder, field = _resolve(target)
        if not hasattr(holder, field):
            raise SystemExit(f"with_config: {target.rpartition('.')[0]} has no setting {field!r}")
        setattr(holder, field, ast.literal_eval(value))
        done[target] = getattr(holder, field)
    return done


if __name__ == "__main__":
    print(f"with_config: {apply(os.environ.get('TORCH_CONFIG', ''))}", flush=True)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would have it
    runpy.run_path(script, run_name="__main__")
