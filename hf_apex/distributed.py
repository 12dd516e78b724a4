"""Rank, world size and the few collectives hf_apex needs: the one place that asks ``torch.distributed``.

Every collective here is called by all ranks at the same point of the training loop (a logging step, the end of
training, optimizer creation); nothing is called from ``Trainer.log``, which user code may call on one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _comm_device() -> torch.device:
    """Where collective tensors must live: the current GPU for NCCL, the CPU for gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``tensor`` reduced over the ranks (``"sum"`` or ``"max"``); the tensor itself when not distributed."""
    if not is_distributed():
        return tensor
    out = tensor.to(_comm_device())
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return out.to(tensor.device)


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank (a pickled broadcast: for rare, small decisions only)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
