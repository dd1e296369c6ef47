"""Retention is a pure function of the committed steps; deletion never exposes a half-deleted
checkpoint and never touches the newest verified one."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import BadConfig
from storage.checkpoints import CheckpointStore
from storage.retention import RetentionPolicy, apply_retention, spike_reach, steps_to_delete
from tests.storage.ckpt_helpers import payload, write_files

STEPS = list(range(0, 101, 10))


def test_keep_last_keeps_only_the_newest_k():
    assert steps_to_delete(STEPS, RetentionPolicy(keep_last=3)) == list(range(0, 71, 10))


def test_keep_every_keeps_the_long_horizon_history():
    assert steps_to_delete(STEPS, RetentionPolicy(keep_last=1, keep_every=50)) == [
        10, 20, 30, 40, 60, 70, 80, 90]


def test_promoted_checkpoints_are_never_deleted():
    assert 30 not in steps_to_delete(STEPS, RetentionPolicy(keep_last=1),
                                     promoted=frozenset({30}))


def test_everything_inside_the_rollback_horizon_is_kept_with_the_commit_before_its_edge():
    # 80..100 lie within 25 steps of 100; 70 is what a rollback to step 75 restores.
    assert steps_to_delete(STEPS, RetentionPolicy(keep_last=1, rollback_horizon=25)) == list(
        range(0, 61, 10))


def test_a_rollback_to_the_horizon_edge_always_finds_a_commit_at_or_before_it():
    # keep_last=1 with commits every 25 steps: a spike whose onset is just after the newest
    # commit (50) rolls back to 49 - the commit at 25 must still be there.
    kept = [s for s in (0, 25, 50) if s not in steps_to_delete(
        [0, 25, 50], RetentionPolicy(keep_last=1, rollback_horizon=spike_reach(window=20)))]
    assert max(s for s in kept if s <= 50 - spike_reach(window=20)) == 25


def test_the_newest_verified_checkpoint_survives_even_when_newer_ones_exist():
    # Step 100 failed verification; 90 is the newest good one and must stay.
    assert 90 not in steps_to_delete(STEPS, RetentionPolicy(keep_last=1), newest_verified=90)


def test_an_unscrubbed_horizon_edge_keeps_the_newest_scrubbed_commit_below_it():
    # keep_last=1, horizon 25: 70 is the edge's commit; the scrub has verified 40 and 60,
    # not 70 yet, so 60 stays as 70's fallback; once 70 is verified it may go
    policy = RetentionPolicy(keep_last=1, rollback_horizon=25)
    assert steps_to_delete(STEPS, policy, scrubbed=frozenset({40, 60})) == [
        0, 10, 20, 30, 40, 50]
    assert steps_to_delete(STEPS, policy, scrubbed=frozenset({40, 60, 70})) == list(
        range(0, 61, 10))
    assert steps_to_delete(STEPS, policy) == list(range(0, 61, 10))  # no scrub: as before


def test_an_unscrubbed_pin_target_keeps_the_newest_scrubbed_commit_below_it():
    policy = RetentionPolicy(keep_last=1)
    assert steps_to_delete(STEPS, policy, pinned=frozenset({45}),
                           scrubbed=frozenset({20})) == [0, 10, 30, 50, 60, 70, 80, 90]


def test_retention_off_by_default_deletes_nothing():
    assert steps_to_delete(STEPS, RetentionPolicy()) == []


def test_negative_settings_are_bad_config_naming_the_field():
    with pytest.raises(BadConfig) as err:
        RetentionPolicy(keep_every=-1)
    assert err.value.field == "storage.keep_every"


class Crash(Exception):
    """A process dying at this point (nothing after it runs)."""


def crash_on_call(obj, name: str, at: int):
    real, calls = getattr(obj, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise Crash(name)
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)
    return lambda: setattr(obj, name, real)


ops = st.lists(st.one_of(
    st.tuples(st.just("save"), st.one_of(st.none(), st.integers(1, 3))),  # crash after k files
    st.tuples(st.just("retain"), st.integers(1, 3), st.one_of(st.none(), st.integers(1, 2))),
), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_latest_committed_always_verifies_and_is_never_newer_than_the_last_commit(tmp_path_factory,
                                                                                 program):
    store = CheckpointStore(f"memory://prop-{uuid.uuid4().hex}", "r")
    local = tmp_path_factory.mktemp("ck")
    model: set[int] = set()  # steps whose commit completed and whose deletion has not begun
    last_completed, step = None, 0
    for op in program:
        if op[0] == "save":
            undo = crash_on_call(store.fs, "put_file", op[1]) if op[1] else lambda: None
            try:
                store.commit(step, write_files(local / str(step), payload(step, 64)))
                model.add(step)
                last_completed, step = step, step + 1
            except Crash:
                pass  # a partial upload; the retry re-saves the same step
            finally:
                undo()
        else:
            policy = RetentionPolicy(keep_last=op[1])
            doomed = steps_to_delete(store.list_committed(), policy)
            undo = crash_on_call(store.fs, "rm", op[2]) if op[2] else lambda: None
            try:
                apply_retention(store, policy)
                model -= set(doomed)
            except Crash:
                model -= set(doomed[:op[2]])  # its manifest went first: already invisible
            finally:
                undo()
        latest = store.latest_committed()
        assert latest == (max(model) if model else None)
        if latest is not None:
            assert store.verify(latest) == []
            assert latest <= last_completed
