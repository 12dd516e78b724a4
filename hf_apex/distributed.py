"""Rank, world size, the few collectives hf_apex needs, and the end of a process group: the one place that asks
``torch.distributed``.

Every collective here is called by all ranks at the same point of the training loop (a logging step, the end of
training, optimizer creation); nothing is called from ``Trainer.log``, which user code may call on one rank.
"""

from __future__ import annotations

import gc
import logging
import weakref

import torch
import torch.distributed as dist

logger = logging.getLogger("hf_apex")


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


def close_process_group() -> bool:
    """End this process's part of a distributed run: destroy the process group and free it, so that its threads
    are joined now, while the interpreter is whole. Call it once the trainer is out of reach (after the function
    that used it returned), as ``recipes/finetune.py`` does. Returns whether the group was freed.

    ``torch.distributed.destroy_process_group()`` only unregisters the group; whatever still holds it keeps it,
    and its gloo worker threads, alive until interpreter exit, where a worker still releasing the tensors of the
    last collective (an evaluation's gather) needs the GIL after finalization began and aborts the finished run
    ("terminate called without an active exception", SIGABRT). A ``Trainer`` holds its DDP wrapper, and through it
    the group, in reference cycles: collected first, the group's last reference goes with the unregistering.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return True
    gc.collect()
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    if group() is not None:
        logger.warning(
            "hf_apex: the process group is still referenced after destroy_process_group (a trainer or DDP model "
            "still in scope?): its threads run until interpreter exit."
        )
    return group() is None
