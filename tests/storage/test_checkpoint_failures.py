"""Failure behaviour of checkpoints, each on file:// and on real SeaweedFS s3://."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from common.errors import StorageUnavailable
from ops.chaos import flip_byte
from storage.checkpoints import MANIFEST, CheckpointStore
from storage.events import EventLog, read_events
from tests.storage.ckpt_helpers import (
    durable,
    payload,
    save,
    small_disk,
    tiered,
    write_files,
)

__all__ = ["durable", "small_disk"]  # fixtures


def two_commits(durable, fast_dir) -> None:
    ckpt = tiered(durable, fast_dir)
    save(ckpt, 1)
    save(ckpt, 2)
    ckpt.drain()
    ckpt.close()


@pytest.mark.parametrize("victim", sorted(payload(2)))
@pytest.mark.process
def test_flipped_byte_in_any_durable_file_is_reported_and_resume_falls_back(
        durable, tmp_path, victim):
    two_commits(durable, tmp_path / "fast-a")
    store = CheckpointStore(durable, "r")
    flip_byte(store.fs, store.path(2, victim))
    events = EventLog(durable, "r", "test")
    corrupt = []
    ckpt = tiered(durable, tmp_path / "fast-b", events=events)  # a new machine: no fast copy
    man, _, tier = ckpt.resume(str(tmp_path / "restore"), None, on_corrupt=corrupt.append)
    ckpt.close()
    assert (man.step, tier) == (1, "durable")
    assert [(c.step, c.file) for c in corrupt] == [(2, victim)]
    assert store.verify(1) == [] and [p.file for p in store.verify(2)] == [victim]


@pytest.mark.process
def test_flipped_byte_in_the_fast_copy_falls_back_to_the_durable_copy(durable, tmp_path):
    two_commits(durable, tmp_path / "fast")
    fast = CheckpointStore.local(str(tmp_path / "fast"))
    assert fast.list_committed() == [2]  # the newest durable step stays local for a retry
    flip_byte(fast.fs, fast.path(2, "mp_rank_00_model_states.pt"))
    corrupt = []
    ckpt = tiered(durable, tmp_path / "fast")
    man, _, tier = ckpt.resume(str(tmp_path / "restore"), None, on_corrupt=corrupt.append)
    ckpt.close()
    assert (man.step, tier) == (2, "durable") and corrupt[0].file == "mp_rank_00_model_states.pt"
    assert fast.list_committed() == []  # the corrupt local copy is gone


KILLED_WRITER = """
import sys, time
import storage.checkpoints as checkpoints
store = checkpoints.CheckpointStore(sys.argv[1], "r")
put = checkpoints.put_file_durable
def slow_put(*a, **k):  # a slow link, so the parent can kill us between files
    put(*a, **k)
    print("uploaded", flush=True)
    time.sleep(30)
checkpoints.put_file_durable = slow_put
store.commit(2, sys.argv[2])
"""


@pytest.mark.process
def test_writer_sigkilled_mid_upload_leaves_nothing_visible_and_next_save_and_resume_work(
        durable, tmp_path):
    store = CheckpointStore(durable, "r")
    store.commit(1, write_files(tmp_path / "s1", payload(1)))
    local = write_files(tmp_path / "s2", payload(2))
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, durable, local],
                             stdout=subprocess.PIPE, text=True, env={**os.environ,
                             "PYTHONPATH": os.getcwd()})
    for line in child.stdout:  # structlog shares stdout
        if line.strip() == "uploaded":  # one file is up, no manifest yet
            break
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert store.fs.exists(store.path(2)) and not store.fs.exists(store.path(2, MANIFEST))
    assert store.list_committed() == [1] and store.latest_committed() == 1
    assert store.fetch_latest(str(tmp_path / "restore")).step == 1
    # The next save of the same step completes and verifies; resume now picks it.
    assert store.commit(2, local).step == 2
    assert store.verify(2) == [] and store.fetch_latest(str(tmp_path / "r2")).step == 2


@pytest.mark.process
def test_uploader_killed_after_fast_commit_resumes_locally_and_reuploads(durable, tmp_path):
    ckpt = tiered(durable, tmp_path / "fast")
    save(ckpt, 1)
    ckpt.drain()
    ckpt.close()  # the process "dies" before step 2 reaches the durable tier:
    fast = CheckpointStore.local(str(tmp_path / "fast"))
    write_files(fast.path(2), payload(2))
    fast.commit_in_place(2, parent=1)
    ckpt = tiered(durable, tmp_path / "fast")
    man, root, tier = ckpt.resume(str(tmp_path / "restore"), None)
    assert (man.step, tier, root) == (2, "fast", fast.root)
    ckpt.drain()
    ckpt.close()
    assert CheckpointStore(durable, "r").list_committed() == [1, 2]
    assert CheckpointStore(durable, "r").verify(2) == []


@pytest.mark.process
def test_disk_full_on_the_fast_tier_is_a_clear_event_and_keeps_the_last_commit(
        durable, tmp_path, small_disk):
    events = EventLog(durable, "r", "test")
    ckpt = tiered(durable, small_disk, events=events)
    save(ckpt, 1)
    ckpt.drain()
    with pytest.raises(OSError) as full:
        write_files(ckpt.prepare(2), payload(2, size=2 << 20))  # 1 MiB disk
    error = ckpt.write_failed(2, full.value)
    ckpt.close()
    assert isinstance(error, StorageUnavailable) and "step 2" in str(error)
    failed = read_events(durable, "r", kinds=("checkpoint_failed",))
    assert [(e["step"], e["payload"]["tier"], e["payload"]["reason"]) for e in failed] == [
        (2, "fast", "disk_full")]
    assert not os.path.exists(ckpt.fast.path(2))  # the partial save is cleaned up
    assert CheckpointStore(durable, "r").list_committed() == [1]
    assert CheckpointStore(durable, "r").verify(1) == [] and ckpt.fast.verify(1) == []


def test_a_manifest_is_never_overwritten(durable, tmp_path):
    store = CheckpointStore(durable, "r")
    first = store.commit(3, write_files(tmp_path / "a", payload(3)), writer="a")
    before = store.fs.cat_file(store.path(3, MANIFEST))
    again = store.commit(3, write_files(tmp_path / "b", payload(3)), writer="b")
    assert again.writer == first.writer == "a"
    assert store.fs.cat_file(store.path(3, MANIFEST)) == before
    from storage.fs import put_new
    with pytest.raises(FileExistsError):
        put_new(store.fs, store.path(3, MANIFEST), b"{}")
    assert store.fs.cat_file(store.path(3, MANIFEST)) == before
