"""hf_apex.plan: a stage's converters, compile plan and per-step context without the Trainer."""

import pickle

import torch
import transformers

from hf_apex import ApexTrainingArguments, StagePlan
from hf_apex.kernels.apex.norms import is_swapped
from hf_apex.kernels.models.loss import is_fused
from tests.testing_utils import TokenDataset, tiny_model


def args(tmp_path, **kw):
    return ApexTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)


def test_the_converters_convert_report_and_revert_a_model(tmp_path):
    plan = StagePlan(args(tmp_path, apex_fused_norms=True, fused_linear_cross_entropy=True))
    model = tiny_model("llama")
    plan.convert(model)
    assert plan.norms.report.num_swapped == sum(is_swapped(m) for m in model.modules()) == 5
    assert plan.loss.report == {"fused_linear_cross_entropy": True, "reason": None} and is_fused(model)
    assert repr(plan) == (
        "StagePlan(stage=None, FusedNorms(5 swapped), LossWithoutLogits(on), RotaryOnce(off), "
        "StaticMasks(off), compile=[])"
    )
    again = pickle.loads(pickle.dumps(model))  # (the stock classes plus the swaps)
    assert sum(is_swapped(m) for m in again.modules()) == 5
    plan.revert(model)
    assert not any(is_swapped(m) for m in model.modules()) and not is_fused(model)
    assert type(model) is transformers.LlamaForCausalLM


def test_a_converter_that_is_off_gives_the_stock_model_back(tmp_path):
    model = tiny_model("gpt2")
    StagePlan(args(tmp_path, stage="fused_adam_ln")).convert(model)
    assert any(is_swapped(m) for m in model.modules())
    off = StagePlan(args(tmp_path, stage="fused_adam"))  # (a later run without apex's norms)
    off.convert(model)
    assert off.norms.report is None and not any(is_swapped(m) for m in model.modules())


def test_a_run_owns_its_masks_and_a_step_its_compiler_settings(tmp_path):
    import torch._inductor.config as inductor

    plan = StagePlan(args(tmp_path, stage="compiled", bf16=False))
    model = tiny_model("llama")
    plan.convert(model)
    settings = plan.compile_settings["torch._inductor.config"]
    before = {name: getattr(inductor, name) for name in settings}
    with plan.run(model):
        assert model.config._attn_implementation == "hf_apex_sdpa" and plan.masks.report
        with plan.step({"input_ids": torch.ones(2, 4, dtype=torch.long)}):
            assert {name: getattr(inductor, name) for name in settings} == settings
        assert {name: getattr(inductor, name) for name in settings} == before
    assert model.config._attn_implementation == "sdpa"  # the run's masks undone


def test_a_plain_loop_over_the_plan_trains_as_the_trainer(tmp_path):
    # fused_adam_ln in FP32: apex's norms (their torch fallback on a CPU) and FusedAdam, eager; the same steps as
    # ApexTrainer's on the same batches, without the Trainer
    from hf_apex import ApexTrainer

    data = TokenDataset(n=8, seq=16)
    batch = {k: torch.stack([data[i][k] for i in range(8)]) for k in ("input_ids", "attention_mask", "labels")}
    run_args = args(
        tmp_path,
        stage="fused_adam_ln",
        max_steps=3,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        stage_metrics=False,
        dataloader_drop_last=True,
    )
    trainer = ApexTrainer(model=tiny_model("llama").train(), args=run_args, train_dataset=data)
    trainer.train()
    theirs = [h["loss"] for h in trainer.state.log_history if "loss" in h]

    model = tiny_model("llama").train()
    plan = StagePlan(run_args)
    plan.convert(model)
    opt_cls, kwargs = plan.optimizer_cls_and_kwargs(model)
    optimizer = opt_cls(model.parameters(), **kwargs)
    ours = []
    with plan.run(model):
        for step in range(3):
            if step == 0:
                plan.decide_on_first_batch(model, lambda: model(**batch).loss, batch, steps_left=3)
            with plan.step(batch, step or None):
                loss = model(**batch).loss
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ours.append(loss.item())
    assert type(optimizer).__name__ == type(trainer.optimizer.optimizer).__name__
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-5)
