"""DeepSpeed's JIT build directory: private per Python environment, stale locks cleared:
a lock whose owner died at once (real processes, real SIGKILL), an unheld unmarked one by
its age, a held one never, whatever its age, nor while its owner takes or releases it."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from torch.utils.file_baton import FileBaton

from tests.trainer.helpers import REPO
from trainer.extensions import (
    _wait_clearing_orphans,
    clear_stale_build_locks,
    default_extensions_dir,
    install_owned_build_locks,
    remove_if_orphaned,
)

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)

# A process that takes the build lock as a rank or standby does (the trainer's patched
# FileBaton), says so, and holds it until it is killed.
OWNER = """
import sys, time
from trainer.extensions import install_owned_build_locks
install_owned_build_locks()
from torch.utils.file_baton import FileBaton
assert FileBaton(sys.argv[1]).try_acquire()
print("held", flush=True)
time.sleep(600)
"""


def hold_lock(lock) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(lock)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_lock_whose_owner_was_sigkilled_is_removed_at_once_and_a_live_owner_s_is_kept(tmp_path):
    (tmp_path / "deepspeed_shm_comm").mkdir()
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    owner = hold_lock(lock)
    try:
        assert clear_stale_build_locks(600, root=str(tmp_path)) == []  # young, owner alive
        assert lock.exists()
    finally:
        kill(owner)
    assert clear_stale_build_locks(600, root=str(tmp_path)) == [str(lock)]  # young, orphaned
    assert not lock.exists()


def test_a_process_waiting_on_the_lock_goes_on_once_its_owner_is_killed(tmp_path):
    lock = tmp_path / "lock"
    owner = hold_lock(lock)
    waiter = threading.Thread(target=_wait_clearing_orphans,
                              args=(FileBaton(str(lock), wait_seconds=0.05),), daemon=True)
    try:
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive(), "the waiter went on while the lock's owner lived"
    finally:
        kill(owner)
    waiter.join(10)
    assert not waiter.is_alive(), "the waiter still waits on a dead owner's lock"
    assert not lock.exists()


def test_a_lock_older_than_the_hang_timeout_is_removed_and_a_fresh_one_kept(tmp_path):
    for op, age in (("deepspeed_shm_comm", 900), ("cpu_adam", 30)):
        (tmp_path / op).mkdir()
        lock = tmp_path / op / "lock"
        lock.touch()
        os.utime(lock, (1_000_000 - age, 1_000_000 - age))
    removed = clear_stale_build_locks(600, root=str(tmp_path), now=1_000_000)
    assert removed == [str(tmp_path / "deepspeed_shm_comm" / "lock")]
    assert not (tmp_path / "deepspeed_shm_comm" / "lock").exists()
    assert (tmp_path / "cpu_adam" / "lock").exists()
    assert clear_stale_build_locks(600, root=str(tmp_path / "missing")) == []


def test_two_python_environments_get_different_build_dirs(monkeypatch):
    first = default_extensions_dir()
    monkeypatch.setattr(sys, "prefix", "/another/venv")
    assert default_extensions_dir() != first


def test_importing_the_trainer_sets_the_private_build_dir_unless_the_user_chose_one():
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    out = subprocess.run([sys.executable, "-c", "import os, trainer; "
                          "print(os.environ['TORCH_EXTENSIONS_DIR'])"],
                         cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == default_extensions_dir()
    env["TORCH_EXTENSIONS_DIR"] = "/somewhere/else"  # a user's own choice is kept
    out = subprocess.run([sys.executable, "-c", "import os, trainer; "
                          "print(os.environ['TORCH_EXTENSIONS_DIR'])"],
                         cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "/somewhere/else"


def test_a_segment_starts_past_the_shm_op_lock_a_killed_loader_left_behind(tmp_path, dataset_uri):
    from tests.trainer.helpers import run_segment, tiny_spec, write_spec

    spec = write_spec(tiny_spec(tmp_path / "store"), tmp_path / "spec.json")
    first = run_segment(spec, dataset_uri, 2, tmp_path / "w1")  # the op is built and loaded
    assert first.returncode == 0, first.stderr[-3000:]
    op_dir = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR", default_extensions_dir()),
                          "deepspeed_shm_comm")
    assert os.path.isdir(op_dir), "the segment loaded no shm op: this test would prove nothing"
    lock = os.path.join(op_dir, "lock")
    kill(hold_lock(lock))  # a standby or rank killed inside torch's load of the op
    assert os.path.exists(lock)
    # Torch's JIT load of the op finds the lock taken and waits (trainer's patched wait);
    # without the owner's flock that wait lasted until the lock aged past the hang timeout.
    second = run_segment(spec, dataset_uri, 4, tmp_path / "w2", timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    assert not os.path.exists(lock)
    assert "orphaned_build_lock_removed" in second.stderr + second.stdout


def test_a_lock_whose_owner_lives_is_kept_however_old_and_short_the_timeout(tmp_path):
    # The spec accepts a hang timeout of 1e-9 s, so "older than the timeout" can mean any
    # age: a live owner's lock must not fall through to the age rule.
    (tmp_path / "deepspeed_shm_comm").mkdir()
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    owner = hold_lock(lock)
    try:
        later = time.time() + 10**6
        assert clear_stale_build_locks(1e-9, root=str(tmp_path), now=later) == []
        assert lock.exists()
    finally:
        kill(owner)


# Takes and releases the build lock as fast as it can, as builders and loaders in a row do;
# any exception (torch's release finding its lock already gone) makes it exit non-zero.
CHURN = """
import sys, time
from trainer.extensions import install_owned_build_locks
install_owned_build_locks()
from torch.utils.file_baton import FileBaton
print("churning", flush=True)
end, taken = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < end:
    baton = FileBaton(sys.argv[1])
    if baton.try_acquire():
        baton.release()
        taken += 1
print(taken, flush=True)
"""


@pytest.mark.parametrize("cleaner", ["supervisor_sweep", "waiter"])
def test_a_cleaner_racing_a_live_owner_s_take_and_release_never_removes_its_lock(
        tmp_path, cleaner):
    # A supervisor's sweep (with the shortest timeout the spec allows) or a waiter's orphan
    # check, run again and again while a live process takes and releases the lock: neither
    # may take a lock not yet marked, nor one whose flock torch's release has just dropped,
    # for an orphan (the owner's own remove then fails after a good build).
    (tmp_path / "deepspeed_shm_comm").mkdir()
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    clean = {"supervisor_sweep": lambda: clear_stale_build_locks(1e-9, root=str(tmp_path)),
             "waiter": lambda: [str(lock)] if remove_if_orphaned(str(lock)) else []}[cleaner]
    churn = subprocess.Popen([sys.executable, "-c", CHURN, str(lock), "4"], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert churn.stdout.readline().strip() == "churning"
    removed = []
    while churn.poll() is None:
        removed += clean()
    out, err = churn.communicate()
    assert churn.returncode == 0, err[-2000:]
    assert removed == []
    assert int(out.strip()) > 100, "the owner hardly took the lock: the race was not run"


def test_an_unmarked_lock_someone_flocks_is_kept_past_the_hang_timeout(tmp_path):
    (tmp_path / "cpu_adam").mkdir()
    lock = tmp_path / "cpu_adam" / "lock"
    lock.touch()
    with open(lock, "rb") as held:  # another program that flocks its lock, unmarked
        fcntl.flock(held, fcntl.LOCK_EX)
        assert clear_stale_build_locks(1e-9, root=str(tmp_path), now=time.time() + 900) == []
        assert lock.exists()
    assert clear_stale_build_locks(1e-9, root=str(tmp_path), now=time.time() + 900) \
        == [str(lock)]


def test_an_owner_s_release_removes_only_its_own_lock_and_survives_its_loss(tmp_path):
    # Were the owner's lock removed behind its back (by another program's cleaner) and a
    # second builder to take the name, the first owner's release must leave the second's
    # lock in place, and must not fail the build that just succeeded.
    install_owned_build_locks()
    lock = str(tmp_path / "lock")
    first, second = FileBaton(lock), FileBaton(lock)
    assert first.try_acquire()
    os.unlink(lock)
    assert second.try_acquire()
    first.release()
    assert os.path.exists(lock), "the first owner's release removed the second's lock"
    assert not second.try_acquire() and not remove_if_orphaned(lock)  # still held
    second.release()
    assert not os.path.exists(lock)


def test_the_install_step_builds_the_shm_op_where_every_trainer_of_this_environment_loads_it():
    # `make install` runs it: the first trainer to start loads the op instead of building it
    # for ~25 s while its heartbeat clock runs (after the install, this call only loads)
    make = (REPO / "Makefile").read_text()
    install = make[make.index("$(VENV)/.installed:"):make.index("touch $@")]
    assert "-m trainer.prebuild" in install
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    out = subprocess.run([sys.executable, "-m", "trainer.prebuild"], cwd=REPO,
                         env={**env, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.split() == ["built", "deepspeed_shm_comm", "in", default_extensions_dir()]
    built = os.listdir(os.path.join(default_extensions_dir(), "deepspeed_shm_comm"))
    assert any(name.endswith(".so") for name in built), built
