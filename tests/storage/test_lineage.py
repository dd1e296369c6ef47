"""A rollback is never undone by a copy of the abandoned lineage on another machine's fast
tier. Machine A keeps step 700 on its fast tier; machine B rolls back to 500, uncommits
600 and 700, commits 600 and dies; the retry lands on A. A must resume B's 600, never
re-upload its 700, and its collector must not keep 700 as "newer than the durable newest".
Real writer processes, real fast tiers, file:// and SeaweedFS S3 durable tiers."""

from __future__ import annotations

import os

import pytest

from storage import fast_tier
from storage.checkpoints import CheckpointStore
from storage.events import EventLog
from storage.rollback import (
    Branch,
    abandoned,
    current_lineage,
    lineage_of,
    read_branches,
    roll_back,
    start_lineage,
)
from tests.storage.ckpt_helpers import (
    BACKENDS,
    durable_url,
    kinds,
    payload,
    save,
    tiered,
    write_files,
)

RUN = "r"


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path) -> str:
    """A fresh durable root on each backend (file://, real SeaweedFS S3)."""
    return durable_url(request.param, tmp_path, request)


def machine(tmp_path, name: str) -> str:
    """A machine's fast tier root, with the run's directory made by its lease."""
    return str(tmp_path / name / "fast")


def fast_dir(root: str) -> str:
    return fast_tier.store_dir(root, RUN)


def train_on_a(durable: str, tmp_path) -> str:
    """Segment 1 on machine A: 500, 600, 700 committed; A's fast tier keeps 700."""
    root = machine(tmp_path, "a")
    with fast_tier.lease(root, RUN, durable):
        ckpt = tiered(durable, fast_dir(root))
        try:
            for step in (500, 600, 700):
                save(ckpt, step)
            ckpt.drain()
        finally:
            ckpt.close()
    assert CheckpointStore.local(fast_dir(root)).list_committed() == [700]
    return root


def roll_back_on_b(durable: str, tmp_path) -> None:
    """Segment 2 on machine B: resume 700, a spike, roll back to 500, commit 600, die."""
    root = machine(tmp_path, "b")
    with fast_tier.lease(root, RUN, durable):
        ckpt = tiered(durable, fast_dir(root))
        try:
            assert ckpt.resume(str(tmp_path / "b" / "restore"), None)[0].step == 700
            stores = [ckpt.durable, ckpt.fast]
            restored, gone = roll_back(
                500, lambda bound: ckpt.resume(str(tmp_path / "b" / "restore"), bound),
                lambda found: found[0].step, stores, branch=ckpt.branch)
            assert restored[0].step == 500 and gone == [600, 700]
            save(ckpt, 600)
            ckpt.drain()
        finally:
            ckpt.close()


@pytest.mark.process
def test_a_retry_on_a_machine_holding_an_abandoned_copy_resumes_the_rollbacks_lineage(
        url, tmp_path):
    durable = url
    a = train_on_a(durable, tmp_path)
    roll_back_on_b(durable, tmp_path)
    with fast_tier.lease(a, RUN, durable):
        ckpt = tiered(durable, fast_dir(a))
        try:
            man, _, tier = ckpt.resume(str(tmp_path / "a" / "restore"), None)
            ckpt.drain()
        finally:
            ckpt.close()
    assert (man.step, tier) == (600, "durable")
    assert CheckpointStore(durable, RUN).list_committed() == [500, 600]
    assert 700 not in CheckpointStore.local(fast_dir(a)).list_committed()


@pytest.mark.process
def test_gc_does_not_keep_a_fast_copy_of_an_abandoned_lineage(url, tmp_path):
    durable = url
    a = train_on_a(durable, tmp_path)
    roll_back_on_b(durable, tmp_path)
    fast_tier.collect_garbage(a, keep_run="another-run")  # before another run's activity on A
    assert not os.path.exists(fast_dir(a)) or \
        CheckpointStore.local(fast_dir(a)).list_committed() == []


@pytest.mark.process
def test_a_snapshot_written_before_another_machines_rollback_is_never_uploaded(tmp_path):
    # A's segment still runs (lineage 0) when B's rollback to 500 is recorded: A's next
    # snapshot, 800, continues the abandoned trajectory and must not become a commit.
    durable = str(tmp_path / "durable")
    a = machine(tmp_path, "a")
    with fast_tier.lease(a, RUN, durable):
        ckpt = tiered(durable, fast_dir(a), events=EventLog(durable, RUN, "trainer-a"))
        try:
            for step in (500, 600, 700):
                save(ckpt, step)
            ckpt.drain()
            roll_back_on_b(durable, tmp_path)
            save(ckpt, 800)
            ckpt.drain()
        finally:
            ckpt.close()
    assert CheckpointStore(durable, RUN).list_committed() == [500, 600]
    assert 800 not in CheckpointStore.local(fast_dir(a)).list_committed()
    assert "checkpoint_abandoned" in kinds(durable)


@pytest.mark.process
def test_a_rollback_cut_short_after_its_record_is_finished_by_the_next_resume(tmp_path):
    # The record is written before the uncommit: a crash in between leaves 600 and 700 of
    # the abandoned lineage committed. The next resume uncommits them and restores 500, and
    # the replay's 600 (the new lineage) commits instead of finding the old manifest.
    durable = str(tmp_path / "durable")
    a = train_on_a(durable, tmp_path)
    store = CheckpointStore(durable, RUN)
    start_lineage(store, 500, [600, 700])
    with fast_tier.lease(a, RUN, durable):
        ckpt = tiered(durable, fast_dir(a))
        try:
            man, _, tier = ckpt.resume(str(tmp_path / "restore"), None)
            assert (man.step, tier, ckpt.lineage) == (500, "durable", 1)
            assert store.list_committed() == [500]
            save(ckpt, 600)
            ckpt.drain()
        finally:
            ckpt.close()
    assert lineage_of(store.manifest(600)) == 1


def test_a_manifest_without_a_lineage_is_of_the_runs_first(tmp_path):
    store = CheckpointStore(str(tmp_path / "d"), RUN)
    man = store.commit(10, write_files(tmp_path / "s10", payload(10, 64)))
    assert "lineage" not in man.extra and lineage_of(store.manifest(10)) == 0
    assert read_branches(store) == ()


def test_abandoned_follows_each_rollback_back_to_its_restored_step():
    # lineage 0: ... 700; rollback to 300 (lineage 1): 400', 500'; rollback to 500'
    # (lineage 2): 600''; rollback to 350 restores 300 (lineage 3).
    branches = (Branch(lineage=1, restored_step=300), Branch(lineage=2, restored_step=500))
    assert not abandoned(300, 0, branches) and abandoned(400, 0, branches)
    assert abandoned(700, 0, branches)
    assert not abandoned(500, 1, branches) and abandoned(600, 1, branches)
    assert not abandoned(600, 2, branches) and not abandoned(10**6, 2, branches)
    branches += (Branch(lineage=3, restored_step=300),)
    assert abandoned(500, 1, branches) and abandoned(600, 2, branches)
    assert not abandoned(300, 0, branches) and current_lineage(branches) == 3


def test_lineage_records_are_new_keys_never_overwritten(tmp_path):
    store = CheckpointStore(str(tmp_path / "d"), RUN)
    assert start_lineage(store, 500, [600, 700]) == 1
    assert start_lineage(store, 300, [500]) == 2
    assert read_branches(store) == (Branch(lineage=1, restored_step=500, abandoned=(600, 700)),
                                    Branch(lineage=2, restored_step=300, abandoned=(500,)))


def test_gc_keeps_a_restored_fast_only_checkpoint_below_an_abandoned_commit(tmp_path):
    # A rollback restored 500 from A's fast tier (never uploaded), recorded its lineage and
    # died before uncommitting 600. The lingering 600 is abandoned: it is not "the durable
    # newest" that makes 500 an old copy, and 500 is the only copy of the restore target.
    durable = str(tmp_path / "durable")
    a = machine(tmp_path, "a")
    with fast_tier.lease(a, RUN, durable):
        fast = CheckpointStore.local(fast_dir(a))
        write_files(fast.path(500), payload(500, 64))
        fast.commit_in_place(500, extra={"lineage": 0})
    store = CheckpointStore(durable, RUN)
    store.commit(600, write_files(tmp_path / "s600", payload(600, 64)), extra={"lineage": 0})
    start_lineage(store, 500, [600])
    fast_tier.collect_garbage(a, keep_run="another-run")
    assert fast.list_committed() == [500] and not fast.verify(500)
