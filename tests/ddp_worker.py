"""Run by tests/test_ddp.py under torchrun (or alone): train a tiny GPT-2 a few steps, dump the final parameters.

torchrun --nproc_per_node 2 tests/ddp_worker.py OUT_DIR STAGE PER_DEVICE_BATCH [unused | unused-search | close]

`unused` adds a layer the loss never uses (hf_apex's DDP default does not search for it); `unused-search` adds it
and passes ddp_find_unused_parameters=True. `close` also evaluates (a gather is the last collective, as in
recipes/finetune.py), then ends as a script should: hf_apex.distributed.close_process_group() once the trainer is
out of reach, then the interpreter's own exit; close-rank{N}.json says whether the group was freed.
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_apex import ApexTrainer, ApexTrainingArguments  # noqa: E402
from hf_apex.distributed import close_process_group  # noqa: E402
from tests.testing_utils import TokenDataset, leave_worker, tiny_model  # noqa: E402


def main(out_dir: str, stage: str, batch: int, variant: str = "") -> None:
    search = {"ddp_find_unused_parameters": True} if variant == "unused-search" else {}
    args = ApexTrainingArguments(
        output_dir=out_dir,
        stage=stage,
        use_cpu=True,
        report_to="none",
        max_steps=5,
        per_device_train_batch_size=batch,
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-3,
        weight_decay=0.1,
        metrics_warmup_steps=1,
        disable_tqdm=True,
        seed=0,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        **search,
    )
    model = tiny_model("gpt2").train()
    model.config.dropout = 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    if variant.startswith("unused"):
        model.unused_head = torch.nn.Linear(4, 4)  # a parameter no step uses
    trainer = ApexTrainer(model=model, args=args, train_dataset=TokenDataset(n=64), eval_dataset=TokenDataset(n=8))
    trainer.train()
    if variant == "close":
        trainer.evaluate()
    if args.process_index == 0:  # a common idiom: log something extra from the main process only
        trainer.log({"loss": 0.0, "note": 1.0})
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    torch.save(state, Path(out_dir) / f"params-rank{args.process_index}.pt")


def close(out_dir: str) -> None:
    threads_before = len(os.listdir("/proc/self/task"))
    freed = close_process_group()
    result = {"freed": freed, "threads_before": threads_before, "threads_after": len(os.listdir("/proc/self/task"))}
    Path(out_dir, f"close-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
    if sys.argv[4:] == ["close"]:
        close(sys.argv[1])
        sys.exit(0)  # through interpreter finalization, which nothing of the run may abort now
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    leave_worker()
