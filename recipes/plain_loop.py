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

import contextlib
import inspect
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import finetune  # recipes/ is the script's folder, so it is on sys.path
import torch
from transformers import HfArgumentParser, Trainer, get_scheduler, set_seed
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

from hf_apex import ApexTrainingArguments, rewire
from hf_apex.autotune import TRIAL_MIN_STEPS, TRIAL_WARMUP, Autotuner, DecisionCache, training_pass
from hf_apex.kernels.attention import capture as capture_attention
from hf_apex.kernels.attention import one_sequence_per_row, preferring, use_static_masks
from hf_apex.kernels.loss import fuse_linear_cross_entropy
from hf_apex.kernels.optim import apex_optimizer_cls_and_kwargs
from hf_apex.kernels.rotary import compute_rotary_once
from hf_apex.measure.report import compile_mode, percentiles
from hf_apex.measure.steps import StepTimer
from hf_apex.policy import compiled_step_settings, drops_full_attention_mask, why_not_compile
from hf_apex.runtime import DropFullAttentionMask, HostCopy, strict_fp32
from hf_apex.training_args import graph_norm_kernel, uses_cuda_graphs


def loss_items_counter(model, args) -> Callable[[dict], torch.Tensor | None]:
    """The Trainer's count of a batch's loss items (``num_items_in_batch``: a causal LM's shifted labels, for a model
    whose forward takes loss kwargs), by the Trainer's own method on a bare instance that holds what it reads. The
    loss then divides by that input, as in the Trainer run: the same value, and under torch.compile the same graph
    (whose dtype depends on the transformers version)."""
    counter = object.__new__(Trainer)
    counter.args, counter.model, counter.compute_loss_func = args, model, None
    counter.accelerator, counter.is_deepspeed_enabled = SimpleNamespace(parallelism_config=None), False
    if hasattr(model, "accepts_loss_kwargs"):  # as Trainer.__init__ decides it
        counter.model_accepts_loss_kwargs = model.accepts_loss_kwargs
    else:
        params = inspect.signature(model.forward).parameters.values()
        counter.model_accepts_loss_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    config = getattr(model, "config", None)
    counter._loss_shifts_labels = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss and not (
        getattr(config, "is_encoder_decoder", False)
    )
    return lambda batch: counter._get_num_items_in_batch([batch], args.device)


def main(out_json: str, argv: list[str]) -> dict:
    parser = HfArgumentParser((finetune.ScriptArguments, ApexTrainingArguments))
    script_args, args = parser.parse_args_into_dataclasses(argv)
    if args.max_steps <= 0 or args.gradient_accumulation_steps != 1:
        raise SystemExit(
            "plain_loop.py: needs --max_steps > 0 and --gradient_accumulation_steps 1 (what make bench runs)"
        )
    set_seed(args.seed)
    # as ApexTrainer.train (on torch.compile the setting is part of the graphs' cache key)
    with strict_fp32() if args.tf32 is False else contextlib.nullcontext():
        return run(script_args, args, out_json)


def run(script_args, args: ApexTrainingArguments, out_json: str) -> dict:
    tokenizer = finetune.load_tokenizer(script_args)
    model = finetune.load_model(script_args, tokenizer)
    prepare = finetune.prepare_sst2 if script_args.task == "sst2" else finetune.prepare_wikitext2
    train_ds, _, collator, _ = prepare(script_args, finetune.load_raw_data(script_args), tokenizer, model, args)
    if why_not_compile(args, train_ds):  # as ApexTrainer: eager when compilation would not pay, or without a GPU
        args.torch_compile = False
    device = args.device
    if hasattr(args, "use_cache"):  # as Trainer.__init__ does (False by default: no KV cache built in training)
        model.config.use_cache = args.use_cache
    model.to(device).train()

    # The Trainer's choices: apex kernels (autotuned or not), decay groups, optimizer, schedule, compile.
    timed = args.autotune or args.attention_backend == "fastest"
    tuner = Autotuner(DecisionCache(args.autotune_cache)) if timed else None
    if args.apex_fused_norms:
        rewire(
            model,
            strict_kernels=args.apex_strict_kernels,
            chooser=tuner.choose_norm if args.autotune else None,
            compiled=args.torch_compile,
            graph_kernel=graph_norm_kernel(args),
        )
    if args.fused_linear_cross_entropy and not args.fp16:  # as ApexTrainer: FP16 autocast keeps the stock loss
        fuse_linear_cross_entropy(model)  # (a model it does not fit keeps its loss, as in ApexTrainer)
    if args.torch_compile and args.recipe.rotary_once:
        compute_rotary_once(model)  # as ApexTrainer: a RoPE model's cos/sin once per compiled forward
    static = use_static_masks(model, args.recipe.static_masks)  # as ApexTrainer: SDPA masks decided on the host
    decay = set(Trainer.get_decay_parameter_names(None, model))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    if args.apex_optimizer != "none":
        choose = (lambda kwargs, blocked: tuner.choose_optimizer(model, kwargs, blocked)) if tuner else None
        opt_cls, kwargs = apex_optimizer_cls_and_kwargs(args, model, choose)
    else:
        opt_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer = opt_cls(groups, **kwargs)
    steps = args.max_steps
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, args.get_warmup_steps(steps), steps)
    raw = model
    if args.torch_compile:  # as the Trainer does (through accelerate): compile the model, not the optimizer
        model = torch.compile(model, backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode)

    cuda = device.type == "cuda"
    if drops_full_attention_mask(args, raw):  # as ApexTrainer does
        collator = DropFullAttentionMask(collator)
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

    one_sequence = static and "position_ids" not in first  # as ApexTrainer: each row one sequence, unread
    count_items = loss_items_counter(raw, args)

    def loss_fn():
        with (
            torch.autocast(device.type, dtype=amp, enabled=args.bf16 or args.fp16),
            one_sequence_per_row(one_sequence),
        ):
            return raw(**first).loss

    if args.autotune and args.apex_fused_norms and not args.torch_compile:  # as ApexTrainer: timed on whole passes
        shape = tuple(first[model.main_input_name].shape)
        autocast_dtype = amp if args.bf16 or args.fp16 else None
        trial = steps >= TRIAL_MIN_STEPS  # as ApexTrainer: a long run checks the choice on whole steps
        tuner.choose_norms(model, training_pass(model, loss_fn), shape, autocast_dtype, trial=trial)
    warmup = args.metrics_warmup_steps  # as ApexTrainer: a trial's steps, and the one after them, are warm-up
    if tuner is not None and tuner.trial is not None:
        warmup = max(warmup, TRIAL_WARMUP)
    attention = args.attention_backend  # as ApexTrainer: the SDPA backend put first for every step
    if attention == "fastest":
        attention = tuner.choose_attention(capture_attention(loss_fn))
    timer, losses, logged = StepTimer(cuda), [], None
    graphs = uses_cuda_graphs(args)  # as ApexTrainer: each step's start marked for the CUDA graphs
    for step in range(1, steps + 1):
        batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        items = count_items(batch)  # as the Trainer: None where the model takes no loss kwargs
        loss_kwargs = {} if items is None else {"num_items_in_batch": items}
        if tuner is not None and step > 1:  # as ApexTrainer: the norms' trial from the step after the passes'
            tuner.at_step(step - 1)
        timer.start()
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with compiled_step_settings(args, raw):  # as ApexTrainer (of the model, not its compiled wrapper)
            with (
                torch.autocast(device.type, dtype=amp, enabled=args.bf16 or args.fp16),
                preferring(attention),
                one_sequence_per_row(one_sequence),
            ):
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
    if tuner is not None:
        tuner.end_run()
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
