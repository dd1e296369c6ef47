"""Nothing committed is lost by mainspring itself (DESIGN §3), and no
rollback is undone.

A hypothesis state machine drives random sequences of commit / retention / spike rollback /
operator rollback / retry on another machine / fast-tier garbage collection, with a crash
at any point of a commit, a retention pass or a rollback's uncommit, over a real file store
(the durable tier, shared with another run) and two machines' real fast tiers — the same
`storage.rollback.roll_back`, `storage.resume.choose`, `CheckpointStore`,
`apply_retention` and `storage.fast_tier.collect_garbage` code the trainer and the
activities run. It checks that no copy a completed rollback abandoned is ever resumed
from, committed again or kept by a collector, and that no run's committed checkpoint is
deleted by another run.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from storage import checkpoints, fast_tier
from storage.checkpoints import CheckpointStore
from storage.resume import choose
from storage.retention import RetentionPolicy, apply_retention, spike_reach
from storage.rollback import (
    LINEAGE,
    left_behind,
    lineage_of,
    pin,
    pinned_steps,
    roll_back,
    start_lineage,
    uncommit_after,
    unpin,
)
from storage.tiered_writer import manifest_meta
from tests.storage.ckpt_helpers import payload, write_files

WINDOW = 6  # the spike detector's window in these runs
EVERY = 5  # checkpoint interval
MACHINES = ("a", "b")
RUN, OTHER = "r", "other"
STATE = "train_state-rank0.pt"


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


def pick(stores, bound: int, dead: frozenset[str] = frozenset()) -> int | None:
    """What a restore should choose: the newest checkpoint at or before `bound` that
    verifies on one of `stores` and is not a copy a rollback abandoned (`dead`)."""
    for step in sorted({s for st_ in stores for s in st_.list_committed()}, reverse=True):
        if step > bound:
            continue
        if any(step in s.list_committed() and not s.verify(step)
               and identity(s, step) not in dead for s in stores):
            return step
    return None


def identity(store: CheckpointStore, step: int) -> str:
    """Which training produced a copy: its train state's digest (unique per save here)."""
    return store.manifest(step).files[STATE].sha256


class RollbackSafety(RuleBasedStateMachine):
    """One run trains on machines a and b, each with its own fast tier (one store per run
    per machine, shared by the run's segments there: storage/fast_tier.py), over one
    durable tier shared with another run. A segment dies (a crash anywhere) and its retry
    lands on either machine; either machine's collector runs whenever no segment of the
    run holds it. The resume, rollback, upload check, retention and collector are the
    code the trainer and the activities run."""

    @initialize(keep_last=st.integers(1, 3))
    def setup(self, keep_last):
        self.tmp = tempfile.mkdtemp()
        self.url = f"{self.tmp}/durable"
        self.durable = CheckpointStore(self.url, RUN)
        self.roots = {m: f"{self.tmp}/{m}/fast" for m in MACHINES}
        self.fasts = {m: CheckpointStore.local(fast_tier.store_dir(root, RUN))
                      for m, root in self.roots.items()}
        self.policy = RetentionPolicy(keep_last=keep_last, rollback_horizon=spike_reach(WINDOW))
        self.on, self.step, self.lineage = "a", 0, 0  # where the segment runs, and how far
        self.down = False  # the segment died: only a retry (on either machine) goes on
        self.saves = 0  # makes every save's bytes unique (identity)
        self.dead: set[str] = set()  # copies a completed rollback abandoned
        self.lingering: set[str] = set()  # of those, durable commits an uncommit left
        self.ever_committed = False
        self.other = self._other_run()
        for root in self.roots.values():
            with fast_tier.lease(root, RUN, self.url):
                pass

    def _other_run(self) -> CheckpointStore:
        """Another run: 10 and 20 committed; on each machine a fast copy of 20 (a cache of
        the durable one) and 30, whose upload never finished (the only copy)."""
        other = CheckpointStore(self.url, OTHER)
        for step in (10, 20):
            other.commit(step, write_files(f"{self.tmp}/src/{step}", payload(step, 64)))
        for root in self.roots.values():
            with fast_tier.lease(root, OTHER, self.url):
                fast = CheckpointStore.local(fast_tier.store_dir(root, OTHER))
                for step in (20, 30):
                    write_files(fast.path(step), payload(step, 64))
                    fast.commit_in_place(step)
        return other

    def teardown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def fast(self) -> CheckpointStore:
        return self.fasts[self.on]

    @property
    def stores(self):
        return [self.durable, *self.fasts.values()]

    def committed(self) -> set[int]:
        """Committed on any tier (a fast-only snapshot is resumable on its machine)."""
        return {s for store in self.stores for s in store.list_committed()}

    def copies(self, store: CheckpointStore) -> set[str]:
        return {identity(store, s) for s in store.list_committed()
                if store.committed_manifest(s) is not None}

    # ---- the operations ---------------------------------------------------------------
    @precondition(lambda self: not self.down)
    @rule(ahead=st.integers(1, EVERY), before_manifest=st.booleans(),
          crash_at=st.one_of(st.none(), st.integers(1, 6)))
    def commit(self, ahead, before_manifest, crash_at):
        """Train `ahead` steps and save: the fast tier, then the writer's upload (refused
        for an abandoned lineage), retention and fast-tier cleanup — dying before the
        durable manifest, or at the crash_at-th deletion, when given."""
        step = self.step + ahead
        restore = crash_after(self.durable.fs, crash_at) if crash_at else lambda: None
        real_put_new = checkpoints.put_new
        try:
            self.saves += 1
            files = {**payload(step, 256), STATE: f"{step}/{self.saves}".encode()}
            fast_dir = write_files(self.fast.path(step), files)
            self.fast.commit_in_place(step, data_cursor=step, extra={LINEAGE: self.lineage})
            if before_manifest:
                checkpoints.put_new = lambda *a, **k: (_ for _ in ()).throw(Crash("manifest"))
            self._upload(step, fast_dir)
        except Crash:
            self.down = True  # the process died: a retry resumes from what is committed
        finally:
            checkpoints.put_new = real_put_new
            restore()
        self.ever_committed |= bool(self.committed())
        self.step = step

    def _upload(self, step: int, fast_dir: str) -> None:
        """storage/tiered_writer.py for one snapshot: its lineage check, the durable commit
        (manifest last), retention, and the fast tier keeps the newest durable copy."""
        man = self.fast.manifest(step)
        if left_behind(self.durable, step, lineage_of(man)) is not None:
            self.fast.delete(step)
            return
        self.durable.commit(step, fast_dir, files=man.files, **manifest_meta(man))
        self.ever_committed = True
        apply_retention(self.durable, self.policy, newest_verified=step)
        for old in self.fast.list_committed():
            if old < step:
                self.fast.delete(old)

    @rule(machine=st.sampled_from(MACHINES))
    def retry_on(self, machine):
        """The segment dies (or ends) and the next one runs on `machine`: its lease, then
        the resume's choice over that machine's fast tier and the durable tier, then the
        catch-up uploads of newer fast-only snapshots."""
        self.on, self.down = machine, False
        with fast_tier.lease(self.roots[machine], RUN, self.url):
            pass  # (the lease makes the run's directory there again after a collection)
        local = f"{self.tmp}/restore"
        shutil.rmtree(local, ignore_errors=True)
        choice = choose(self.fast, self.durable, local, None)
        self.lineage = choice.lineage
        if choice.found is None:
            self.step = 0
        else:
            man, _, tier = choice.found
            assert man.files[STATE].sha256 not in self.dead, (man.step, tier, "resumed a "
                                                               "checkpoint a rollback abandoned")
            self.step = man.step
        for step in choice.upload:
            self._upload(step, self.fast.path(step))

    @precondition(lambda self: not self.down and self.step > 0)
    @rule(onset_back=st.integers(0, WINDOW), crash_at=st.one_of(st.none(), st.integers(1, 6)))
    def spike_rollback(self, onset_back, crash_at):
        self._rollback(max(0, self.step - onset_back - 2), crash_at)

    @precondition(lambda self: not self.down and self.step > 0)
    @rule(data=st.data(), crash_at=st.one_of(st.none(), st.integers(1, 6)))
    def operator_rollback(self, data, crash_at):
        self._rollback(data.draw(st.integers(0, self.step)), crash_at)

    def _rollback(self, bound: int, crash_at: int | None) -> None:
        stores = [self.durable, self.fast]  # what the segment's rank 0 uncommits
        before = {s for st_ in stores for s in st_.list_committed()}
        target = pick(stores, bound, frozenset(self.dead))
        local = f"{self.tmp}/restore"

        def load(b):
            shutil.rmtree(local, ignore_errors=True)
            found = choose(self.fast, self.durable, local, b).found
            return found and found[0].step

        def branch(step, newer):
            # the decision: every copy newer than the target, on any machine, is abandoned
            self.dead |= {identity(st_, s) for st_ in self.stores for s in st_.list_committed()
                          if s > step and st_.committed_manifest(s) is not None}
            self.lineage = start_lineage(self.durable, step, newer)

        restore = crash_after(self.durable.fs, crash_at) if crash_at else lambda: None
        try:
            restored, gone = roll_back(bound, load, lambda s: s, stores, branch=branch)
        except Crash:
            restored, gone = None, None
        finally:
            restore()
        self.lingering |= self.dead & self.copies(self.durable)
        # the newest committed checkpoint at or before the target is never lost
        if target is not None:
            assert target in self.committed(), (bound, target, before, self.committed())
            assert any(target in st_.list_committed() and not st_.verify(target)
                       for st_ in self.stores)
        if gone is None:  # died mid-rollback: a retry resumes what is left
            self.down = True
            return
        if restored is None:  # refused: nothing deleted
            assert {s for st_ in stores for s in st_.list_committed()} == before
            return
        assert restored == target
        assert max(s for st_ in stores for s in st_.list_committed()) == restored
        # every newer one is gone: uncommitted here, or dropped by the restore as abandoned
        assert set(gone) <= {s for s in before if s > restored}
        self.step = restored

    @rule(machine=st.sampled_from(MACHINES))
    def collect_garbage(self, machine):
        """Another run's activity starts on `machine` (its collector visits this run unless
        a segment of it holds the machine's lease), then this run's (visiting the other)."""
        durable_before = self.durable.list_committed()
        if machine != self.on or self.down:
            fast_tier.collect_garbage(self.roots[machine], keep_run=OTHER)
            kept = self.copies(self.fasts[machine])
            assert not kept & self.dead, "a collector kept a copy a rollback abandoned"
        fast_tier.collect_garbage(self.roots[machine], keep_run=RUN)
        assert self.durable.list_committed() == durable_before

    # ---- what must always hold -----------------------------------------------------------
    @invariant()
    def no_rollback_is_undone_by_an_upload(self):
        """An abandoned copy never becomes a durable commit; one an uncommit cut short left
        (its rollback's record already written) only goes."""
        if not hasattr(self, "durable"):
            return
        now = self.copies(self.durable) & self.dead
        assert now <= self.lingering, ("an abandoned copy was committed again", now)
        self.lingering = now

    @invariant()
    def no_run_deletes_another_runs_checkpoints(self):
        if not hasattr(self, "other"):
            return
        assert self.other.list_committed() == [10, 20] and not self.other.verify(20)
        for root in self.roots.values():  # the other run's only copy of 30 stays
            fast = CheckpointStore.local(fast_tier.store_dir(root, OTHER))
            assert 30 in fast.list_committed() and not fast.verify(30)

    @invariant()
    def a_resume_finds_a_live_checkpoint_once_one_was_committed(self):
        if getattr(self, "ever_committed", False):
            live = [(st_, s) for st_ in self.stores for s in st_.list_committed()
                    if st_.committed_manifest(s) is not None and not st_.verify(s)
                    and identity(st_, s) not in self.dead]
            assert live, self.committed()


TestRollbackSafety = RollbackSafety.TestCase
TestRollbackSafety.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])


def test_a_rollback_with_no_checkpoint_left_at_its_target_deletes_nothing(tmp_path):
    # The loss this guards against: committed [50] -> rollback to 49 used to leave [].
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
