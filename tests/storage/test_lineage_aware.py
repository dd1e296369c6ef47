"""Retention, the scrub and the durable commit apply the lineage rule resume and the fast
tier's collector apply (storage/rollback.py): a commit of a lineage a rollback left is no
checkpoint — not the newest, not a fallback — and a writer on such a lineage cannot slip a
commit past a rollback recorded on another machine. Real stores: file:// and SeaweedFS S3."""

from __future__ import annotations

from storage.checkpoints import CheckpointStore
from storage.events import EventLog
from storage.retention import RetentionPolicy, apply_retention
from storage.rollback import (
    commit_unless_left_behind,
    lineage_of,
    read_branches,
    start_lineage,
    uncommit_after,
)
from storage.scrub import ScrubPolicy, scrub
from tests.storage.ckpt_helpers import durable, payload, write_files

__all__ = ["durable"]  # fixture
RUN = "r"


def commit(store: CheckpointStore, tmp_path, step: int, lineage: int):
    local = write_files(tmp_path / f"s{step}-{lineage}", payload(step, 256))
    return store.commit(step, local, extra={"lineage": lineage})


def test_retention_does_not_count_an_abandoned_lineages_commit_as_the_newest(tmp_path):
    # 100..300 on lineage 0; a rollback to 300 starts lineage 1; a writer still on lineage
    # 0 commits 800 (the abandoned trajectory); lineage 1 commits 400. Keeping the newest
    # two must keep 300 and 400 — not 400 and the abandoned 800.
    store = CheckpointStore(str(tmp_path / "durable"), RUN)
    for step in (100, 200, 300):
        commit(store, tmp_path, step, 0)
    assert start_lineage(store, 300, []) == 1
    commit(store, tmp_path, 800, 0)
    commit(store, tmp_path, 400, 1)

    apply_retention(store, RetentionPolicy(keep_last=2), newest_verified=400)

    assert store.list_committed() == [300, 400]


def test_scrub_reads_the_live_newest_not_an_abandoned_commit(tmp_path):
    # lineage 0 committed 100 and 300; a rollback to 100 started lineage 1, which committed
    # 200 — whose bytes then rot. The lingering 300 is no fallback: the scrub must read 200.
    url = str(tmp_path / "durable")
    store = CheckpointStore(url, RUN)
    commit(store, tmp_path, 100, 0)
    commit(store, tmp_path, 300, 0)
    start_lineage(store, 100, [300])
    commit(store, tmp_path, 200, 1)
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    store.fs.pipe_file(store.path(200, name), b"rotten")

    with EventLog(url, RUN, "scrub") as events:
        report = scrub(store, events, ScrubPolicy(newest=1, mb_per_s=0.0))

    assert report.needed == [200] and report.corrupt == [200]
    assert report.uncommitted == [200]  # the verified 100 below it is the fallback
    assert store.list_committed() == [100]  # the abandoned 300 dropped, as a resume would


def test_a_commit_racing_another_machines_rollback_does_not_stay_committed(durable, tmp_path):
    # Machine A (lineage 0) checked the lineage records before committing 300; machine B's
    # rollback to 100 lands in between — its record, then its uncommit, which finds no 300
    # yet — and only then does A's manifest go in. A's re-read after its put-if-absent
    # must find B's record and take the commit back.
    store = CheckpointStore(durable, RUN)
    commit(store, tmp_path, 100, 0)

    def rolled_back_elsewhere_then_committed():
        lineage = start_lineage(CheckpointStore(durable, RUN), 100, [])
        assert uncommit_after(100, [CheckpointStore(durable, RUN)]) == []
        assert lineage == 1
        return commit(store, tmp_path, 300, 0)

    got = commit_unless_left_behind(store, 300, 0, rolled_back_elsewhere_then_committed)

    assert got == 1  # the run's current lineage: A's snapshot is refused
    assert store.list_committed() == [100]
    assert [b.lineage for b in read_branches(store)] == [1]


def test_a_commit_after_the_rollback_on_its_lineage_stays(durable, tmp_path):
    store = CheckpointStore(durable, RUN)
    commit(store, tmp_path, 100, 0)
    start_lineage(store, 100, [])

    got = commit_unless_left_behind(store, 200, 1, lambda: commit(store, tmp_path, 200, 1))

    assert lineage_of(got) == 1 and store.list_committed() == [100, 200]
