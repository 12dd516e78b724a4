"""hf_apex.kernels.swap: the one class swap behind the fused norms, the loss without logits and RoPE computed once:
per instance, reversible, shown by print, pickled as the stock class swapped."""

import pickle

import torch
from torch import nn

from hf_apex.kernels import swap


class Doubling(swap.Swap):
    def forward(self, x):
        return 2 * super().forward(x)

    def extra_repr(self) -> str:
        return "doubled (a test's mixin)"


class Named(swap.Swap):
    @classmethod
    def swap_members(cls, stock_cls):
        return {"__module__": __name__, "__qualname__": "Renamed", "__name__": "Renamed"}


def test_a_swap_changes_one_instance_and_is_undone():
    torch.manual_seed(0)
    a, b, x = nn.Linear(3, 3), nn.Linear(3, 3), torch.randn(2, 3)
    expected = a(x)
    assert swap.swap(a, Doubling) and not swap.swap(a, Doubling)  # (once)
    assert isinstance(a, nn.Linear) and type(a).__name__ == "Linear" and type(b) is nn.Linear
    assert torch.equal(a(x), 2 * expected) and "doubled" in repr(a)
    assert swap.stock_class(a) is nn.Linear and swap.stock_class(b) is None
    assert swap.stock_class(a, Named) is None  # another mixin's swap is not this one
    assert not swap.restore(a, Named) and swap.restore(a, Doubling) and type(a) is nn.Linear
    assert torch.equal(a(x), expected) and not swap.restore(a)


def test_one_class_per_pair_and_the_mixins_naming():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    swap.swap(a, Doubling)
    swap.swap(b, Doubling)
    assert type(a) is type(b) is swap.swapped_class(Doubling, nn.Linear)
    assert type(a).hf_apex_swap == (Doubling, nn.Linear)
    assert swap.swapped_class(Named, nn.Linear).__name__ == "Renamed"


def test_a_swapped_instance_pickles_as_the_stock_class_swapped():
    torch.manual_seed(0)
    a, x = nn.Linear(3, 3), torch.randn(2, 3)
    swap.swap(a, Doubling)
    b = pickle.loads(pickle.dumps(a))
    assert type(b) is type(a) and torch.equal(b(x), a(x))
    assert swap.restore(b) and type(b) is nn.Linear


def test_a_wrapper_that_subclassed_the_swapped_class_is_left_to_undo_itself():
    a = nn.Linear(2, 2)
    swap.swap(a, Doubling)
    wrapper = type("Wrapped", (type(a),), {})  # as FSDP2 subclasses a module's class
    a.__class__ = wrapper
    assert swap.stock_class(a) is nn.Linear  # still known
    assert not swap.restore(a) and type(a) is wrapper
