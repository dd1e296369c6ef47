"""The chaos run's silent corruption, end to end: a byte flipped in a committed durable
checkpoint that nothing reads again is found by the data worker's scrub beside the next
segment — real Temporal, real worker processes, DeepSpeed trainers, a file:// store."""

from __future__ import annotations

import hashlib

import pytest

from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.e2e.runs import run_in_background, tiny_spec, wait_for

# Soak: the same claim in two faster parts, both in the default suite:
# tests/activities/test_scrub.py (the data worker's scrub activity, run by a real worker on
# the real dev server against a real file:// store, finds a flipped byte, records
# checkpoint_corrupt and uncommits the step) and tests/workflows/test_scrub_wiring.py (the
# workflow schedules that scrub beside every segment after the first, and replays).
pytestmark = [pytest.mark.e2e, pytest.mark.soak]

VICTIM = "mp_rank_00_model_states.pt"


def test_a_flipped_byte_in_an_old_commit_is_found_by_the_scrub_and_uncommitted(
        temporal_server, fleet_factory, tmp_path):
    spec = tiny_spec("e2e-scrub", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **{"sweep.enabled": False})
    fleet_factory()
    runner, box = run_in_background(temporal_server.address, spec)
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    # during the first segment, once step 30 is durable: rot in step 20, which no restore
    # reads (the segment trains on from memory; the next resumes from step 40)
    wait_for(lambda: 30 in store.list_committed(), 300, "step 30 committed", every_s=0.1)
    path = store.path(20, VICTIM)
    data = bytearray(store.fs.cat_file(path))
    expected = hashlib.sha256(data).hexdigest()
    data[len(data) // 3] ^= 0x10
    store.fs.pipe_file(path, bytes(data))
    runner.join(600)

    assert "error" not in box and box["result"]["status"] == "completed", box
    [corrupt] = read_events(spec.storage.durable, spec.run_id, kinds=("checkpoint_corrupt",))
    assert corrupt["step"] == 20 and corrupt["writer"].startswith("scrub-")
    assert corrupt["payload"] == {"file": VICTIM, "expected": expected,
                                  "actual": hashlib.sha256(data).hexdigest()}
    [fault] = read_events(spec.storage.durable, spec.run_id, kinds=("fault",))
    assert fault["payload"]["kind"] == "checkpoint_corrupt"
    assert fault["payload"]["detected_by"] == "scrub"
    [recovered] = [e for e in read_events(spec.storage.durable, spec.run_id, kinds=("recovered",))
                   if e["payload"].get("by") == "scrub"]
    assert recovered["payload"]["fallback_step"] == 10
    committed = store.list_committed()
    assert 20 not in committed and {0, 10, 30, 40, spec.train.total_steps} <= set(committed)
    assert store.verify(10) == []
