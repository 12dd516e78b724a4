"""One instance's class swapped for its stock class with hf_apex's behaviour mixed in first: the mechanism behind the
fused norms, the loss without logits and RoPE computed once.

The swap is per instance (other instances of the class, and the class itself, are untouched), reversible
(:func:`restore`), and ``print(model)`` shows it (each mixin's ``extra_repr``). A swapped instance pickles as "this
stock class, swapped": it loads wherever hf_apex imports, whatever the swapped class is called, and the loading
process rebuilds the same class. ``isinstance(module, StockClass)`` holds throughout.
"""

from __future__ import annotations

import functools

from torch import nn


class Swap:
    """Base of a mixin that :func:`swap` puts before an instance's class."""

    @classmethod
    def swap_members(cls, stock_cls: type) -> dict:
        """Members of the swapped class beyond the mixin's own (its name and module: the stock class's, by
        default)."""
        return {"__module__": stock_cls.__module__, "__qualname__": stock_cls.__qualname__, "__name__": None}

    def swap_state(self) -> dict:
        """What a pickle of the swapped instance holds (the stock state, by default)."""
        return self.__getstate__()

    def __reduce_ex__(self, protocol):
        mixin, stock_cls = type(self).hf_apex_swap
        return _rebuild, (mixin, stock_cls), self.swap_state()


@functools.cache
def swapped_class(mixin: type[Swap], stock_cls: type) -> type:
    """``stock_cls`` with ``mixin`` first: one class per pair, which records both (``hf_apex_swap``)."""
    members = mixin.swap_members(stock_cls)
    name = members.pop("__name__", None) or stock_cls.__name__
    return type(name, (mixin, stock_cls), {**members, "hf_apex_swap": (mixin, stock_cls)})


def _rebuild(mixin: type[Swap], stock_cls: type) -> nn.Module:
    return object.__new__(swapped_class(mixin, stock_cls))


def stock_class(obj, mixin: type[Swap] = Swap) -> type | None:
    """The class ``obj`` (an instance or a class) had before :func:`swap` mixed ``mixin`` in; None where it has no
    such swap. A wrapper that subclassed the swapped class since (FSDP2's) comes before it and is not this."""
    cls = obj if isinstance(obj, type) else type(obj)
    swapped = getattr(cls, "hf_apex_swap", None)
    return swapped[1] if swapped is not None and issubclass(swapped[0], mixin) else None


def swap(module: nn.Module, mixin: type[Swap]) -> bool:
    """Mix ``mixin`` into ``module``'s class; False (nothing done) where it has it already."""
    if isinstance(module, mixin):
        return False
    module.__class__ = swapped_class(mixin, type(module))
    return True


def restore(module: nn.Module, mixin: type[Swap] = Swap) -> bool:
    """Give ``module`` its stock class back; False (nothing done) where it has no such swap, or where a wrapper
    (FSDP2's) has subclassed the swapped class since, which only that wrapper could undo."""
    stock = stock_class(module, mixin)
    if stock is None or "hf_apex_swap" not in vars(type(module)):
        return False
    module.__class__ = stock
    return True
