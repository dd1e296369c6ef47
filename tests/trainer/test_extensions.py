"""DeepSpeed's JIT build directory: private per Python environment, stale locks cleared:
a lock whose owner died at once (real processes, real SIGKILL), any other by its age."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from torch.utils.file_baton import FileBaton

from tests.trainer.helpers import REPO
from trainer.extensions import (
    _wait_clearing_orphans,
    clear_stale_build_locks,
    default_extensions_dir,
)

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
