"""Recorded TrainingRun histories replay on today's workflow code (issue 12, item 8).

A run in flight when a new worker is deployed is replayed by the new code from its history;
a change that schedules different commands (an activity, a local activity, a timer, a child,
a search-attribute upsert, continue-as-new) or reads an older carry differently fails that
run's next workflow task with a NondeterminismError. This test replays every history under
tests/workflows/histories/<label>/ with the Replayer, so such a change fails CI instead.

The fixtures are the stub runs of test_training_run_stubs.py (a completed run with its sweep
child and a continue-as-new; paused then resumed; two rollbacks at one boundary with the
pending one carried across continue-as-new; an abort), each run of a chain one file.
`<label>` is the commit of the workflow code that recorded them: 4c7ad72 is the code before
issue 12's typed operator inputs and the rewind -> rollback rename (its carries hold the
old `rewind` / `rewind_pins` keys).

Keep every directory. Record a new one (never over an old one) when a change makes new
histories the old fixtures do not cover, with the workflow code of that commit:
    MAINSPRING_RECORD_HISTORIES=$(git rev-parse --short HEAD) \
        .venv/bin/pytest tests/workflows/test_training_run_stubs.py
A change that must break replay on purpose goes behind `workflow.patched(...)` (as
`claim_run` and `pin_rollback` do), so the old histories keep replaying.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from workflows.sweep import Sweep
from workflows.training_run import TrainingRun

HISTORIES = Path(__file__).parent / "histories"
FIXTURES = sorted(HISTORIES.glob("*/*.json"))


def load(path: Path) -> WorkflowHistory:
    raw = json.loads(path.read_text())
    started = raw["events"][0]["workflowExecutionStartedEventAttributes"]
    # the workflow id matters: TrainingRun names its Sweep child after it
    return WorkflowHistory.from_json(started["workflowId"], raw)


def test_there_are_fixtures_of_every_kind_of_run():
    scenarios = {p.name.split(".")[0] for p in FIXTURES}
    assert {"completed", "paused_resumed", "rollback", "aborted"} <= scenarios, FIXTURES
    kinds = {load(p).events[0].workflow_execution_started_event_attributes.workflow_type.name
             for p in FIXTURES}
    assert kinds == {"TrainingRun", "Sweep"}


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_recorded_history_replays_on_todays_workflow_code(path: Path):
    history = load(path)
    assert len(history.events) > 10
    # raises on nondeterminism and on a workflow task the code now fails (e.g. an old carry
    # it cannot read); the histories' own outcomes (an abort's RunAborted) are not errors
    result = asyncio.run(Replayer(workflows=[TrainingRun, Sweep]).replay_workflow(history))
    assert result.replay_failure is None
