"""The fast tier is bounded: other runs' durable-backed copies are freed,
the only copy of anything is kept, a finished run's directory goes, a full disk fails at
once. Real local directories and a real file durable store; the lease is a real flock."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.errors import ERROR_TYPES, NON_RETRYABLE, DiskFull
from storage import fast_tier
from storage.checkpoints import CheckpointStore
from tests.storage.ckpt_helpers import payload, write_files


def leftover_run(root, run_id: str, durable_steps: list[int], fast_steps: list[int]) -> str:
    """What an earlier run left on this machine: fast copies, some also durable."""
    durable = str(root / "durable")
    with fast_tier.lease(str(root / "fast"), run_id, durable):  # makes the run's directory
        os.makedirs(os.path.join(fast_tier.run_dir(str(root / "fast"), run_id), "segments"))
    fast = CheckpointStore.local(fast_tier.store_dir(str(root / "fast"), run_id))
    store = CheckpointStore(durable, run_id)
    for step in sorted(set(durable_steps) | set(fast_steps)):
        files = write_files(root / "src" / run_id / str(step), payload(step, 64))
        if step in durable_steps:
            store.commit(step, files)
        if step in fast_steps:
            write_files(fast.path(step), payload(step, 64))
            fast.commit_in_place(step)
    return fast_tier.run_dir(str(root / "fast"), run_id)


def test_fast_steps_to_delete_keeps_only_fast_only_snapshots_newer_than_durable():
    assert fast_tier.fast_steps_to_delete([10, 20, 30, 40], [10, 20, 30]) == [10, 20, 30]
    assert fast_tier.fast_steps_to_delete([5, 40], [10, 30]) == [5]
    assert fast_tier.fast_steps_to_delete([40], []) == []


def test_a_finished_runs_leftovers_are_removed_whole(tmp_path):
    gone = leftover_run(tmp_path, "old", durable_steps=[10, 20], fast_steps=[20])
    removed = fast_tier.collect_garbage(str(tmp_path / "fast"), keep_run="current")
    assert removed == [gone] and not os.path.exists(gone)


def test_a_snapshot_whose_upload_never_finished_is_kept(tmp_path):
    directory = leftover_run(tmp_path, "old", durable_steps=[10], fast_steps=[10, 20])
    fast_tier.collect_garbage(str(tmp_path / "fast"), keep_run="current")
    fast = CheckpointStore.local(os.path.join(directory, "ckpt"))
    assert fast.list_committed() == [20] and not fast.verify(20)


@pytest.mark.process
def test_the_current_run_and_runs_held_by_another_activity_are_not_touched(tmp_path):
    mine = leftover_run(tmp_path, "mine", durable_steps=[10], fast_steps=[10])
    held = leftover_run(tmp_path, "held", durable_steps=[10], fast_steps=[10])
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, '.');"
        "from storage import fast_tier;"
        f"cm = fast_tier.lease({str(tmp_path / 'fast')!r}, 'held', {str(tmp_path / 'durable')!r});"
        "cm.__enter__();"
        "print('held', flush=True); time.sleep(60)")],
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert fast_tier.collect_garbage(str(tmp_path / "fast"), keep_run="mine") == []
        assert os.path.exists(mine) and os.path.exists(held)
    finally:
        holder.kill()
        holder.wait()
    assert fast_tier.collect_garbage(str(tmp_path / "fast"), keep_run="mine") == [held]


def test_a_run_whose_durable_store_is_unreachable_is_left_for_later(tmp_path, monkeypatch):
    directory = leftover_run(tmp_path, "old", durable_steps=[10], fast_steps=[10])
    with open(os.path.join(directory, fast_tier.RUN_FILE), "w") as f:
        f.write('{"run_id": "old", "durable": "s3://no-such-bucket-here/x"}')
    for key, value in {"AWS_ENDPOINT_URL": "http://127.0.0.1:9",  # nothing listens there
                       "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}.items():
        monkeypatch.setenv(key, value)
    assert fast_tier.collect_garbage(str(tmp_path / "fast"), keep_run="current") == []
    assert os.path.exists(directory)


def test_release_removes_the_finished_runs_checkpoints_and_gc_the_rest(tmp_path):
    directory = leftover_run(tmp_path, "done", durable_steps=[10], fast_steps=[10])
    record = os.path.join(directory, "segments", "000000000-000000010", "progress.jsonl")
    os.makedirs(os.path.dirname(record))
    open(record, "w").close()
    fast_tier.release(str(tmp_path / "fast"), "done")
    assert not os.path.exists(fast_tier.store_dir(str(tmp_path / "fast"), "done"))
    assert os.path.exists(record)  # the segments' records outlive the run's checkpoints
    assert fast_tier.collect_garbage(str(tmp_path / "fast"), keep_run="next") == [directory]
    assert not os.path.exists(directory)


def test_a_disk_too_small_for_the_segments_checkpoints_fails_at_once_naming_the_fix(tmp_path):
    with pytest.raises(DiskFull) as err:
        fast_tier.ensure_space(str(tmp_path), need_bytes=1 << 62)
    assert err.value.field == "storage.fast" and "free space" in str(err.value)
    assert "DiskFull" in NON_RETRYABLE and ERROR_TYPES["DiskFull"] is DiskFull
    fast_tier.ensure_space(str(tmp_path), need_bytes=1)
