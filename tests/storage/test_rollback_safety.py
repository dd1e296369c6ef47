"""Nothing committed is lost by mainspring itself (DESIGN §3, issue 11 item 1).

A hypothesis state machine drives random sequences of commit / retention / spike rollback /
operator rollback, with a crash at any point of a commit, a retention pass or a rollback's
uncommit, over a real file store (durable tier) and a real local fast tier — the same
`storage.rollback.roll_back`, `CheckpointStore` and `apply_retention` code the trainer runs.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from storage import checkpoints
from storage.checkpoints import CheckpointStore
from storage.retention import RetentionPolicy, apply_retention, spike_reach
from storage.rollback import pin, pinned_steps, roll_back, uncommit_after, unpin
from tests.storage.ckpt_helpers import payload, write_files

WINDOW = 6  # the spike detector's window in these runs
EVERY = 5  # checkpoint interval


class Crash(Exception):
    """The process dies here: nothing after this point runs."""


def crash_after(fs, calls: int):
    """Make the `calls`-th deleting call on `fs` (rm_file / rm: an uncommit, retention) die."""
    count = [0]
    real = {name: getattr(fs, name) for name in ("rm_file", "rm")}

    def wrap(name):
        def call(*a, **k):
            count[0] += 1
            if count[0] == calls:
                raise Crash(name)
            return real[name](*a, **k)
        return call

    for name in real:
        setattr(fs, name, wrap(name))
    return lambda: [setattr(fs, n, f) for n, f in real.items()]


def pick(stores, bound: int) -> int | None:
    """What a restore does: the newest checkpoint at or before `bound` that verifies on
    either tier (TieredCheckpointer.resume's choice)."""
    for step in sorted({s for st_ in stores for s in st_.list_committed()}, reverse=True):
        if step > bound:
            continue
        if any(step in s.list_committed() and not s.verify(step) for s in stores):
            return step
    return None


class RollbackSafety(RuleBasedStateMachine):
    @initialize(keep_last=st.integers(1, 3))
    def setup(self, keep_last):
        self.tmp = tempfile.mkdtemp()
        self.durable = CheckpointStore(f"{self.tmp}/durable", "r")
        self.fast = CheckpointStore.local(f"{self.tmp}/fast")
        self.policy = RetentionPolicy(keep_last=keep_last, rollback_horizon=spike_reach(WINDOW))
        self.step = 0  # where training is
        self.ever_committed = False

    def teardown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def stores(self):
        return [self.durable, self.fast]

    def committed(self) -> set[int]:
        """Committed on either tier (a fast-only snapshot is resumable on this machine)."""
        return {s for store in self.stores for s in store.list_committed()}

    # ---- the operations ---------------------------------------------------------------
    @rule(ahead=st.integers(1, EVERY), before_manifest=st.booleans(),
          crash_at=st.one_of(st.none(), st.integers(1, 6)))
    def commit(self, ahead, before_manifest, crash_at):
        """Train `ahead` steps and commit (fast tier, then durable with its manifest last),
        then retention and the writer's fast-tier cleanup — dying before the durable
        manifest, or at the crash_at-th deletion, when given."""
        step = self.step + ahead
        restore = crash_after(self.durable.fs, crash_at) if crash_at else lambda: None
        real_put_new = checkpoints.put_new
        try:
            fast_dir = write_files(self.fast.path(step), payload(step, 256))
            self.fast.commit_in_place(step, data_cursor=step)
            if before_manifest:
                checkpoints.put_new = lambda *a, **k: (_ for _ in ()).throw(Crash("manifest"))
            self.durable.commit(step, fast_dir, data_cursor=step)
            self.ever_committed = True
            apply_retention(self.durable, self.policy, newest_verified=step)
            for old in self.fast.list_committed():  # storage/tiered_writer.py's cleanup
                if old < step:
                    self.fast.delete(old)
        except Crash:
            pass  # the process died: a restart resumes from what is committed
        finally:
            checkpoints.put_new = real_put_new
            restore()
        self.ever_committed |= bool(self.committed())
        self.step = step

    @precondition(lambda self: self.step > 0)
    @rule(onset_back=st.integers(0, WINDOW), crash_at=st.one_of(st.none(), st.integers(1, 6)))
    def spike_rollback(self, onset_back, crash_at):
        self._rollback(max(0, self.step - onset_back - 2), crash_at)

    @precondition(lambda self: self.step > 0)
    @rule(data=st.data(), crash_at=st.one_of(st.none(), st.integers(1, 6)))
    def operator_rollback(self, data, crash_at):
        self._rollback(data.draw(st.integers(0, self.step)), crash_at)

    def _rollback(self, bound: int, crash_at: int | None) -> None:
        before = self.committed()
        target = pick(self.stores, bound)
        restore = crash_after(self.durable.fs, crash_at) if crash_at else lambda: None
        try:
            restored, gone = roll_back(bound, lambda b: pick(self.stores, b), lambda s: s,
                                       self.stores)
        except Crash:
            restored, gone = None, None
        finally:
            restore()
        # the newest committed checkpoint at or before the target is never lost
        if target is not None:
            assert target in self.committed(), (bound, target, before, self.committed())
            assert any(target in st_.list_committed() and not st_.verify(target)
                       for st_ in self.stores)
        if gone is None:  # died mid-uncommit: a restart resumes the newest that is left
            self.step = max(self.committed(), default=self.step)
            return
        if restored is None:  # refused: nothing deleted
            assert target is None and self.committed() == before
            return
        assert restored == target and max(self.committed()) == target
        assert {s for s in before if s > target} <= set(gone)
        self.step = target

    # ---- what must always hold -----------------------------------------------------------
    @invariant()
    def a_resume_finds_a_verified_checkpoint_once_one_was_committed(self):
        if self.ever_committed:
            assert pick(self.stores, 10**9) is not None, self.committed()


TestRollbackSafety = RollbackSafety.TestCase
TestRollbackSafety.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])


def test_a_rollback_with_no_checkpoint_left_at_its_target_deletes_nothing(tmp_path):
    # Issue 11's reproduction: committed [50] -> rollback to 49 used to leave [].
    durable = CheckpointStore(str(tmp_path / "d"), "r")
    durable.commit(50, write_files(tmp_path / "s50", payload(50, 64)))
    apply_retention(durable, RetentionPolicy(keep_last=1))
    restored, gone = roll_back(49, lambda b: pick([durable], b), lambda s: s, [durable])
    assert (restored, gone) == (None, [])
    assert durable.list_committed() == [50]


def test_uncommit_after_removes_only_newer_steps_newest_first(tmp_path):
    durable = CheckpointStore(str(tmp_path / "d"), "r")
    for s in (10, 20, 30):
        durable.commit(s, write_files(tmp_path / f"s{s}", payload(s, 64)))
    order = []
    real = durable.delete
    durable.delete = lambda s: (order.append(s), real(s))
    assert uncommit_after(10, [durable]) == [20, 30]
    assert order == [30, 20] and durable.list_committed() == [10]


@pytest.mark.parametrize("keep_last", [1, 2])
def test_retention_with_the_spike_reach_keeps_a_target_for_any_onset_in_the_window(
        tmp_path, keep_last):
    durable = CheckpointStore(str(tmp_path / "d"), "r")
    policy = RetentionPolicy(keep_last=keep_last, rollback_horizon=spike_reach(WINDOW))
    for s in range(0, 60, EVERY):
        durable.commit(s, write_files(tmp_path / f"s{s}", payload(s, 64)))
        apply_retention(durable, policy, newest_verified=s)
        for step in range(s + 1, s + EVERY + 1):  # training goes on from s to the next commit
            for onset in range(max(1, step - WINDOW), step + 1):  # onsets the detector sees
                assert pick([durable], max(0, onset - 2)) is not None


def test_a_pinned_rollback_target_survives_retention_until_the_pin_is_released(tmp_path):
    # An operator rollback to step 10 was admitted while 10 was the oldest commit left; the
    # running segment then stops and commits 40 and 50 with keep_last=1. Without the pin
    # those commits' retention retired 10 and the rollback had to be refused.
    url = str(tmp_path / "d")
    durable = CheckpointStore(url, "r")
    pin(url, "r", "pin-op1", to_step=12)
    for s in (10, 20, 30, 40, 50):
        durable.commit(s, write_files(tmp_path / f"s{s}", payload(s, 64)))
        apply_retention(durable, RetentionPolicy(keep_last=1), newest_verified=s)
    assert durable.list_committed() == [10, 50]
    assert pinned_steps(durable) == {12}
    unpin(url, "r", ["pin-op1"])
    apply_retention(durable, RetentionPolicy(keep_last=1), newest_verified=50)
    assert durable.list_committed() == [50] and pinned_steps(durable) == frozenset()
