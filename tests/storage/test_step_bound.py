"""One bound on step numbers (common/limits.py:MAX_STEP) for the spec, the checkpoint
directory names and their listing: a run the spec accepts commits checkpoints that every
reader sees, whatever their step. Directory names are `step-%09d` (nine digits, zero
padded: what every committed checkpoint so far is called), which grows to ten and more
digits from step 10^9 on; a listing that matched nine digits only never saw them, so a
resume past step 999,999,999 restarted from an older checkpoint or from scratch."""

from __future__ import annotations

import pytest

from common.commands import Refused, command
from common.errors import BadConfig
from common.limits import MAX_STEP
from spec import RunSpec
from storage.checkpoints import CheckpointStore, step_dir
from storage.manifest import step_of_dir
from tests.storage.ckpt_helpers import durable, payload, write_files  # noqa: F401

__all__ = ["durable"]

BILLION = 10**9


def commit(store: CheckpointStore, tmp_path, step: int) -> None:
    store.commit(step, write_files(tmp_path / f"local-{step}", payload(step % 2**32)))


def test_checkpoints_committed_at_and_past_step_one_billion_are_listed_in_step_order(
        durable, tmp_path):  # noqa: F811
    store = CheckpointStore(durable, "r")
    steps = [999_999_999, BILLION, BILLION + 7, MAX_STEP]
    for step in reversed(steps):
        commit(store, tmp_path, step)
    assert store.list_committed() == steps
    assert store.latest_committed() == MAX_STEP
    assert store.manifest(BILLION).step == BILLION


def test_a_resume_past_step_one_billion_fetches_the_newest_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path / "durable"), "r")
    for step in (999_999_990, BILLION + 10):
        commit(store, tmp_path, step)
    man = store.fetch_latest(str(tmp_path / "restore"))
    assert man is not None and man.step == BILLION + 10


def test_existing_nine_digit_directory_names_still_read_and_are_still_written():
    assert step_dir(40) == "step-000000040"
    assert step_of_dir("step-000000040") == 40
    assert step_dir(BILLION) == "step-1000000000"
    assert step_of_dir("step-1000000000") == BILLION


@pytest.mark.parametrize("name", [
    "step-00000040",  # eight digits: no writer's name
    "step-0000000040",  # ten digits with a leading zero: step_dir(40) is nine digits
    f"step-{MAX_STEP + 1}",  # past the bound
    "step-99999999999999999999",
    "step-000000040.tmp", "step-+00000040", "step- 00000040", "step-٤٠٠٠٠٠٠٠٠",
])
def test_a_directory_name_no_writer_produces_is_not_a_step(name):
    assert step_of_dir(name) is None


@pytest.mark.parametrize("step", [-1, MAX_STEP + 1])
def test_a_step_outside_the_bound_has_no_directory_name(step):
    with pytest.raises(ValueError, match="MAX_STEP"):
        step_dir(step)


def test_the_spec_takes_the_same_step_bound_as_the_store():
    spec = RunSpec.from_dict({"run_id": "r", "train": {"total_steps": MAX_STEP}})
    assert spec.train.total_steps == MAX_STEP
    with pytest.raises(BadConfig, match="total_steps"):
        RunSpec.from_dict({"run_id": "r", "train": {"total_steps": MAX_STEP + 1}})


@pytest.mark.parametrize("name, raw, field", [
    ("rollback", {"to_step": MAX_STEP + 1}, "to_step"),
    ("set_lr_scale", {"scale": 0.5, "steps": MAX_STEP + 1}, "steps"),
])
def test_an_operator_command_past_the_step_bound_is_refused_naming_it(name, raw, field):
    with pytest.raises(Refused, match=f"{field} must be at most {MAX_STEP}"):
        command(name, raw)
    assert command(name, {**raw, field: MAX_STEP})  # the bound itself is a step
