"""Nothing committed is lost and nothing in the bucket runs (a rollback, a resume, a crafted
checkpoint file), in real `python -m trainer.segment` processes (DeepSpeed on CPU, gloo) over
a real file store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.trainer.helpers import run_segment, tiny_spec, write_spec
from tests.trainer.test_spike_handling import CORRUPT_AT, CORRUPT_STEPS, SPIKY

pytestmark = pytest.mark.e2e


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def result_of(workdir) -> dict:
    return json.loads((workdir / "result.json").read_text())


def test_spike_just_after_a_commit_with_keep_last_one_still_rolls_back(tmp_path, dataset_uri):
    # Commits every 5 steps and retention keep_last=1: the onset at 76 is one step after the
    # commit at 75, so the rollback needs a commit at or before 74. On e3369a3 the rollback
    # deleted 75, found nothing at or before 74 and raised Diverged (the segment crashed).
    spec = tiny_spec(tmp_path / "store", **SPIKY, **{"storage.keep_last": 1}, faults=[
        {"kind": "corrupt_batches", "at_step": CORRUPT_AT, "steps": CORRUPT_STEPS}])
    ok(run_segment(write_spec(spec, tmp_path / "spec.json"), dataset_uri, 100, tmp_path / "w"))
    result = result_of(tmp_path / "w")
    (rb,) = result["outcome"]["rollbacks"]
    assert rb["onset"] == CORRUPT_AT and rb["to_step"] < CORRUPT_AT - 1
    assert result["final_step"] == 100
    committed = CheckpointStore(spec.storage.durable, spec.run_id).list_committed()
    assert committed[-1] == 100 and len(committed) <= 7  # retention still bounds the store


def test_operator_rollback_to_a_step_retention_removed_is_refused_and_deletes_nothing(
        tmp_path, dataset_uri):
    spec = tiny_spec(tmp_path / "store", **{"storage.keep_last": 1, "spikes.enabled": False})
    spec_file = write_spec(spec, tmp_path / "spec.json")
    ok(run_segment(spec_file, dataset_uri, 12, tmp_path / "first"))
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    assert store.list_committed() == [12]
    # The workflow admitted `rollback --to-step 2` and scheduled [2, 20); by then retention
    # had removed every step at or before 2. On e3369a3 the trainer uncommitted 12, found
    # nothing, and started the run over from step 0.
    rollback = {"id": "t/op1", "to_step": 2, "through_step": 12, "skip_data": True,
              "note": "bad shard", "who": "alice"}
    ok(run_segment(spec_file, dataset_uri, 20, tmp_path / "second",
                   extra=("--rollback", json.dumps(rollback))))
    result = result_of(tmp_path / "second")
    assert result["final_step"] == 12 and result["steps_run"] == 0
    assert result["outcome"]["stopped"] == "rollback_refused"
    assert store.list_committed() == [12]
    (refused,) = read_events(spec.storage.durable, spec.run_id, kinds=("rollback_refused",))
    assert refused["payload"]["oldest_step"] == 12 and refused["payload"]["who"] == "alice"
    # applied once: a retry of that segment does not refuse (or apply) it again
    ok(run_segment(spec_file, dataset_uri, 20, tmp_path / "retry", attempt=2,
                   extra=("--rollback", json.dumps(rollback))))
    assert result_of(tmp_path / "retry")["final_step"] == 20
    assert store.list_committed() == [20]


class Payload:
    """What a hostile writer to the bucket puts in a checkpoint file: code run on unpickle."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# The train state's loader is the project's own (trainer/safe_load.py): its refusal is
# tests/trainer/test_safe_load.py's test_pickle_payload_in_a_train_state_file_is_refused, in
# a second; the segment's path through both loaders is this test's (the model states file
# by default, the train state in the soak).
@pytest.mark.parametrize("victim", [
    "mp_rank_00_model_states.pt",
    pytest.param("train_state-rank0.pt", marks=pytest.mark.soak)])
def test_a_pickle_payload_in_a_committed_checkpoint_is_refused_not_run(tmp_path, dataset_uri,
                                                                       victim):
    spec = tiny_spec(tmp_path / "store")
    spec_file = write_spec(spec, tmp_path / "spec.json")
    ok(run_segment(spec_file, dataset_uri, 8, tmp_path / "first"))
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    # Someone with write access to the bucket commits a step 12 whose files hash correctly
    # (they write the manifest too) but whose `victim` runs a shell command when unpickled.
    forged, marker = tmp_path / "forged", tmp_path / "PWNED"
    shutil.copytree(store.path(8), forged, ignore=shutil.ignore_patterns("MANIFEST.json"))
    torch.save({"module": Payload(str(marker))}, forged / victim)  # pickles the payload
    store.commit(12, str(forged), **{"data_cursor": 12})
    ok(run_segment(spec_file, dataset_uri, 16, tmp_path / "second", attempt=2))
    assert not marker.exists(), "the checkpoint's pickle payload ran"
    result = result_of(tmp_path / "second")
    assert result["resumed_from"] == 8 and result["final_step"] == 16
    corrupt = read_events(spec.storage.durable, spec.run_id, kinds=("checkpoint_corrupt",))
    assert [(e["step"], e["payload"]["file"]) for e in corrupt] == [(12, victim)]
    assert "refused to unpickle" in corrupt[0]["payload"]["actual"]
    # the forged step was uncommitted, and the replay committed a real step 12 in its place
    assert store.manifest(12).writer.startswith("trainer")


def test_the_fast_tier_spans_segments_and_keeps_only_what_a_resume_needs(tmp_path,
                                                                         dataset_uri):
    # On e3369a3 each segment kept its own fast-tier checkpoints forever.
    spec = tiny_spec(tmp_path / "store")
    spec_file, fast = write_spec(spec, tmp_path / "spec.json"), tmp_path / "fast" / "ckpt"
    for lo, hi in ((0, 8), (8, 16), (16, 24)):
        ok(run_segment(spec_file, dataset_uri, hi, tmp_path / f"seg-{lo}",
                       extra=("--fast-dir", str(fast))))
    steps = CheckpointStore.local(str(fast)).list_committed()
    assert steps == [24]  # the newest durable copy; nothing else is in flight at the end
    assert result_of(tmp_path / "seg-16")["resumed_from"] == 16
