"""Run by tests/test_fsdp.py and tests/gpu/test_fsdp_gpu.py: ApexTrainer on a tiny GPT-2 for 4 optimizer steps at a
global batch of 4, the Trainer checkpointing every 2 steps; dumps the full parameters and a summary.

    python tests/sharded_worker.py OUT_DIR single STAGE                                 # one process: the reference
    torchrun --nproc_per_node 2 tests/sharded_worker.py OUT_DIR ddp STAGE [CHECKPOINT]  # DDP (each rank dumps)
    torchrun --nproc_per_node 2 tests/sharded_worker.py OUT_DIR fsdp2 STAGE [CHECKPOINT]  # FSDP2 (GPUs only)

A CHECKPOINT resumes from it. CPU (gloo, apex's torch fallbacks) unless HF_APEX_TEST_CUDA=1 (one GPU per process,
NCCL, apex's kernels). accelerate shards with FSDP on accelerators only: on the CPU the fsdp2 mode runs DDP.
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_apex import ApexTrainer, ApexTrainingArguments  # noqa: E402
from tests.testing_utils import TokenDataset, leave_worker, tiny_model  # noqa: E402

GLOBAL_BATCH, STEPS, SAVE_EVERY = 4, 4, 2
CUDA = os.environ.get("HF_APEX_TEST_CUDA") == "1"


def main(out_dir: str, mode: str, stage: str, resume: str | None = None) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sharding = {}
    if mode == "fsdp2":
        sharding = {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}}
    args = ApexTrainingArguments(
        output_dir=out_dir,
        stage=stage,
        use_cpu=not CUDA,
        report_to="none",
        max_steps=STEPS,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_EVERY,
        learning_rate=1e-3,
        weight_decay=0.1,
        # The attention's key bias has a zero gradient in exact arithmetic (softmax ignores a shift), so what it
        # gets is rounding noise, which differs with the reduction order; Adam would scale that noise to full
        # steps. An eps well above it keeps those steps negligible, and the comparison about the real gradients.
        adam_epsilon=1e-4,
        metrics_warmup_steps=1,
        disable_tqdm=True,
        seed=0,
        ddp_backend=None if CUDA or world == 1 else "gloo",
        **sharding,
    )
    model = tiny_model("gpt2").train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    trainer = ApexTrainer(model=model, args=args, train_dataset=TokenDataset(n=64))
    trainer.train(resume_from_checkpoint=resume)

    from torch.distributed.tensor import DTensor

    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        for n, p in trainer.model.named_parameters()
    }
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    summary = {
        "optimizer": type(optimizer).__name__,
        "route": [optimizer.hf_apex_route.backend, optimizer.hf_apex_route.calls],
        "sharded_params": any(isinstance(p, DTensor) for p in trainer.model.parameters()),
        "sharded_state": bool(state) and all(isinstance(v, DTensor) for v in state),
        "global_step": trainer.state.global_step,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
    suffix = "-resumed" if resume else ""
    rank = args.process_index
    if mode == "ddp" or rank == 0:
        torch.save(params, Path(out_dir) / f"params{suffix}-rank{rank}.pt")
    if rank == 0:
        (Path(out_dir) / f"summary{suffix}.json").write_text(json.dumps(summary, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    leave_worker()


if __name__ == "__main__":
    main(*sys.argv[1:])
