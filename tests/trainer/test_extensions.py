"""DeepSpeed's JIT build directory: private per Python environment, stale locks cleared."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.trainer.helpers import REPO
from trainer.extensions import clear_stale_build_locks, default_extensions_dir


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
