"""Linears that read the same input, run as one matmul under ``torch.compile``.

BERT's self-attention computes its query, key and value with three ``nn.Linear`` on the same hidden states; a Llama
its q, k and v projections, and in its MLP the gate and up projections. Each is a matmul of its own, forward and
backward, and at BERT-base's width (768 x 768 weights) each is small for the GPU's tensor cores.

:class:`FuseSharedInputLinears` is an Inductor pre-grad pass (Inductor's ``pre_grad_custom_pass``). In
the graph Dynamo traced, before AOTAutograd derives the backward from it, it replaces each group of linears on one
input by one linear on their weights (and biases) concatenated, whose output it splits back along the last dimension.
The backward then computes the input's gradient in one matmul and the concatenated weight's gradient in one, whose
row blocks are the weights' gradients. Every output element is the same dot product; only the matmuls' shapes change,
and cuBLAS's choice of tiles with them. The modules, their parameters and the state dict are untouched, and eager
forwards are the stock ones.

A group is left alone where fusing could change what runs: linears on either side of an autocast or no-grad
boundary, weights of other dtypes or devices, or one of them frozen and another trained (a LoRA adapter beside its
base layer), some with a bias and some without, an output that is modified in place or viewed in a way the split
output cannot be.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch import fx

from ...internals import ATEN_LINEAR, custom_graph_pass, dynamo_counters, is_fake_tensor, op_schema

CustomGraphPass, get_hash_for_files = custom_graph_pass()
LINEAR = (ATEN_LINEAR, torch.nn.functional.linear)
COUNTER = "hf_apex_fused_projections"  # in dynamo_counters()["inductor"]: groups fused


def _linear_args(node: fx.Node) -> tuple:
    args, kwargs = node.args, node.kwargs
    names = ("input", "weight", "bias")
    return tuple(args[i] if len(args) > i else kwargs.get(name) for i, name in enumerate(names))


def _value(node):
    """The fake tensor Dynamo traced for ``node`` (None for anything else)."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if is_fake_tensor(value) else None


def _modified_in_place(node: fx.Node) -> bool:
    for user in node.users:
        if user.op == "call_method" and user.target.endswith("_") and not user.target.startswith("__"):
            return True
        schema = op_schema(user.target)
        if user.op == "call_function" and schema is not None and schema.is_mutable:
            return True
    return False


def _views_hold(node: fx.Node, value: torch.Tensor) -> bool:
    """Whether each ``.view(...)`` of ``node``'s output is legal on ``value`` (a slice of the fused output, whose rows
    are strided)."""
    for user in node.users:
        if (user.op, user.target) not in (("call_method", "view"), ("call_function", torch.Tensor.view)):
            continue
        try:
            with value.fake_mode:
                value.view(*fx.node.map_arg(user.args[1:], _value), **fx.node.map_arg(user.kwargs, _value))
        except Exception:
            return False
    return True


def _groups(graph: fx.Graph) -> tuple[dict, list[list[fx.Node]]]:
    """Each node's position, and the linears that read one input node between two global-state changes (autocast,
    grad mode and other calls Dynamo traced without a value), in graph order."""
    order, groups, region = {}, defaultdict(list), 0
    for i, node in enumerate(graph.nodes):
        order[node] = i
        if node.op != "call_function":
            continue
        if node.target in LINEAR:
            x, w, _ = _linear_args(node)
            if isinstance(x, fx.Node) and isinstance(w, fx.Node):
                groups[(x, region)].append(node)
        elif node.target is not operator.getitem and node.meta.get("example_value") is None:
            region += 1
    return order, [g for g in groups.values() if len(g) > 1]


def _fusable(group: list[fx.Node], order: dict) -> bool:
    first = min(order[n] for n in group)
    weights = [_linear_args(n)[1] for n in group]
    biases = [_linear_args(n)[2] for n in group]
    values = [_value(w) for w in weights] + [_value(n) for n in group]
    if any(v is None for v in values) or any(_value(w).dim() != 2 for w in weights):
        return False
    if len({(v.dtype, v.device) for v in values[: len(weights)]}) != 1 or len({_value(n).dtype for n in group}) != 1:
        return False
    if len({_value(w).requires_grad for w in weights}) != 1:
        return False
    if len({b is None for b in biases}) != 1:  # some with a bias, some without
        return False
    kind = (_value(weights[0]).dtype, _value(weights[0]).device)
    if biases[0] is not None and any(_value(b) is None or (_value(b).dtype, _value(b).device) != kind for b in biases):
        return False
    operands = weights + [b for b in biases if b is not None]
    return all(order.get(p, len(order)) < first for p in operands) and not any(_modified_in_place(n) for n in group)


def _add(graph: fx.Graph, meta: dict, target, args: tuple, value) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta.update(meta, example_value=value)
    return node


def fuse_shared_input_linears(graph: fx.Graph) -> int:
    """Replace each fusable group of linears on one input by one linear and a split; returns how many groups."""
    order, groups = _groups(graph)
    fused = 0
    for group in groups:
        if not _fusable(group, order):
            continue
        weights = [_linear_args(n)[1] for n in group]
        biases = [_linear_args(n)[2] for n in group]
        sizes = [_value(w).shape[0] for w in weights]
        with _value(group[0]).fake_mode:
            out = torch.cat([_value(n) for n in group], dim=-1)
            parts = torch.split(out, sizes, dim=-1)
            weight = torch.cat([_value(w) for w in weights])
            bias = torch.cat([_value(b) for b in biases]) if biases[0] is not None else None
        if not all(_views_hold(n, part) for n, part in zip(group, parts)):
            continue
        first = min(group, key=order.__getitem__)
        meta = {k: v for k, v in first.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")}
        with graph.inserting_before(first):
            w = _add(graph, meta, torch.cat, (weights, 0), weight)
            b = _add(graph, meta, torch.cat, (biases, 0), bias) if bias is not None else None
            y = _add(graph, meta, ATEN_LINEAR, (_linear_args(first)[0], w, b), out)
            split = _add(graph, meta, torch.split, (y, sizes, -1), parts)
            outputs = [_add(graph, meta, operator.getitem, (split, i), part) for i, part in enumerate(parts)]
        for node, output in zip(group, outputs):
            node.replace_all_uses_with(output)
            graph.erase_node(node)
        fused += 1
    if fused:
        graph.lint()
        dynamo_counters()["inductor"][COUNTER] += fused
    return fused


class FuseSharedInputLinears(CustomGraphPass):
    """:func:`fuse_shared_input_linears` as Inductor's pre-grad pass. It holds no state, and its ``uuid`` (the hash of
    this file) keys Inductor's caches, so compiled graphs are reused across runs."""

    def __call__(self, graph: fx.Graph) -> None:
        fuse_shared_input_linears(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


FUSE_SHARED_INPUT_LINEARS = FuseSharedInputLinears()  # (stateless: one instance, equal to itself across runs)
