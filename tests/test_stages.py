import dataclasses

import pytest

from hf_apex import STAGES, ApexTrainingArguments
from hf_apex.stages import get_stage


def test_seed_ladder_comes_first_in_order():
    assert list(STAGES)[:4] == ["baseline", "fused_adam", "fused_adam_ln", "fused_full"]


def test_each_seed_stage_changes_exactly_one_switch():
    names = list(STAGES)[:4]
    for prev, cur in zip(names, names[1:]):
        a, b = STAGES[prev].settings(), STAGES[cur].settings()
        changed = {k for k in a if a[k] != b[k]}
        assert len(changed) == 1, (prev, cur, changed)


def test_a_stage_row_names_only_training_arguments():
    fields = {f.name for f in dataclasses.fields(ApexTrainingArguments)}
    for stage in STAGES.values():
        assert set(stage.settings()) <= fields, stage.name
        args = ApexTrainingArguments(output_dir="unused", use_cpu=True, report_to="none", stage=stage.name)
        for name, value in stage.settings().items():
            assert getattr(getattr(args, name), "value", getattr(args, name)) == value, (stage.name, name)


def test_cli_choices_are_the_registry():
    field = next(f for f in dataclasses.fields(ApexTrainingArguments) if f.name == "stage")
    assert field.metadata["choices"] == list(STAGES)


def test_unknown_stage_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown stage 'turbo'.*baseline"):
        get_stage("turbo")
