"""The subclass contract of ApexTrainer (its class docstring, docs/extending.md): each override point a user takes,
as users take it, and what the stage keeps (its kernels, its metrics). Eager apex stages and the compiled ones run
here on the CPU; tests/gpu/test_subclass_gpu.py runs `fastest` with its CUDA graphs on the GPU."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import TrainerCallback

from hf_apex import ApexTrainer
from hf_apex.kernels.apex.optim import FusedAdamFallback
from hf_apex.measure.report import METRICS_FILENAME
from tests.test_trainer import train_args
from tests.testing_utils import TokenDataset, tiny_model

# Each stage as it runs on a CPU: the eager apex ladder in BF16, and the compiled stages (aot_eager: the compiled
# path, the stage's compile settings, without Inductor's C++ build; fastest's min_steps 0: compiled at any length).
STAGES = {
    "fused_full": {},
    "compiled": {"torch_compile_backend": "aot_eager"},
    "fastest": {"torch_compile_backend": "aot_eager", "torch_compile_mode": None, "stage_recipe": {"min_steps": 0}},
}


def run_args(tmp_path, stage, **kw):
    return train_args(tmp_path, stage=stage, max_steps=4, metrics_warmup_steps=1, **{**STAGES[stage], **kw})


def metrics_of(tmp_path) -> dict:
    return json.loads((tmp_path / METRICS_FILENAME).read_text())


def assert_the_stage_holds(trainer, tmp_path, stage):
    """The stage's switches and metrics are there: its norms swapped (fused_full), apex's optimizer (its fallback on
    a CPU) unless the subclass chose another, compiled where the stage compiles, and the step figures logged."""
    metrics = metrics_of(tmp_path)
    assert metrics["stage"] == stage and metrics["step_time_ms"]["p50"] > 0
    assert all("step_time_ms" in h for h in trainer.state.log_history if "loss" in h and h["step"] > 1)
    if stage == "fused_full":
        assert metrics["rewire"]["num_swapped"] == 5 and metrics["kernels"]["calls"]["layer_norm"]["fallback"] > 0
    else:
        assert metrics["run"]["torch_compile"] and metrics["run"]["torch_compile_backend"] == "aot_eager"
        assert "torch_compile" not in metrics["kernels"]  # (it says "not used: ..." when a run skipped compiling)


class DistillationTrainer(ApexTrainer):
    """A distillation term on top of the stock loss, from a frozen teacher: compute_loss as users override it."""

    def __init__(self, *args, teacher, weight=0.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher, self.weight, self.logits_dtypes, self.terms = teacher.eval(), weight, [], []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        with torch.no_grad():
            teacher = self.teacher(input_ids=inputs["input_ids"]).logits.float()
        self.logits_dtypes.append(outputs.logits.dtype)
        term = F.kl_div(
            outputs.logits.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="batchmean"
        )
        self.terms.append(term.item())
        total = loss + self.weight * term
        return (total, outputs) if return_outputs else total


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_custom_compute_loss_computes_every_step_in_fp32_and_the_stage_holds(stage, tmp_path):
    teacher = tiny_model("gpt2")
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # another model than the student: a KL term above zero

    def losses(cls, out, **kw):
        trainer = cls(model=tiny_model("gpt2").train(), args=run_args(out, stage), train_dataset=TokenDataset(), **kw)
        trainer.train()
        return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    trainer, distilled = losses(DistillationTrainer, tmp_path / "distilled", teacher=teacher)
    _, stock = losses(ApexTrainer, tmp_path / "stock")
    assert len(trainer.terms) == 4 and min(trainer.terms) > 0.01  # the user's loss ran at each step, and counted:
    assert distilled[0] == pytest.approx(stock[0] + 0.5 * trainer.terms[0], rel=1e-2)  # the first step's loss is it
    # The contract: a loss computed from the outputs gets them in FP32, as accelerate gives them, under BF16 autocast
    assert set(trainer.logits_dtypes) == {torch.float32}
    assert metrics_of(tmp_path / "distilled")["kernels"]["model_outputs"].startswith("FP32 (accelerate's conversion")
    assert_the_stage_holds(trainer, tmp_path / "distilled", stage)


def test_the_stock_loss_of_the_same_stage_keeps_the_autocast_dtype(tmp_path):
    """The other side of the contract above: without a compute_loss of yours, the outputs stay BF16 (fused_full)."""
    seen = []

    class Probe(ApexTrainer):
        def training_step(self, model, inputs, *args, **kwargs):  # (not compute_loss: that would switch FP32 on)
            handle = self.model.register_forward_hook(lambda m, i, out: seen.append(out.logits.dtype))
            try:
                return super().training_step(model, inputs, *args, **kwargs)
            finally:
                handle.remove()

    trainer = Probe(
        model=tiny_model("gpt2").train(), args=run_args(tmp_path, "fused_full"), train_dataset=TokenDataset()
    )
    trainer.train()
    assert seen == [torch.bfloat16] * 4 and trainer.fp32_outputs_dropped
    assert_the_stage_holds(trainer, tmp_path, "fused_full")


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_custom_optimizer_replaces_apexs_and_the_stage_holds(stage, tmp_path):
    class SGDTrainer(ApexTrainer):
        def create_optimizer(self, *args, **kwargs):
            if self.optimizer is None:
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.args.learning_rate, momentum=0.9)
            return self.optimizer

    model = tiny_model("gpt2").train()
    trainer = SGDTrainer(model=model, args=run_args(tmp_path, stage), train_dataset=TokenDataset())
    before = model.transformer.wte.weight.detach().clone()
    trainer.train()
    assert type(trainer.optimizer.optimizer) is torch.optim.SGD  # (accelerate wraps it)
    assert trainer.optimizer.optimizer.state[model.transformer.wte.weight]["momentum_buffer"] is not None
    assert not torch.equal(before, model.transformer.wte.weight)
    metrics = metrics_of(tmp_path)
    assert metrics["run"]["optimizer"] == "SGD" and "optimizer" not in metrics["kernels"]["calls"]
    assert_the_stage_holds(trainer, tmp_path, stage)


def test_get_optimizer_cls_and_kwargs_of_a_subclass_keeps_apexs_optimizer_with_its_changes(tmp_path):
    class Betas(ApexTrainer):
        def get_optimizer_cls_and_kwargs(self, args, model=None):
            cls, kwargs = super().get_optimizer_cls_and_kwargs(args, model)
            return cls, {**kwargs, "betas": (0.8, 0.9)}

    trainer = Betas(
        model=tiny_model("gpt2").train(), args=run_args(tmp_path, "fused_full"), train_dataset=TokenDataset()
    )
    trainer.train()
    inner = trainer.optimizer.optimizer
    assert type(inner) is FusedAdamFallback and inner.param_groups[0]["betas"] == (0.8, 0.9)
    assert metrics_of(tmp_path)["kernels"]["calls"]["optimizer"]["fallback"] == 4  # apex's route, counted
    assert_the_stage_holds(trainer, tmp_path, "fused_full")


class LogReader(TrainerCallback):
    """A callback with its own on_log, as users write them: it notes the model as each log finds it, and asks for an
    evaluation when the loss it reads is the first one."""

    def __init__(self):
        self.at_step_end, self.at_log, self.logs = {}, {}, []

    @staticmethod
    def fingerprint(model) -> float:
        return float(sum(p.detach().double().sum() for p in model.parameters()))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.at_step_end[state.global_step] = self.fingerprint(model)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if "loss" in logs:
            self.logs.append({**logs, "at": state.global_step})
            self.at_log[state.global_step] = self.fingerprint(model)
            if state.global_step == 2:
                control.should_evaluate = True


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_callback_with_its_own_on_log_reads_each_log_at_its_step_and_can_act_on_it(stage, tmp_path):
    reader = LogReader()
    args = run_args(tmp_path, stage, eval_strategy="no")
    trainer = ApexTrainer(
        model=tiny_model("gpt2").train(),
        args=args,
        train_dataset=TokenDataset(),
        eval_dataset=TokenDataset(n=8),
        callbacks=[reader],
    )
    trainer.train()
    assert [log["at"] for log in reader.logs] == [1, 2, 3, 4]
    assert reader.at_log == {s: reader.at_step_end[s] for s in (1, 2, 3, 4)}  # the model of the logging step
    assert all("step_time_ms" in log for log in reader.logs[1:])  # the stage metrics reach it
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [2]  # its request was acted on
    assert_the_stage_holds(trainer, tmp_path, stage)


@pytest.mark.parametrize("stage", list(STAGES))
def test_training_step_and_log_overrides_run_inside_the_stage(stage, tmp_path):
    class Counting(ApexTrainer):
        steps = 0

        def training_step(self, model, inputs, *args, **kwargs):
            type(self).steps += 1
            return super().training_step(model, inputs, *args, **kwargs)

        def log(self, logs, *args, **kwargs):
            logs["mine"] = 1.0  # before super().log, which merges the stage metrics and writes the history
            super().log(logs, *args, **kwargs)

    trainer = Counting(model=tiny_model("gpt2").train(), args=run_args(tmp_path, stage), train_dataset=TokenDataset())
    trainer.train()
    assert Counting.steps == 4
    logged = [h for h in trainer.state.log_history if "loss" in h]
    # what log() of a subclass adds is kept beside the stage metrics
    assert all("mine" in h for h in logged) and all("step_time_ms" in h for h in logged[1:])
    assert_the_stage_holds(trainer, tmp_path, stage)


def test_the_deferred_log_runs_only_on_the_private_method_it_was_tested_against():
    """ApexTrainer defers a logging step's log through Trainer._maybe_log_save_evaluate (private): only where its
    signature is the one tested at both ends of the supported transformers range (CI runs this at both)."""
    from transformers import Trainer

    from hf_apex.internals import can_defer_logs

    assert can_defer_logs(Trainer)  # the installed transformers: a version this suite runs at

    class Moved(Trainer):
        def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time):
            pass

    assert not can_defer_logs(Moved) and not can_defer_logs(object)


class CountsPreparedBatches(ApexTrainer):
    """A trainer whose _prepare_inputs does more than move tensors (TRL's GRPOTrainer generates completions there):
    it must run once a step."""

    prepared = 0

    def _prepare_inputs(self, inputs):
        self.prepared += 1
        return super()._prepare_inputs(inputs)


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_step_prepares_its_batch_once_unless_the_first_one_is_timed(stage, tmp_path):
    args = run_args(tmp_path, stage, autotune=False)
    trainer = CountsPreparedBatches(
        model=tiny_model("bert").train(), args=args, train_dataset=TokenDataset(task="cls")
    )
    timed = trainer.autotuner is not None  # (fastest times the SDPA backends on the first batch)
    assert timed == (stage == "fastest")
    trainer.train()
    assert trainer.prepared == args.max_steps + timed


class TupleBatches(ApexTrainer):
    """Batches as tuples, which this subclass's compute_loss unpacks."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        input_ids, labels = inputs
        outputs = model(input_ids=input_ids, labels=labels)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_subclass_may_train_on_tuple_batches(stage, tmp_path):
    def collate(rows):
        return torch.stack([r["input_ids"] for r in rows]), torch.stack([r["labels"] for r in rows])

    args = run_args(tmp_path, stage, remove_unused_columns=False)
    trainer = TupleBatches(
        model=tiny_model("bert").train(), args=args, train_dataset=TokenDataset(task="cls"), data_collator=collate
    )
    trainer.train()
    assert trainer.state.global_step == args.max_steps
