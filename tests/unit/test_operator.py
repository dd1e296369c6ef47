"""Operator command parsing and admission (workflows/operator.py), with literal inputs."""

from __future__ import annotations

import pytest

from workflows.operator import Refused, admit, lr_window, parse_command, rewind


def admitted(name: str, raw=None, *, stage: str = "train", step: int = 40, total: int = 100,
             queued: tuple[str, ...] = ()) -> str:
    return admit(parse_command(name, raw), stage=stage, step=step, total_steps=total,
                 queued=queued)


def test_a_bare_string_is_the_note_and_who_is_kept():
    assert parse_command("pause", "disk swap").note == "disk swap"
    cmd = parse_command("abort", {"reason": "budget", "who": "alice"})
    assert (cmd.note, cmd.who) == ("budget", "alice")


@pytest.mark.parametrize("name, raw, says", [
    ("rollback", {}, "to_step is required"),
    ("rollback", {"to_step": -1}, "to_step must be an integer >= 0"),
    ("rollback", {"to_step": 3.5}, "to_step must be an integer >= 0"),
    ("rollback", {"to_step": 3, "skip_data": "yes"}, "skip_data must be true or false"),
    ("set_lr_scale", {"scale": 0}, "scale must be a number in (0, 10]"),
    ("set_lr_scale", {"scale": 11}, "scale must be a number in (0, 10]"),
    ("set_lr_scale", {"scale": float("nan")}, "scale must be a number"),
    ("set_lr_scale", {"scale": 0.5, "steps": -2}, "steps must be an integer >= 0"),
    ("pause", {"resaon": "typo"}, "unknown field(s) ['resaon']"),
    ("pause", [1], "expected a JSON object"),
    ("explode", {}, "unknown command 'explode'"),
])
def test_bad_input_is_refused_naming_the_field(name, raw, says):
    with pytest.raises(Refused, match=None) as exc:
        parse_command(name, raw)
    assert says in str(exc.value)


def test_rollback_must_go_back_before_the_runs_step():
    assert admitted("rollback", {"to_step": 39}) == ""
    assert "not before the run's step 40" in admitted("rollback", {"to_step": 40})
    assert "nothing has been trained yet" in admitted("rollback", {"to_step": 0}, step=0)


def test_pause_twice_and_resume_unpaused_are_refused():
    assert admitted("pause") == ""
    assert "already paused" in admitted("pause", stage="paused")
    assert "already on its way" in admitted("pause", queued=("pause",))
    assert "not paused" in admitted("resume")
    assert admitted("resume", stage="paused") == admitted("resume", stage="needs_attention") == ""


def test_commands_before_training_queue_and_after_training_only_abort_applies():
    assert admitted("pause", stage="prepare_data", step=0) == ""
    assert admitted("set_lr_scale", {"scale": 0.5}, stage="warmup_sweep", step=0) == ""
    assert "training is over" in admitted("pause", stage="evaluate", step=100)
    assert "training is over" in admitted("set_lr_scale", {"scale": 2}, step=100)
    assert admitted("abort", stage="evaluate", step=100) == ""


def test_nothing_is_accepted_once_the_run_ended_or_an_abort_is_queued():
    assert "has ended" in admitted("abort", stage="completed")
    assert "has ended" in admitted("pause", stage="aborted")
    assert "being aborted" in admitted("rollback", {"to_step": 1}, queued=("abort",))


def test_lr_window_runs_from_the_current_step_for_its_steps_or_to_the_end():
    assert lr_window(parse_command("set_lr_scale", {"scale": 0.5}), 40, 100) == [40, 100, 0.5]
    assert lr_window(parse_command("set_lr_scale", {"scale": 2, "steps": 10}), 40, 100) \
        == [40, 50, 2.0]
    assert lr_window(parse_command("set_lr_scale", {"scale": 2, "steps": 99}), 40, 100) \
        == [40, 100, 2.0]


def test_a_second_rollback_before_the_first_is_applied_skips_through_the_furthest_step():
    first = rewind(parse_command("rollback", {"to_step": 50}), "r/op1", 90, None)
    assert (first["to_step"], first["through_step"], first["skip_data"]) == (50, 90, True)
    second = rewind(parse_command("rollback", {"to_step": 30, "skip_data": False}), "r/op2",
                    50, first)
    assert (second["id"], second["to_step"], second["through_step"]) == ("r/op2", 30, 90)
    assert second["skip_data"] is False
