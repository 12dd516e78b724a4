"""The autograd functions over apex's extension: right values, right gradients, apex's autocast semantics (input,
weight and bias cast to the autocast dtype, output in it, gradients back in the parameters' dtypes). Checked on
CPU with a stand-in for `fused_layer_norm_cuda` built from torch's own ops; tests/gpu/ runs the real kernels."""

import pytest
import torch
import torch.nn.functional as F

from hf_apex import rewire
from hf_apex.kernels import trace
from hf_apex.kernels.apex import norms


class TorchExtension:
    """The calls hf_apex makes into `fused_layer_norm_cuda`, computed with torch's ops."""

    @staticmethod
    def forward_affine(x, shape, w, b, eps):
        return torch.native_layer_norm(x, shape, w, b, eps)

    @staticmethod
    def backward_affine(dy, mean, invvar, x, shape, w, b, eps, memory_efficient):
        return torch.ops.aten.native_layer_norm_backward(dy, x, shape, mean, invvar, w, b, [True, True, True])

    @staticmethod
    def forward(x, shape, eps):
        return torch.native_layer_norm(x, shape, None, None, eps)

    @staticmethod
    def backward(dy, mean, invvar, x, shape, eps, memory_efficient):
        return torch.ops.aten.native_layer_norm_backward(dy, x, shape, mean, invvar, None, None, [True, False, False])[
            0
        ]

    @staticmethod
    def rms_forward_affine(x, shape, w, eps):
        invvar = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return (x.float() * invvar).to(x.dtype) * w, invvar

    @staticmethod
    def rms_backward_affine(dy, invvar, x, shape, w, eps, memory_efficient):
        x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        with torch.enable_grad():
            y = TorchExtension.rms_forward_affine(x, shape, w, eps)[0]
        return torch.autograd.grad(y, [x, w], dy)


@pytest.fixture
def torch_extension(monkeypatch):
    monkeypatch.setattr(norms, "_ext", TorchExtension)


def _reference(fn, x, params, amp, dy):
    x = x.detach().clone().requires_grad_(True)
    params = [p.detach().clone().requires_grad_(True) for p in params]
    cast = [t.to(amp) if amp else t for t in (x, *params)]
    y = fn(*cast)
    y.backward(dy.to(y.dtype))
    return y.detach(), [x.grad, *(p.grad for p in params)]


def _ours(apply, x, params, amp, dy):
    x = x.detach().clone().requires_grad_(True)
    params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    y = apply(x, *params, amp)
    y.backward(dy.to(y.dtype))
    return y.detach(), [x.grad, *(p.grad for p in params)]


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("kind", ["layer_norm", "layer_norm_weightless", "rms_norm"])
def test_functions_compute_the_norm_and_its_gradients(torch_extension, kind, amp):
    torch.manual_seed(0)
    hidden, eps = 64, 1e-5
    x, dy = torch.randn(4, 8, hidden) * 2 + 1, torch.randn(4, 8, hidden)
    w, b = torch.randn(hidden) * 0.2 + 1, torch.randn(hidden) * 0.2
    if kind == "layer_norm":
        params = [w, b]
        ref = lambda x, w, b: F.layer_norm(x, (hidden,), w, b, eps)  # noqa: E731
        apply = lambda x, w, b, amp: norms._LayerNormAffine.apply(x, w, b, (hidden,), eps, amp)  # noqa: E731
    elif kind == "layer_norm_weightless":
        params = []
        ref = lambda x: F.layer_norm(x, (hidden,), eps=eps)  # noqa: E731
        apply = lambda x, amp: norms._LayerNorm.apply(x, (hidden,), eps, amp)  # noqa: E731
    else:
        params = [w]
        ref = lambda x, w: TorchExtension.rms_forward_affine(x, (hidden,), w, eps)[0]  # noqa: E731
        apply = lambda x, w, amp: norms._RMSNormAffine.apply(x, w, (hidden,), eps, amp)  # noqa: E731
    want_y, want_grads = _reference(ref, x, params, amp, dy)
    got_y, got_grads = _ours(apply, x, params, amp, dy)
    assert got_y.dtype == (amp or torch.float32)  # apex's semantics: the norm runs in the autocast dtype
    torch.testing.assert_close(got_y, want_y, rtol=0, atol=0)
    for got, want in zip(got_grads, want_grads):
        assert got.dtype == torch.float32  # gradients come back in the dtypes of the input and the parameters
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0)


def test_a_swapped_model_routes_to_the_kernel_once_per_input_kind(torch_extension, monkeypatch):
    monkeypatch.setattr(norms, "blocker", lambda component, device=None: None)  # as if on a GPU with apex
    monkeypatch.setattr(norms, "_load_extension", lambda: None)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.LayerNorm(16))
    x = torch.randn(4, 8)
    want = model(x)
    rewire(model)
    for _ in range(3):
        got = model(x)
    torch.testing.assert_close(got, want)
    routes = model[1].hf_apex_routes
    assert list(routes) == [("cpu", torch.float32, None, True)] and routes[next(iter(routes))].calls == 3
    assert trace.calls_since(trace.collect(model), {})["layer_norm"] == {
        "apex": 6,
        "fallback": 0,
        "fallback_reasons": {},
    }
    assert repr(model[1]).endswith("kernel=apex)")


class WideEpsLayerNorm(torch.nn.Module):
    """A weightless LayerNorm whose forward hard-codes another eps than OLMo's."""

    def __init__(self, hidden):
        super().__init__()
        self.normalized_shape = (hidden,)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, eps=1e-2)


def test_a_weightless_norm_runs_the_kernel_with_the_eps_its_class_hard_codes(torch_extension, monkeypatch):
    # the one home of a weightless norm's eps: surgery checks it, the kernel uses it
    monkeypatch.setitem(norms.WEIGHTLESS_LAYER_NORMS, "WideEpsLayerNorm", 1e-2)
    monkeypatch.setattr(norms, "blocker", lambda component, device=None: None)  # as if on a GPU with apex
    monkeypatch.setattr(norms, "_load_extension", lambda: None)
    model = torch.nn.Sequential(WideEpsLayerNorm(16))
    x = torch.randn(4, 16) * 0.05  # a variance of the order of eps: the eps shows
    want = model(x)
    assert rewire(model).num_swapped == 1
    torch.testing.assert_close(model(x), want)
    assert next(iter(model[0].hf_apex_routes.values())).backend == trace.APEX


# Stand-ins for apex's torch.library norm ops (`apex.normalization.fused_layer_norm`), computed with torch's ops and
# counting their calls: a graph holds an op as apex's, opaque to the compiler.
GRAPH_OP_CALLS = {"layer_norm": 0, "rms_norm": 0}


@torch.library.custom_op("hf_apex_test::layer_norm_affine_fwd", mutates_args=())
def _layer_norm_affine_fwd(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, shape: list[int], eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    GRAPH_OP_CALLS["layer_norm"] += 1
    return torch.native_layer_norm(x, shape, w, b, eps)


@_layer_norm_affine_fwd.register_fake
def _(x, w, b, shape, eps):
    return torch.native_layer_norm(x, shape, w, b, eps)


def _layer_norm_context(ctx, inputs, output):
    x, w, b, shape, _ = inputs
    ctx.save_for_backward(x, w, b, output[1], output[2])
    ctx.shape = shape


def _layer_norm_backward(ctx, dy, *_):
    x, w, b, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy, x, ctx.shape, mean, rstd, w, b, [True, True, True])
    return dx, dw, db, None, None


_layer_norm_affine_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_context)


@torch.library.custom_op("hf_apex_test::rms_norm_affine_fwd", mutates_args=())
def _rms_norm_affine_fwd(
    x: torch.Tensor, w: torch.Tensor, shape: list[int], eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    GRAPH_OP_CALLS["rms_norm"] += 1
    return TorchExtension.rms_forward_affine(x, shape, w, eps)


@_rms_norm_affine_fwd.register_fake
def _(x, w, shape, eps):
    return torch.empty_like(x), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


def _rms_norm_context(ctx, inputs, output):
    x, w, shape, eps = inputs
    ctx.save_for_backward(x, w, output[1])
    ctx.shape, ctx.eps = shape, eps


def _rms_norm_backward(ctx, dy, _):
    x, w, invvar = ctx.saved_tensors
    dx, dw = TorchExtension.rms_backward_affine(dy, invvar, x, ctx.shape, w, ctx.eps, False)
    return dx, dw, None, None


_rms_norm_affine_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_context)


class GraphOps:
    fused_layer_norm_affine_fwd = _layer_norm_affine_fwd
    fused_rms_norm_affine_fwd = _rms_norm_affine_fwd


@pytest.mark.parametrize("graph_kernel", ["apex", "torch"])
def test_inside_a_graph_a_swapped_norm_runs_the_kernel_it_was_given(monkeypatch, graph_kernel):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hf_apex.kernels.models import surgery

    monkeypatch.setattr(norms, "_ops", GraphOps)
    monkeypatch.setattr(norms, "APEX_DEVICE_TYPES", ("cuda", "cpu"))  # the stand-ins run on the CPU
    for module in (surgery, norms):
        monkeypatch.setattr(module, "blocker", lambda component, device=None: None)  # as if on a GPU with apex
    monkeypatch.setattr(surgery, "load_graph_ops", lambda: None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), LlamaRMSNorm(16))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5), model[1].bias.uniform_(-0.5, 0.5), model[3].weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 8)

    def step(m):
        model.zero_grad()
        out = m(x)
        out.pow(2).sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    want, want_grads = step(model)
    rewire(model, compiled=True, graph_kernel=graph_kernel)
    assert {m.hf_apex_graph_kernel for m in model if norms.is_swapped(m)} == {graph_kernel}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # fullgraph: the op breaks no graph
    GRAPH_OP_CALLS.update(layer_norm=0, rms_norm=0)
    got, got_grads = step(compiled)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)
    ran = 1 if graph_kernel == "apex" else 0
    assert GRAPH_OP_CALLS == {"layer_norm": ran, "rms_norm": ran}
    said = "apex, inside CUDA graphs" if graph_kernel == "apex" else "stock op inside torch.compile"
    assert f"kernel={said}" in repr(model[1])


def test_apex_inside_graphs_only_where_its_kernel_runs():
    model = torch.nn.Sequential(torch.nn.LayerNorm(16))
    with pytest.raises(ValueError, match="graph_kernel must be"):
        rewire(model, graph_kernel="triton")
    rewire(model, compiled=True, graph_kernel="apex")  # on this machine apex's kernel cannot run: the stock op
    assert model[0].hf_apex_graph_kernel == "torch" and "torch fallback" in repr(model[0])


def test_inside_a_graph_apex_gives_way_where_it_cannot_run_and_is_not_pickled(monkeypatch):
    import pickle

    from hf_apex.kernels.models import surgery

    monkeypatch.setattr(norms, "_ops", GraphOps)
    for module in (surgery, norms):
        monkeypatch.setattr(module, "blocker", lambda component, device=None: None)  # as if on a GPU with apex
    monkeypatch.setattr(surgery, "load_graph_ops", lambda: None)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    x = torch.randn(4, 8)
    want = model(x)
    rewire(model, compiled=True, graph_kernel="apex")
    assert model[1].hf_apex_graph_kernel == "apex"
    # CPU tensors (apex's ops need CUDA ones): the stock op, or an error under strict kernels
    torch._dynamo.reset()
    GRAPH_OP_CALLS.update(layer_norm=0, rms_norm=0)
    torch.testing.assert_close(torch.compile(model, backend="aot_eager", fullgraph=True)(x), want)
    assert GRAPH_OP_CALLS["layer_norm"] == 0
    rewire(model, compiled=True, graph_kernel="apex", strict_kernels=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="apex_strict_kernels is on .* cannot run inside the graph \\(cpu tensors\\)"):
        torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    # Another process decides for itself: the loaded module puts the stock op in its graphs until rewired
    loaded = pickle.loads(pickle.dumps(model))
    assert norms.is_swapped(loaded[1]) and loaded[1].hf_apex_graph_kernel == "torch"
    surgery.unrewire(model)
    assert "hf_apex_graph_kernel" not in vars(model[1]) and not norms.is_swapped(model[1])


def test_without_apex_s_python_ops_the_graphs_keep_the_stock_op(monkeypatch, caplog):
    import sys
    import types

    from hf_apex.kernels.models import surgery

    monkeypatch.setattr(surgery, "blocker", lambda component, device=None: None)  # apex's kernel runs, but
    monkeypatch.setattr(norms, "_ops", None)
    for module, said in (
        (None, "apex.normalization does not import (ModuleNotFoundError"),  # (None in sys.modules: not importable)
        (types.ModuleType("fused_layer_norm"), "this apex has no torch.library norm ops (fused_layer_norm_affine_fwd"),
    ):
        monkeypatch.setitem(sys.modules, "apex.normalization.fused_layer_norm", module)
        surgery._warn_no_graph_ops.cache_clear()  # (said once per process)
        model = torch.nn.Sequential(torch.nn.LayerNorm(16))
        with caplog.at_level("WARNING", logger="hf_apex"):
            rewire(model, compiled=True, graph_kernel="apex")
        assert model[0].hf_apex_graph_kernel == "torch" and norms._ops is None
        assert f"run the stock op inside CUDA graphs, not apex's: {said}" in caplog.text
