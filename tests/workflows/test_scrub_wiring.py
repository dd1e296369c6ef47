"""TrainingRun starts the checkpoint scrub (activities/scrub.py) on the data queue beside its
segments, every storage.scrub_every segments, on the real Temporal dev server with the stub
activities of stub_run.py; a failed scrub never fails the run; its history replays."""

from __future__ import annotations

import asyncio
import json
import uuid

from temporalio.worker import Replayer

from activities.contracts import STAGES
from tests.workflows.stub_run import HISTORIES, Harness, scenario, spec_for
from tests.workflows.test_replay import load
from workflows.sweep import Sweep
from workflows.training_run import TrainingRun


@scenario
async def test_the_run_scrubs_beside_every_segment_after_the_first_and_replays(h: Harness):
    spec = spec_for(f"stub-scrub-{uuid.uuid4().hex[:6]}", **{"train.total_steps": 40})
    result = await (await h.start(spec)).result()

    assert result["status"] == "completed" and result["workflow_runs"] == 4
    assert len(h.stubs.segments) == 4
    # segments 2, 3 and 4 each ran beside a pass over what the ones before them committed
    assert len(h.stubs.scrubs) == 3
    assert all(s.spec["run_id"] == spec.run_id for s in h.stubs.scrubs)
    assert all(s.spec["storage"]["durable"] == "file:///stub/store" for s in h.stubs.scrubs)
    for history in await h.histories(spec.run_id):
        replayed = await Replayer(workflows=[TrainingRun, Sweep]).replay_workflow(history)
        assert replayed.replay_failure is None


@scenario
async def test_scrub_every_spaces_the_passes_and_zero_turns_them_off(h: Harness):
    spaced = spec_for(f"stub-scrub2-{uuid.uuid4().hex[:6]}", **{
        "train.total_steps": 50, "storage.scrub_every": 2})
    await (await h.start(spaced)).result()
    assert len(h.stubs.scrubs) == 2  # before segments 3 and 5 (after 2 and 4 segments)

    off = spec_for(f"stub-scrub0-{uuid.uuid4().hex[:6]}", **{"storage.scrub_every": 0})
    await (await h.start(off)).result()
    assert [s.spec["run_id"] for s in h.stubs.scrubs] == [spaced.run_id] * 2


@scenario
async def test_a_failed_scrub_is_not_the_runs_failure(h: Harness):
    h.stubs.scrub_fails = True
    spec = spec_for(f"stub-scrubf-{uuid.uuid4().hex[:6]}", **{"train.total_steps": 30})
    result = await asyncio.wait_for((await h.start(spec)).result(), 30)
    assert result["status"] == "completed" and result["stages"] == list(STAGES)
    assert len(h.stubs.scrubs) == 2


def scheduled(path) -> tuple[set[str], set[str]]:
    """(activity types scheduled, patch ids marked) in a recorded history."""
    types, patches = set(), set()
    for e in load(path).events:
        if e.HasField("activity_task_scheduled_event_attributes"):
            types.add(e.activity_task_scheduled_event_attributes.activity_type.name)
        if e.HasField("marker_recorded_event_attributes"):
            for p in e.marker_recorded_event_attributes.details.values():
                data = json.loads(p.payloads[0].data or b"null")
                if isinstance(data, dict) and data.get("id"):
                    patches.add(data["id"])
    return types, patches


def test_replay_fixtures_cover_runs_with_the_scrub_and_runs_from_before_it():
    """tests/workflows/test_replay.py replays both: the scrub's patch marks the new set."""
    new = scheduled(HISTORIES / "5e46d4b" / "completed.1.json")
    assert "scrub_checkpoints" in new[0] and "checkpoint_scrub" in new[1]
    for old in ("issue17", "2cf21d9"):
        types, patches = scheduled(HISTORIES / old / "completed.1.json")
        assert "scrub_checkpoints" not in types and "checkpoint_scrub" not in patches
