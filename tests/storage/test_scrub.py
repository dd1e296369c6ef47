"""The background scrub (storage/scrub.py): which checkpoints a fallback needs (pure, literal
sequences), and on real file:// and SeaweedFS S3 stores that a byte flipped in a committed
checkpoint nobody reads again is found, recorded with its evidence and uncommitted while an
older verified commit remains — and that an intact store is left as it was."""

from __future__ import annotations

import hashlib
import time

from storage.checkpoints import CheckpointStore
from storage.events import EventLog, read_events
from storage.retention import RetentionPolicy, apply_retention
from storage.scrub import RECORD, ScrubPolicy, due_steps, fallback_steps, scrub
from storage.throttle import Throttled
from tests.storage.ckpt_helpers import durable, payload, write_files

__all__ = ["durable"]  # fixture

OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


# ---- which steps a fallback needs (pure) ------------------------------------------------
def test_fallback_needs_newest_commits_horizon_and_its_edge_pins_and_promoted():
    committed = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    # newest 2: 90, 100; within 25 of 100: 80, 90, 100; the newest at or before the edge
    # (75): 70; pinned 45 restores 40; promoted 10
    assert fallback_steps(committed, newest=2, horizon=25, pinned=[45],
                          promoted=[10]) == [10, 40, 70, 80, 90, 100]


def test_fallback_needs_only_the_newest_without_horizon_pins_or_promotion():
    assert fallback_steps([5, 10, 15], newest=1, horizon=0) == [15]
    assert fallback_steps([5, 10, 15], newest=5, horizon=0) == [5, 10, 15]


def test_fallback_ignores_pins_before_any_commit_and_promoted_steps_not_committed():
    assert fallback_steps([20, 30], newest=1, horizon=0, pinned=[5], promoted=[7]) == [30]


def test_fallback_of_an_empty_run_is_nothing():
    assert fallback_steps([], newest=3, horizon=100, pinned=[4], promoted=[4]) == []


def test_due_are_unrecorded_changed_or_stale_verifications():
    now = 1_000_000.0
    record = {10: ("a", now - 10), 20: ("old", now - 10), 30: ("c", now - 90_000)}
    digests = {10: "a", 20: "b", 30: "c", 40: "d"}
    assert due_steps([10, 20, 30, 40], digests, record, now=now,
                     reverify_s=86_400) == [20, 30, 40]
    assert due_steps([10, 20, 30, 40], digests, record, now=now, reverify_s=0) == [10, 20, 30, 40]


def test_throttled_reads_keep_to_their_rate():
    import io
    data = io.BytesIO(b"x" * (2 << 20))
    began = time.monotonic()
    digest = hashlib.sha256()
    with Throttled(data, bytes_per_s=8 << 20) as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    assert time.monotonic() - began >= 0.2  # 2 MiB at 8 MiB/s: 0.25 s
    assert digest.hexdigest() == hashlib.sha256(b"x" * (2 << 20)).hexdigest()


# ---- the scrub on real stores ----------------------------------------------------------
def commit_steps(url: str, tmp_path, steps) -> CheckpointStore:
    store = CheckpointStore(url, "r")
    for step in steps:
        store.commit(step, write_files(tmp_path / f"s{step}", payload(step)), parent=None)
    return store


def flip_byte(store: CheckpointStore, step: int, name: str = OPTIM) -> tuple[str, str]:
    """Flip one byte of a committed file in place; (sha256 before, sha256 after)."""
    path = store.path(step, name)
    data = bytearray(store.fs.cat_file(path))
    before = hashlib.sha256(data).hexdigest()
    data[len(data) // 2] ^= 0x01
    store.fs.pipe_file(path, bytes(data))
    store.fs.invalidate_cache()
    return before, hashlib.sha256(data).hexdigest()


def run_scrub(url: str, **policy):
    policy = {"newest": 3, "horizon": 0, "mb_per_s": 0.0, **policy}
    with EventLog(url, "r", "scrub") as events:
        return scrub(CheckpointStore(url, "r"), events, ScrubPolicy(**policy))


def kinds(url: str) -> list[str]:
    return [e["kind"] for e in read_events(url, "r")]


def test_scrub_finds_a_flipped_byte_records_it_and_uncommits_the_step(durable, tmp_path):
    store = commit_steps(durable, tmp_path, [1, 2, 3])
    expected, actual = flip_byte(store, 2)
    # nothing reads step 2 again: it stays committed, and nothing is recorded
    assert store.list_committed() == [1, 2, 3] and kinds(durable) == []

    report = run_scrub(durable)

    assert report.corrupt == [2] and report.uncommitted == [2]
    assert report.needs_attention == []
    assert store.list_committed() == [1, 3]
    [event] = read_events(durable, "r", kinds=("checkpoint_corrupt",))
    assert event["step"] == 2
    assert event["payload"] == {"file": OPTIM, "expected": expected, "actual": actual}
    [fault] = read_events(durable, "r", kinds=("fault",))
    assert fault["payload"]["kind"] == "checkpoint_corrupt"
    assert fault["payload"]["detected_by"] == "scrub"
    # the older commit a fallback past step 2 lands on verifies, and is still there
    assert 1 in report.verified and store.verify(1) == []


def test_scrub_leaves_an_intact_store_untouched(durable, tmp_path):
    store = commit_steps(durable, tmp_path, [1, 2, 3])
    before = {s: store.fs.cat_file(store.path(s, OPTIM)) for s in (1, 2, 3)}

    report = run_scrub(durable)

    assert report.verified == [1, 2, 3] and report.corrupt == [] and report.uncommitted == []
    assert store.list_committed() == [1, 2, 3]
    assert {s: store.fs.cat_file(store.path(s, OPTIM)) for s in (1, 2, 3)} == before
    assert kinds(durable) == []
    assert store.fs.exists(store.root.rsplit("/", 1)[0] + "/" + RECORD)


def test_second_pass_reads_only_new_commits_until_a_verification_is_due(durable, tmp_path):
    store = commit_steps(durable, tmp_path, [1, 2])
    first = run_scrub(durable)
    assert first.verified == [1, 2] and first.bytes_read > 0
    commit_steps(durable, tmp_path, [3])

    second = run_scrub(durable)
    assert second.verified == [3] and second.skipped == [1, 2]
    manifest_bytes = len(store.fs.cat_file(store.path(3, "MANIFEST.json")))
    assert second.bytes_read == store.manifest(3).total_bytes + manifest_bytes

    flip_byte(store, 2)  # after its verification: found once it is due again
    assert run_scrub(durable).corrupt == []
    assert run_scrub(durable, reverify_s=0.0).corrupt == [2]
    assert store.list_committed() == [1, 3]


def test_a_corrupt_newest_is_uncommitted_once_an_older_commit_verifies(durable, tmp_path):
    store = commit_steps(durable, tmp_path, [1, 2, 3])
    flip_byte(store, 3)
    flip_byte(store, 2, "train_state-rank0.pt")

    report = run_scrub(durable, newest=1)  # only step 3 is needed; 2 and 1 are read to
    # find a verified commit below it

    assert report.corrupt == [2, 3] and report.uncommitted == [2, 3]
    assert report.verified == [1]
    assert store.list_committed() == [1]


def test_scrub_never_uncommits_a_corrupt_step_with_nothing_older_verified(durable, tmp_path):
    store = commit_steps(durable, tmp_path, [1, 2])
    flip_byte(store, 1)
    flip_byte(store, 2)

    report = run_scrub(durable)

    assert report.corrupt == [1, 2] and report.uncommitted == []
    assert report.needs_attention == [1, 2]
    assert store.list_committed() == [1, 2]  # the only copies of that training stay
    attention = read_events(durable, "r", kinds=("needs_attention",))
    assert sorted(e["step"] for e in attention) == [1, 2]
    assert "no older checkpoint verifies" in attention[0]["payload"]["reason"]
    assert attention[0]["payload"]["held"] is False  # a look is asked for; training goes on


def test_a_corrupt_step_with_a_newer_verified_commit_but_none_older_stays(durable, tmp_path):
    store = commit_steps(durable, tmp_path, [1, 2])
    flip_byte(store, 1)

    report = run_scrub(durable)

    assert report.corrupt == [1] and report.uncommitted == [] and report.needs_attention == [1]
    assert store.list_committed() == [1, 2]


def test_scrub_checks_the_promoted_copy_and_records_it_without_deleting(durable, tmp_path):
    store = commit_steps(durable, tmp_path, [1, 2])
    store.promote(1)
    promoted = CheckpointStore.at(durable, store.root.rsplit("/", 1)[0] + "/promoted")
    flip_byte(promoted, 1)

    report = run_scrub(durable)

    assert report.promoted_corrupt == [1]
    [event] = read_events(durable, "r", kinds=("checkpoint_corrupt",))
    assert event["payload"]["file"] == f"promoted/{OPTIM}"
    assert promoted.list_committed() == [1] and store.list_committed() == [1, 2]
    assert [e["step"] for e in read_events(durable, "r", kinds=("needs_attention",))] == [1]


def test_a_step_committed_again_while_it_is_read_is_not_judged_corrupt(durable, tmp_path):
    store = commit_steps(durable, tmp_path, [1, 2, 3])
    replayed = []

    def replay_step_3_mid_read() -> None:  # a rollback's replay commits step 3 again
        if not replayed:
            replayed.append(3)
            store.delete(3)
            store.commit(3, write_files(tmp_path / "replay", payload(33)), parent=2)

    with EventLog(durable, "r", "scrub") as events:
        report = scrub(CheckpointStore(durable, "r"), events,
                       ScrubPolicy(newest=3, mb_per_s=0.0), progress=replay_step_3_mid_read)

    assert replayed and report.corrupt == [] and report.uncommitted == []
    assert store.list_committed() == [1, 2, 3] and store.verify(3) == []
    assert kinds(durable) == []
    assert run_scrub(durable).verified == [3]  # the next pass reads the new step 3


def test_the_fallback_of_an_uncommitted_step_outlives_retention_until_the_next_pass(
        durable, tmp_path):
    store = commit_steps(durable, tmp_path, [1, 2, 3])
    flip_byte(store, 2)
    assert run_scrub(durable).uncommitted == [2]
    keep_newest = RetentionPolicy(keep_last=1)

    assert apply_retention(store, keep_newest) == []  # step 1 is pinned as 2's fallback
    assert store.list_committed() == [1, 3]
    run_scrub(durable)  # the next pass: step 2 is long gone, the pin is released
    assert apply_retention(store, keep_newest) == [1]


def test_scrub_reads_at_no_more_than_its_rate(tmp_path):
    rate_mb = 4.0
    url = str(tmp_path / "durable")
    store = CheckpointStore(url, "r")
    store.commit(1, write_files(tmp_path / "s1", payload(1, size=2 << 20)))
    began = time.monotonic()
    report = run_scrub(url, mb_per_s=rate_mb)
    elapsed = time.monotonic() - began
    assert report.bytes_read >= 3 << 20
    assert elapsed >= report.bytes_read / (rate_mb * 1e6) * 0.8
