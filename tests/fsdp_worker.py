"""Run by tests/test_fsdp.py and tests/gpu/test_fsdp_gpu.py under torchrun (or alone, the unsharded reference):
train a tiny GPT-2 with apex's FusedAdam (its torch fallback on CPU), FSDP2-sharded when there are several
processes; dump the full parameters and optimizer state.

torchrun --nproc_per_node 2 tests/fsdp_worker.py OUT_DIR        # CPU, gloo
HF_APEX_TEST_CUDA=1 torchrun --nproc_per_node 2 tests/fsdp_worker.py OUT_DIR   # one GPU per process, NCCL, apex
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_apex import rewire  # noqa: E402
from hf_apex.kernels.apex.optim import FusedAdamFallback  # noqa: E402
from tests.testing_utils import VOCAB, leave_worker, tiny_model  # noqa: E402

GLOBAL_BATCH, SEQ, STEPS = 4, 16, 3
CUDA = os.environ.get("HF_APEX_TEST_CUDA") == "1"


class Recording(FusedAdamFallback):
    """Records the kinds of tensor the update itself sees."""

    seen: set = set()

    def _step(self, closure=None):
        Recording.seen |= {type(p).__name__ for g in self.param_groups for p in g["params"]}
        return super()._step(closure)


def build(world: int):
    model = tiny_model("gpt2").train().to("cuda" if CUDA else "cpu")
    rewire(model)  # apex norms (torch fallbacks on CPU) under FSDP2: they see unsharded weights in forward
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    # eps well above rounding noise: the key bias has a zero gradient in exact arithmetic, and Adam would turn
    # its noise (which differs with the reduction order) into full-size steps
    if CUDA:
        from hf_apex.kernels.apex.optim import apex_optimizer_class

        return model, apex_optimizer_class("fused_adam")(groups, lr=1e-2, eps=1e-4)
    return model, Recording(groups, lr=1e-2, eps=1e-4)


def train(model, opt, steps, rank: int, world: int) -> None:
    data = torch.randint(3, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    per_rank = GLOBAL_BATCH // world
    for step in steps:
        ids = data[step, rank * per_rank : (rank + 1) * per_rank].to(next(model.parameters()).device)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def summary(model, opt) -> dict:
    from torch.distributed.tensor import DTensor

    names = {p: n for n, p in model.named_parameters()}
    return {
        "params": {n: full(p).detach().clone() for n, p in model.named_parameters()},
        "state": {
            names[p]: {k: full(v).clone() for k, v in s.items() if torch.is_tensor(v)} for p, s in opt.state.items()
        },
        "sharded_state": all(isinstance(v, DTensor) for s in opt.state.values() for v in s.values() if v.dim() > 0),
        "steps": [g["step"] for g in opt.param_groups],
        "route": (opt.hf_apex_route.backend, opt.hf_apex_route.calls),
    }


def autotune_optimizer(model) -> dict:
    """auto's optimizer timing on the sharded model (rank 0 times alone: no collective may run in it)."""
    from hf_apex import autotune
    from hf_apex.kernels.apex import optim

    if not CUDA:
        optim.apex_optimizer_class = lambda name: FusedAdamFallback  # apex's kernel stand-in on CPU
    tuner = autotune.Autotuner(autotune.DecisionCache(os.devnull + ".dir"), timer=lambda fn, budget_s: fn() or 1.0)
    kwargs = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    tuner.choose_optimizer(model, kwargs, blocked=None)
    return tuner.report()[0]


def main(out_dir: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # strict FP32
    if world > 1:
        dist.init_process_group("nccl" if CUDA else "gloo")
        rank = dist.get_rank()
    model, opt = build(world)
    train(model, opt, range(STEPS), rank, world)
    result = summary(model, opt) | {"seen": sorted(Recording.seen), "autotune": autotune_optimizer(model)}
    if world > 1:  # save after 2 steps the way accelerate saves FSDP2 runs, resume in fresh objects, take step 3
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        model, opt = build(world)
        train(model, opt, range(STEPS - 1), rank, world)
        saved = (get_model_state_dict(model), get_optimizer_state_dict(model, opt))
        model, opt = build(world)
        set_model_state_dict(model, saved[0])
        set_optimizer_state_dict(model, opt, saved[1])
        train(model, opt, range(STEPS - 1, STEPS), rank, world)
        result["resumed"] = summary(model, opt)
    if rank == 0:
        torch.save(result, Path(out_dir) / "result.pt")
    if world > 1:
        dist.barrier()  # no rank tears gloo down while another still has work in flight
        dist.destroy_process_group()
    leave_worker()


if __name__ == "__main__":
    Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
    main(sys.argv[1])
