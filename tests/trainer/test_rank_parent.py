"""A rank tells a launcher that died before the rank armed its parent-death signal from one
that lives, without taking PID 1 for init: real processes, a real subreaper (what a
container's init or a worker that is PID 1 is to an orphan)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common.procs import WORKER_PID_ENV
from tests.trainer.helpers import REPO

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)

# The worker: a subreaper (orphans below it come to it, as they come to PID 1 in a
# container), which starts a launcher (torchrun's or the standby's place) that starts the
# rank. With "dies" the launcher leaves at once, before the rank's interpreter is up.
WORKER = """
import ctypes, json, os, subprocess, sys
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
os.environ["MAINSPRING_WORKER_PID"] = str(os.getpid())
launcher = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.executable,
                             "-m", "trainer.segment", "--help"], stdout=subprocess.PIPE,
                            text=True)
rank = int(launcher.stdout.readline())
if launcher.wait() == 0:  # it left the rank behind, to us: its orphan's exit is ours to see
    _, status = os.waitpid(rank, 0)
    code = os.waitstatus_to_exitcode(status)
else:  # it waited for the rank and passed on its exit code (+100)
    code = launcher.returncode - 100
print(json.dumps({"rank_rc": code}), flush=True)
"""
LAUNCHER = """
import os, subprocess, sys
rank = subprocess.Popen(sys.argv[2:], stdout=subprocess.DEVNULL)
print(rank.pid, flush=True)
if sys.argv[1] == "dies":
    os._exit(0)
sys.exit(100 + rank.wait())
"""


def rank_exit(launcher: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    env.pop(WORKER_PID_ENV, None)
    out = subprocess.run([sys.executable, "-c", WORKER, LAUNCHER, launcher], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["rank_rc"]


def test_a_rank_whose_launcher_lives_goes_on():
    assert rank_exit("lives") == 0  # `--help` printed: past the parent check


def test_a_rank_whose_launcher_died_first_exits_though_a_subreaper_not_pid_1_adopted_it():
    assert rank_exit("dies") == 1
