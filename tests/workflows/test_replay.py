"""Recorded TrainingRun histories replay on today's workflow code.

A run in flight when a new worker is deployed is replayed by the new code from its history;
a change that schedules different commands (an activity, a local activity, a timer, a child,
a search-attribute upsert, continue-as-new) or reads an older carry differently fails that
run's next workflow task with a NondeterminismError. This test replays every history under
tests/workflows/histories/<label>/ with the Replayer, so such a change fails CI instead.

The fixtures are the stub runs of test_training_run_stubs.py (a completed run with its sweep
child and a continue-as-new; paused then resumed; two rollbacks at one boundary with the
pending one carried across continue-as-new; an abort) and, from the `issue17` directory on, of
test_headline.py (a spec with relative paths, anchored at the orchestrator's root), each run
of a chain one file. `<label>` names the workflow code that recorded them: a commit, or a
name for code not yet committed when recorded. 4c7ad72 is the code before the typed
operator inputs and the rewind -> rollback rename (its carries hold the old `rewind` /
`rewind_pins` keys); 2cf21d9 the code before the headline memo and anchored paths; `issue17` the code that added them, whose
new commands (memo upserts, the `spec_root` local activity, the memo passed on at
continue-as-new) are behind `workflow.patched("headline_memo")` and
`workflow.patched("anchor_paths")`, so the two older directories replay without them.
5e46d4b adds the checkpoint scrub beside the segments (`scrub_checkpoints` on the data
queue, behind `workflow.patched("checkpoint_scrub")`; test_scrub_wiring.py checks which
sets hold it). b2372d4 holds a Sweep whose suggestions came from optuna (test_sweep_optuna.py):
its `suggest_trials` markers carry each point's source (the scaling-law prior first) and the
distributions; the older Sweeps' markers (initial design, no distributions) replay beside it,
since the sweep's commands (one suggest_trials a round, then its trials) did not change.
`sweep_pruning` holds a Sweep with sweep.pruning (test_sweep_pruning.py, recorded by the code
that added it): each trial a segment per rung, an evaluate and a `prune_trial` local
activity at each boundary but the last, the pruned trials stopping there. Pruning off, the
Sweep issues the commands of the older sweep fixtures, which replay unpatched.
`distill_stage` holds a run with the distill stage (test_distill_stage.py): after promotion,
two TrainingRun children (the student, its no-teacher baseline), behind
`workflow.patched("distill_stage")`; a spec without `distill` schedules no child there.

`upgrade_a25d676` holds a real run's chain (tests/e2e/test_upgrade_mid_run.py, soak) that
started on the release at a25d676 and finished on the next: its workers were all replaced
mid-segment, after a continue-as-new, so the second history holds workflow tasks of both
releases; it replays here on today's code.

Keep every directory. Record a new one (never over an old one) when a change makes new
histories the old fixtures do not cover, with the workflow code of that commit:
    MAINSPRING_RECORD_HISTORIES=$(git rev-parse --short HEAD) \
        .venv/bin/pytest tests/workflows/test_training_run_stubs.py tests/workflows/test_headline.py
A change that must break replay on purpose goes behind `workflow.patched(...)` (as
`claim_run`, `pin_rollback`, `decide_failures`, `anchor_paths` and `headline_memo` do), so
the old histories keep replaying. docs/operations.md says why patches, not worker versioning.
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


def test_the_newest_fixtures_hold_the_patched_commands_and_the_older_ones_do_not():
    """Replay covers both sides of each patch: histories recorded with the memo upserts and
    the anchored paths (issue17), and histories from before them (2cf21d9)."""
    def commands(path: Path) -> set[str]:
        """Patch ids, local activity types and `memo` when the memo was upserted."""
        found = set()
        for e in load(path).events:
            if e.HasField("workflow_properties_modified_event_attributes"):
                found.add("memo")
            if e.HasField("marker_recorded_event_attributes"):
                for p in e.marker_recorded_event_attributes.details.values():
                    data = json.loads(p.payloads[0].data or b"null")
                    if isinstance(data, dict):
                        found.add(data.get("id") or data.get("activity_type") or "")
        return found

    new = commands(HISTORIES / "issue17" / "relative_paths.0.json")
    old = commands(HISTORIES / "2cf21d9" / "completed.0.json")
    assert {"anchor_paths", "spec_root", "headline_memo", "memo", "claim_run"} <= new
    assert {"anchor_paths", "spec_root", "headline_memo", "memo"}.isdisjoint(old)
    assert "claim_run" in old


def test_the_optuna_sweep_fixture_recorded_the_prior_first_and_the_distributions():
    results = []
    for e in load(HISTORIES / "b2372d4" / "optuna.sweep.json").events:
        if e.HasField("marker_recorded_event_attributes"):
            details = e.marker_recorded_event_attributes.details
            if "result" in details:
                results.append(json.loads(details["result"].payloads[0].data or b"null"))
    suggested = [r for r in results if isinstance(r, dict) and "sources" in r]
    assert suggested[0]["sources"][0] == "prior" and len(suggested) >= 2
    assert all(set(r["distributions"]) == {"lr", "weight_decay"} for r in suggested)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_recorded_history_replays_on_todays_workflow_code(path: Path):
    history = load(path)
    assert len(history.events) > 10
    # raises on nondeterminism and on a workflow task the code now fails (e.g. an old carry
    # it cannot read); the histories' own outcomes (an abort's RunAborted) are not errors
    result = asyncio.run(Replayer(workflows=[TrainingRun, Sweep]).replay_workflow(history))
    assert result.replay_failure is None
