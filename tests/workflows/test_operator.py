"""Operator commands, with literal inputs: their typed inputs (common/commands.py),
admission and the rollback record (workflows/operator_queue.py) and LR windows
(workflows/lr_windows.py)."""

from __future__ import annotations

import itertools

import pytest

from common.commands import Refused, Rollback, SetLrScale, command
from common.protocol import OperatorRollback
from trainer.schedule import lr_scale
from workflows.lr_windows import MAX_LR_WINDOWS, compose_windows, lr_window
from workflows.operator_queue import MAX_QUEUED, admit, operator_rollback


def admitted(name: str, raw=None, *, stage: str = "train", step: int = 40, total: int = 100,
             queued: tuple[str, ...] = (), oldest: int = 0, windows: int = 0) -> str:
    return admit(command(name, raw), stage=stage, step=step, total_steps=total,
                 queued=queued, oldest_step=oldest, lr_windows=windows)


scale_at = lr_scale  # what the trainer multiplies the LR by at a step


def test_a_bare_string_is_the_note_and_who_is_kept():
    assert command("pause", "disk swap").note == "disk swap"
    cmd = command("abort", {"reason": "budget", "who": "alice"})
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
    ("rollback", "a note", "rollback: to_step is required (the step to go back to)"),
    ("set_lr_scale", {}, "set_lr_scale: scale is required (a number in (0, 10])"),
    ("pause", {"resaon": "typo"}, "unknown field(s) ['resaon']; known: ['note', 'reason', 'who']"),
    ("pause", {"to_step": 3}, "pause: unknown field(s) ['to_step']"),  # another command's
    ("pause", [1], "expected a JSON object"),
    ("explode", {}, "unknown command 'explode'"),
])
def test_bad_input_is_refused_naming_the_field(name, raw, says):
    with pytest.raises(Refused, match=None) as exc:
        command(name, raw)
    assert says in str(exc.value)


def test_inputs_become_typed_frozen_commands():
    assert command("rollback", {"to_step": 5, "who": "a", "reason": "r"}) == \
        Rollback(to_step=5, skip_data=True, who="a", note="r")
    cmd = command("set_lr_scale", {"scale": 2, "steps": 10})
    assert cmd == SetLrScale(scale=2.0, steps=10) and isinstance(cmd.scale, float)
    with pytest.raises(AttributeError):
        cmd.scale = 3.0  # type: ignore[misc]
    with pytest.raises(Refused, match="to_step must be an integer >= 0, got True"):
        Rollback(to_step=True)  # checked however it is built


def test_an_accepted_command_reads_leniently_as_before_commands_were_typed():
    """Past the validator (a queued command, a replayed handler, the abort signal) a field
    another command takes is ignored, as the one parser did: histories replay the same."""
    assert command("pause", {"to_step": 3, "note": "n"}, strict=False).note == "n"
    assert command("abort", {"scale": 2}, strict=False).note == ""
    with pytest.raises(Refused, match=r"unknown field\(s\) \['resaon'\]"):
        command("abort", {"resaon": "typo"}, strict=False)  # refused before, still refused


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
    assert lr_window(command("set_lr_scale", {"scale": 0.5}), 40, 100) == [40, 100, 0.5]
    assert lr_window(command("set_lr_scale", {"scale": 2, "steps": 10}), 40, 100) \
        == [40, 50, 2.0]
    assert lr_window(command("set_lr_scale", {"scale": 2, "steps": 99}), 40, 100) \
        == [40, 100, 2.0]


def test_a_second_rollback_before_the_first_is_applied_skips_through_the_furthest_step():
    first = operator_rollback(command("rollback", {"to_step": 50, "who": "w"}), "r/op1", 90,
                              None)
    assert first == OperatorRollback(id="r/op1", to_step=50, through_step=90, skip_data=True,
                                     note="", who="w")
    second = operator_rollback(command("rollback", {"to_step": 30, "skip_data": False}),
                               "r/op2", 50, first)
    assert (second.id, second.to_step, second.through_step) == ("r/op2", 30, 90)
    assert second.skip_data is False


def test_a_rollback_before_the_oldest_checkpoint_retention_left_is_refused_naming_it():
    assert admitted("rollback", {"to_step": 20}, oldest=20) == ""
    why = admitted("rollback", {"to_step": 10}, oldest=20)
    assert why == ("rollback to step 10: no checkpoint at or before it is left (retention "
                   "keeps steps >= 20); the oldest step you can roll back to is 20")


def test_commands_beyond_the_queue_bound_are_refused_but_abort_still_gets_through():
    full = ("set_lr_scale",) * MAX_QUEUED
    assert admitted("set_lr_scale", {"scale": 0.5}, queued=full[1:]) == ""
    for name, raw in (("set_lr_scale", {"scale": 0.5}), ("rollback", {"to_step": 3}),
                      ("pause", None)):
        assert admitted(name, raw, queued=full) == \
            f"{MAX_QUEUED} commands already waiting; wait until they apply"
    assert admitted("abort", queued=full) == ""
    assert admitted("resume", stage="paused", queued=full) == ""  # resume never queues


def test_set_lr_scale_is_refused_once_the_schedule_could_pass_its_window_bound():
    assert admitted("set_lr_scale", {"scale": 0.5}, windows=MAX_LR_WINDOWS - 2) == ""
    assert "holds at most 256" in admitted("set_lr_scale", {"scale": 0.5},
                                           windows=MAX_LR_WINDOWS - 1)
    assert admitted("set_lr_scale", {"scale": 0.5}, windows=MAX_LR_WINDOWS - 4,
                    queued=("set_lr_scale",)) == ""
    why = admitted("set_lr_scale", {"scale": 0.5}, windows=MAX_LR_WINDOWS - 3,
                   queued=("set_lr_scale",))
    assert "253 windows and 1 set_lr_scale command(s) waiting" in why
    assert admitted("rollback", {"to_step": 3}, windows=MAX_LR_WINDOWS) == ""  # only LR


def test_overlapping_windows_compose_into_disjoint_pieces_with_multiplied_factors():
    assert compose_windows([[10, 20, 0.5], [15, 30, 0.5]]) == \
        [[10, 15, 0.5], [15, 20, 0.25], [20, 30, 0.5]]
    assert compose_windows([[0, 10, 0.5], [10, 20, 0.5]]) == [[0, 20, 0.5]]  # merged
    assert compose_windows([[0, 100, 0.5], [50, 100, 2.0]]) == [[0, 50, 0.5]]  # x1 dropped
    # a gap between windows is a x1 piece, so every command adds at most two pieces
    assert compose_windows([[0, 10, 0.5], [20, 30, 2.0]]) == \
        [[0, 10, 0.5], [10, 20, 1.0], [20, 30, 2.0]]
    assert compose_windows([[40, 40, 0.5]]) == []  # set_lr_scale at the last step


def test_pieces_no_reachable_step_can_use_are_dropped():
    windows = [[0, 10, 0.5], [10, 20, 2.0], [15, 40, 0.8]]
    assert compose_windows(windows, floor=10) == [[10, 15, 2.0], [15, 20, 1.6], [20, 40, 0.8]]
    assert compose_windows(windows, floor=15) == [[15, 20, 1.6], [20, 40, 0.8]]
    assert compose_windows(windows, floor=20) == [[20, 40, 0.8]]
    assert compose_windows(windows, floor=40) == []
    assert scale_at(compose_windows(windows, floor=12), 13) == 2.0  # kept: 12 may run again


def test_composing_keeps_every_steps_factor_and_each_command_adds_at_most_two_pieces():
    commands = [(0, 0.5, 0), (30, 2.0, 20), (30, 0.5, 5), (60, 0.9, 0), (45, 1.25, 100),
                (10, 0.8, 15), (90, 2.0, 3), (90, 0.5, 3), (5, 3.0, 200)]
    raw: list[list[float]] = []
    composed: list[list[float]] = []
    for step, scale, steps in commands:
        window = lr_window(command("set_lr_scale", {"scale": scale, "steps": steps}),
                           step, 200)
        raw.append(window)
        before = len(composed)
        composed = compose_windows([*composed, window])
        assert len(composed) <= before + 2
        assert all(a[1] == b[0] for a, b in itertools.pairwise(composed))  # contiguous
        for t in range(202):
            assert scale_at(composed, t) == pytest.approx(scale_at(raw, t), rel=1e-12), t


def test_a_flood_of_lr_changes_at_one_step_stays_a_few_pieces():
    windows: list[list[float]] = []
    for i in range(1000):
        cmd = command("set_lr_scale", {"scale": (0.5, 2.0, 0.8, 1.25)[i % 4],
                                             "steps": (0, 10, 50)[i % 3]})
        windows = compose_windows([*windows, lr_window(cmd, 40, 100)])
    assert len(windows) <= 3 and all(40 <= w[0] and w[1] <= 100 for w in windows)
    expected = {45: 1.0, 60: 1.0, 95: 1.0}  # the product of the factors covering each step
    for i in range(1000):
        scale, steps = (0.5, 2.0, 0.8, 1.25)[i % 4], (0, 10, 50)[i % 3]
        for t in expected:
            if t <= (40 + steps if steps else 100):
                expected[t] *= scale
    for t, factor in expected.items():
        assert scale_at(windows, t) == pytest.approx(factor, rel=1e-9)
