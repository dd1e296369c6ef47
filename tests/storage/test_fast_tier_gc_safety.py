"""The fast tier's garbage collector deletes only what it made, and only while it holds the
run's lease: overlapping tiers are refused (the spec's paths, then the real paths with
symlinks resolved on the worker), a directory without the collector's creation mark is
never removed, and an activity that leases a run while the collector visits it keeps its
files and its lease. Real directories, a real file durable store, real flock leases."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from common.errors import BadConfig
from spec import RunSpec
from storage import fast_tier
from storage.checkpoints import CheckpointStore
from tests.storage.ckpt_helpers import payload, write_files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def committed_run(durable: str, run_id: str, steps: list[int], src) -> CheckpointStore:
    store = CheckpointStore(durable, run_id)
    for step in steps:
        store.commit(step, write_files(src / run_id / str(step), payload(step, 64)))
    return store


def old_lease(directory: str, run_id: str, durable: str) -> None:
    """What the fast tier's lease left behind before it marked what it created: a run file
    in whatever directory it was pointed at."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, fast_tier.RUN_FILE), "w") as f:
        f.write(f'{{"run_id": "{run_id}", "durable": "{durable}"}}')


@pytest.mark.parametrize("fast_under", ["runs", "", "..", "runs/victim"])
def test_a_fast_tier_overlapping_the_durable_tier_is_refused_naming_storage_fast(
        tmp_path, fast_under):
    durable = tmp_path / "store"
    fast = os.path.normpath(str(durable / fast_under)) if fast_under else str(durable)
    with pytest.raises(BadConfig) as err:
        RunSpec.from_dict({"run_id": "r", "storage": {"durable": str(durable), "fast": fast}})
    assert err.value.field == "storage.fast" and "storage.durable" in err.value.problem
    with pytest.raises(BadConfig) as err:
        fast_tier.check_tiers_apart(fast, f"file://{durable}")
    assert err.value.field == "storage.fast" and err.value.fix


def test_a_symlink_that_puts_the_fast_tier_inside_the_durable_tier_is_refused_on_the_worker(
        tmp_path):
    (tmp_path / "store").mkdir()
    os.symlink(tmp_path / "store", tmp_path / "looks-elsewhere")
    fast = str(tmp_path / "looks-elsewhere" / "runs")
    RunSpec.from_dict({"run_id": "r", "storage": {"durable": str(tmp_path / "store"),
                                                  "fast": fast}})  # the paths differ as written
    with pytest.raises(BadConfig) as err:
        with fast_tier.lease(fast, "r", str(tmp_path / "store")):
            pass
    assert err.value.field == "storage.fast"
    assert not os.path.exists(tmp_path / "store" / "runs" / "r")  # nothing was created


def test_separate_tiers_and_an_s3_durable_tier_are_accepted(tmp_path):
    fast_tier.check_tiers_apart(str(tmp_path / "fast"), f"file://{tmp_path / 'store'}")
    fast_tier.check_tiers_apart(str(tmp_path / "store-fast"), str(tmp_path / "store"))
    fast_tier.check_tiers_apart(str(tmp_path), "s3://bucket/prefix")


def test_gc_never_deletes_another_runs_durable_checkpoints_when_the_tiers_overlap(tmp_path):
    # fast = <durable>/runs, accepted before: run "victim"'s fast directory was its durable
    # directory, and another run's collection removed it whole, checkpoints included.
    durable = str(tmp_path / "store")
    victim = committed_run(durable, "victim", [10, 20], tmp_path / "src")
    old_lease(os.path.join(durable, "runs", "victim"), "victim", durable)
    fast_tier.collect_garbage(os.path.join(durable, "runs"), keep_run="other")
    assert victim.list_committed() == [10, 20] and not victim.verify(20)


def test_gc_never_removes_a_directory_it_did_not_create(tmp_path):
    # fast == durable and a run named "runs": its lease wrote the run file into the durable
    # tier's runs/ directory, and any other run's collection then deleted every run.
    durable = str(tmp_path / "store")
    others = [committed_run(durable, run, [10], tmp_path / "src") for run in ("a", "b")]
    old_lease(os.path.join(durable, "runs"), "runs", durable)
    assert fast_tier.collect_garbage(durable, keep_run="a") == []
    assert all(store.list_committed() == [10] for store in others)


def test_gc_removes_only_the_parts_of_a_run_directory_it_made(tmp_path):
    fast, durable = str(tmp_path / "fast"), str(tmp_path / "store")
    committed_run(durable, "old", [10], tmp_path / "src")
    with fast_tier.lease(fast, "old", durable) as directory:
        os.makedirs(os.path.join(directory, "segments", "000000000-000000010"))
    stranger = os.path.join(directory, "notes.txt")
    with open(stranger, "w") as f:
        f.write("an operator's file")
    assert fast_tier.collect_garbage(fast, keep_run="current") == []
    assert "notes.txt" in os.listdir(directory) and not os.path.exists(
        os.path.join(directory, "segments"))  # all it made is gone, what it did not stays
    os.unlink(stranger)
    assert fast_tier.collect_garbage(fast, keep_run="current") == [directory]
    assert os.listdir(os.path.dirname(directory)) == []


@pytest.mark.process
def test_an_activity_leasing_the_run_while_gc_visits_it_keeps_its_files_and_its_lease(
        tmp_path, monkeypatch):
    # Between the collector's lease check and its deletion (a durable listing) an activity
    # of the run leased the directory: it lost its files and a second lease was granted.
    fast, durable = str(tmp_path / "fast"), str(tmp_path / "store")
    committed_run(durable, "r", [10], tmp_path / "src")
    with fast_tier.lease(fast, "r", durable):
        pass
    holder: list[subprocess.Popen] = []
    real = CheckpointStore.list_committed

    def listing_during_which_an_activity_starts(store):
        if not holder and store.run_id == "r":
            holder.append(start_holder(fast, durable))
            try:  # the old collector let it in at once; one that holds the lease makes it wait
                holder[0].wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        return real(store)

    monkeypatch.setattr(CheckpointStore, "list_committed", listing_during_which_an_activity_starts)
    try:
        fast_tier.collect_garbage(fast, keep_run="other")
        monkeypatch.undo()
        assert holder[0].stdout.readline().strip() == "held"
        directory = fast_tier.run_dir(fast, "r")
        assert open(os.path.join(directory, "segments", "mine")).read() == "in use"
        with open(os.path.join(directory, fast_tier.LEASE_FILE), "a+") as second:
            with pytest.raises(BlockingIOError):  # the holder's lease is the one at this path
                fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder[0].kill()
        holder[0].wait()


def start_holder(fast: str, durable: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time; sys.path.insert(0, '.');"
        "from storage import fast_tier;"
        f"cm = fast_tier.lease({fast!r}, 'r', {durable!r});"
        "d = cm.__enter__();"
        "os.makedirs(os.path.join(d, 'segments'), exist_ok=True);"
        "open(os.path.join(d, 'segments', 'mine'), 'w').write('in use');"
        "print('held', flush=True); time.sleep(60)")],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
