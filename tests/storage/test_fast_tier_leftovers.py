"""A worker killed mid-collection leaves its `.gc-<run>-*` directory (the run's dataset cache
and checkpoints half removed), and one killed while making a run directory its `.new-*`:
the next collection sweeps those older than a lease, never one a live collector holds."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

from storage import fast_tier

FILES = 30_000  # enough cache files that removing them takes a moment to interrupt


def old_run(root: str, durable: str, run: str = "old") -> str:
    """A finished run's directory on this machine: no checkpoint, a big dataset cache."""
    with fast_tier.lease(root, run, durable) as directory:
        cache = os.path.join(fast_tier.cache_dir(root, run), "dataset")
        for d in range(FILES // 1000):
            os.makedirs(os.path.join(cache, f"{d:02d}"))
            for i in range(1000):
                open(os.path.join(cache, f"{d:02d}", f"{i:04d}"), "wb").close()
    return directory


def leftovers(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(fast_tier.LEFTOVERS))


def kill_mid_collection(root: str) -> None:
    """A real collector process, SIGKILLed once it has renamed the run directory aside."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; from storage import fast_tier; "
                              "fast_tier.collect_garbage(sys.argv[1], keep_run='another')",
                              root], cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 60
        while not leftovers(root) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()


@pytest.mark.process
def test_a_collection_removes_what_a_collector_killed_mid_way_left(tmp_path):
    root, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    old_run(root, durable)
    kill_mid_collection(root)
    [tomb] = leftovers(root)  # the kill came mid-way: the half-removed cache stays behind
    assert tomb.startswith(".gc-old-") and not os.path.exists(os.path.join(root, "old"))

    assert fast_tier.collect_garbage(root, keep_run="another") == []  # fresh: not yet
    assert leftovers(root) == [tomb]
    removed = fast_tier.collect_garbage(root, keep_run="another", stale_s=0.0)

    assert removed == [os.path.join(root, tomb)] and leftovers(root) == []


def test_a_leftover_whose_lease_a_live_collector_holds_is_not_swept(tmp_path):
    root = tmp_path / "fast"
    tomb = root / ".gc-run-0123abcd"
    (tomb / "cache").mkdir(parents=True)
    with open(tomb / fast_tier.LEASE_FILE, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the collector emptying it, alive
        assert fast_tier.sweep_leftovers(str(root), stale_s=0.0) == []
        assert (tomb / "cache").is_dir()
    assert fast_tier.sweep_leftovers(str(root), stale_s=0.0) == [str(tomb)]


def test_a_half_made_run_directory_is_swept_once_older_than_a_lease(tmp_path):
    root = tmp_path / "fast"
    half = root / ".new-run-aaaa"
    half.mkdir(parents=True)
    (half / fast_tier.MARK_FILE).write_text('{"run_id": "run"}')
    made = time.time()

    assert fast_tier.sweep_leftovers(str(root), now=made + fast_tier.STALE_S - 60) == []
    assert half.is_dir()
    assert fast_tier.sweep_leftovers(str(root), now=made + fast_tier.STALE_S + 1) == [str(half)]
    assert not half.exists()


def test_a_leftover_with_files_mainspring_did_not_put_there_keeps_them(tmp_path):
    root = tmp_path / "fast"
    tomb = root / ".gc-run-0123abcd"
    (tomb / "ckpt").mkdir(parents=True)
    (tomb / "notes.txt").write_text("someone's")

    assert fast_tier.sweep_leftovers(str(root), stale_s=0.0) == []
    assert (tomb / "notes.txt").read_text() == "someone's" and not (tomb / "ckpt").exists()
