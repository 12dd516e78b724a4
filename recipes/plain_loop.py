"""The same training as a `recipes/finetune.py` run, in a plain PyTorch loop: the reference for the Trainer's cost.

    python recipes/plain_loop.py OUT.json <the recipes/finetune.py flags of the run to mirror>

`make bench` runs it after each stage. It does the work the Trainer does, no more and no less: the same model
(without a KV cache in training, as the Trainer sets `use_cache`), data and collator (in another order: the same
shapes); the same optimizer (HF's decay/no-decay groups, apex or torch per the flags), LR schedule and gradient
clipping at `--max_grad_norm`; the same precision (autocast, GradScaler for FP16), `torch.compile`, masks (batches
leave out an all-ones attention mask; SDPA masks decided on the host), the stage recipe (`--stage_recipe`: RoPE's
cos/sin once, the compile settings), loss
(`--fused_linear_cross_entropy`) and SDPA backend (`--attention_backend`, decided on the first batch as the Trainer
does); `num_items_in_batch` counted as the Trainer counts it; `zero_grad(set_to_none=True)`; pinned batches copied
without blocking; the loss read on the host every `--logging_steps` steps, at the end of the step after (as
ApexTrainer). Step times are measured the same way as the Trainer's (whole cycles between step starts, CUDA events
read at the end), and written with the losses to OUT.json.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import finetune  # recipes/ is the script's folder, so it is on sys.path
import torch
from transformers import HfArgumentParser, Trainer, get_scheduler, set_seed

from hf_apex import ApexTrainingArguments
from hf_apex.internals import loss_items_counter
from hf_apex.measure.report import compile_mode, percentiles
from hf_apex.measure.steps import StepTimer
from hf_apex.plan import StagePlan, decide_compile
from hf_apex.runtime import HostCopy
from hf_apex.training_args import uses_cuda_graphs


def main(out_json: str, argv: list[str]) -> dict:
    parser = HfArgumentParser((finetune.ScriptArguments, ApexTrainingArguments))
    script_args, args = parser.parse_args_into_dataclasses(argv)
    if args.max_steps <= 0 or args.gradient_accumulation_steps != 1:
        raise SystemExit(
            "plain_loop.py: needs --max_steps > 0 and --gradient_accumulation_steps 1 (what make bench runs)"
        )
    set_seed(args.seed)
    return run(script_args, args, out_json)


def run(script_args, args: ApexTrainingArguments, out_json: str) -> dict:
    tokenizer = finetune.load_tokenizer(script_args)
    model = finetune.load_model(script_args, tokenizer)
    prepare = finetune.prepare_sst2 if script_args.task == "sst2" else finetune.prepare_wikitext2
    train_ds, _, collator, _ = prepare(script_args, finetune.load_raw_data(script_args), tokenizer, model, args)
    args = decide_compile(args, model, train_ds)[0]  # as ApexTrainer: eager where compiling would not pay
    device = args.device
    if hasattr(args, "use_cache"):  # as Trainer.__init__ does (False by default: no KV cache built in training)
        model.config.use_cache = args.use_cache
    model.to(device).train()

    # What the stage does (hf_apex.plan, as in ApexTrainer); the Trainer's own choices: decay groups, schedule.
    plan = StagePlan(args)
    plan.convert(model)
    decay = set(Trainer.get_decay_parameter_names(None, model))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    if args.apex_optimizer != "none":
        opt_cls, kwargs = plan.optimizer_cls_and_kwargs(model)
    else:
        opt_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer = opt_cls(groups, **kwargs)
    steps = args.max_steps
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, args.get_warmup_steps(steps), steps)
    with plan.run(model):
        return train(plan, model, train_ds, collator, optimizer, scheduler, out_json)


def train(plan: StagePlan, model, train_ds, collator, optimizer, scheduler, out_json: str) -> dict:
    args, raw, steps = plan.args, model, plan.args.max_steps
    if args.torch_compile:  # as the Trainer does (through accelerate): compile the model, not the optimizer
        model = torch.compile(model, backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode)
    device, cuda = args.device, args.device.type == "cuda"
    collator = plan.collator(collator, raw)
    loader = torch.utils.data.DataLoader(
        train_ds,
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
        collate_fn=collator,
        drop_last=args.dataloader_drop_last,
        num_workers=args.dataloader_num_workers,
        pin_memory=cuda and args.dataloader_pin_memory,
    )
    amp = torch.bfloat16 if args.bf16 else torch.float16
    scaler = torch.amp.GradScaler(device.type, enabled=args.fp16)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    batches = itertools.chain.from_iterable(itertools.repeat(loader))
    first = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
    batches = itertools.chain([first], batches)

    count_items = loss_items_counter(raw, args)

    def loss_fn():
        with torch.autocast(device.type, dtype=amp, enabled=args.bf16 or args.fp16):
            return raw(**first).loss

    # the run's one-off decisions (autotune's norms, the SDPA backend); a norms trial's steps are warm-up
    warmup = max(args.metrics_warmup_steps, plan.decide_on_first_batch(raw, loss_fn, first, steps_left=steps))
    timer, losses, logged = StepTimer(cuda), [], None
    graphs = uses_cuda_graphs(args)  # as ApexTrainer: each step's start marked for the CUDA graphs
    for step in range(1, steps + 1):
        batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        items = count_items(batch)  # as the Trainer: None where the model takes no loss kwargs
        loss_kwargs = {} if items is None else {"num_items_in_batch": items}
        timer.start()
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with plan.step(batch, step - 1 if step > 1 else None):  # (autotune's norms trial: from the second step)
            with torch.autocast(device.type, dtype=amp, enabled=args.bf16 or args.fp16):
                loss = model(**batch, **loss_kwargs).loss
            scaler.scale(loss).backward()
        if args.max_grad_norm > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        model.zero_grad(set_to_none=True)
        timer.stop()
        losses.append(loss.detach().clone() if graphs else loss.detach())  # (a graph output: replays reuse it)
        # The Trainer reads the loss when it logs; so does this loop, as ApexTrainer does: a logging step's loss
        # copied to the host and read at the end of the next step, the last step's at once.
        if logged is not None:
            float(logged.get()[0])
            logged = None
        if step % args.logging_steps == 0:
            logged = HostCopy(loss)
            if step == steps:
                float(logged.get()[0])
    if plan.autotuner is not None:
        plan.autotuner.end_run()
    ms = timer.drain(final=True)
    result = {
        "step_time_ms": percentiles(ms[warmup:] or ms),
        "steps_ms": [round(m, 4) for m in ms],
        "warmup_steps": warmup,
        "peak_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "losses": [float(v) for v in losses],
        "torch_compile_mode": compile_mode(args),  # as the Trainer's metrics
    }
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
