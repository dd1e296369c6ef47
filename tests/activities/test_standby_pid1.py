"""A trainer worker's standby in a container, with the worker as PID 1 of its PID namespace
(a manifest that names `mainspring` as the container's command, without an init): the
standby stays up and takes a launch, the deploy/k8s trainer command run that way keeps
one, and a standby still dies with a worker that is SIGKILLed. Real processes in a real PID
namespace (`unshare --pid --fork --mount-proc`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import yaml

from common.parentage import parent_of
from ops.services import free_port
from tests.trainer.helpers import REPO

# The worker's part, as `ops/worker.py` does it: warm this process's standby pool, then take
# the standby for a launch. It reports what it found and stays until its stdin closes.
WORKER = """
import json, os, sys, time
from activities import standby
from activities.supervise import child_env
standby.warm(child_env)
started = time.monotonic()
taken = standby.take(child_env(), wait_s=float(sys.argv[1]))
state = {"pid": os.getpid(), "taken": taken is not None,
         "waited_s": round(time.monotonic() - started, 1)}
if taken is not None:
    time.sleep(1.0)  # a standby that takes itself for an orphan is gone by now
    state.update(standby=taken.proc.pid, alive=taken.proc.poll() is None)
print(json.dumps(state), flush=True)
sys.stdin.read()
"""

# PID 1 as an init is: it starts the worker, and here SIGKILLs it once its standby is up,
# then reaps what comes to it (orphans are re-parented to PID 1) while it watches the
# standby go.
INIT_KILLS_WORKER = """
import json, os, signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
state = json.loads(next(ln for ln in worker.stdout if ln.startswith("{")))
state["init_pid"] = os.getpid()
if state.get("alive"):
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    deadline, gone = time.monotonic() + 10, False
    while not gone and time.monotonic() < deadline:
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pass
        gone = not os.path.exists(f"/proc/{state['standby']}")
        time.sleep(0.05)
    state["standby_gone"] = gone
print(json.dumps(state), flush=True)
"""

WAIT_S = 180.0  # a standby's imports: 3-7 s of CPU, far more on a loaded machine


def namespace_error() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, text=True, timeout=30)
    return None if probe.returncode == 0 else f"no PID namespace here: {probe.stderr.strip()}"


pytestmark = [pytest.mark.skipif(namespace_error() is not None,
                                 reason=str(namespace_error())), pytest.mark.process]


def in_pid_namespace(*argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                             sys.executable, *argv], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def report(proc: subprocess.Popen) -> dict:
    """The state line PID 1 prints (the other lines are the pool's log)."""
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    pytest.fail(f"the namespace's PID 1 printed no state (exit {proc.wait()})")


def close(proc: subprocess.Popen) -> None:
    """Its stdin closed, PID 1 leaves and the namespace with it; killed if it does not
    (unshare --kill-child takes PID 1 along)."""
    proc.stdin.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_a_worker_that_is_pid_1_keeps_its_standby_and_hands_it_a_launch():
    ns = in_pid_namespace("-c", WORKER, str(WAIT_S))
    try:
        state = report(ns)
    finally:
        close(ns)
    assert state["pid"] == 1, "the worker was not PID 1: this test would prove nothing"
    assert state["taken"], f"no standby for the launch after {state['waited_s']} s"
    assert state["alive"], "the standby took the worker (PID 1) for init and left"


def test_a_standby_still_dies_with_its_worker_when_pid_1_is_an_init():
    ns = in_pid_namespace("-c", INIT_KILLS_WORKER, WORKER, str(WAIT_S))
    try:
        state = report(ns)
    finally:
        close(ns)
    assert state["init_pid"] == 1 and state["pid"] != 1
    assert state["taken"] and state["alive"], state
    assert state["standby_gone"], "the standby outlived its SIGKILLed worker"


def test_a_worker_that_is_pid_1_whose_standbys_all_die_launches_cold_without_waiting():
    """Every standby dies at start (here: an import-time environment it cannot start in,
    as a standby that took PID 1 for init did): each launch goes cold at once."""
    started = time.monotonic()
    broken = WORKER.replace("standby.warm(child_env)",
                            "standby.warm(lambda: {**child_env(), 'PYTHONHOME': '/nowhere'})")
    broken = broken.replace("standby.take(child_env(),",
                            "standby.take({**child_env(), 'PYTHONHOME': '/nowhere'},")
    ns = in_pid_namespace("-c", broken, str(WAIT_S))
    try:
        state = report(ns)
    finally:
        close(ns)
    assert state["pid"] == 1 and not state["taken"]
    assert state["waited_s"] < 15, f"the launch waited {state['waited_s']} s on dead standbys"
    assert time.monotonic() - started < 60


def k8s_trainer_argv(fast_root: str) -> list[str]:
    """deploy/k8s/trainers.yaml's trainer command with its init left out, so the worker is
    PID 1 (what a manifest naming `mainspring` as its command gives), on this machine: its
    pod fields and ports filled in."""
    with open(os.path.join(REPO, "deploy", "k8s", "trainers.yaml")) as f:
        (sts,) = [d for d in yaml.safe_load_all(f) if d and d["kind"] == "StatefulSet"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    argv = c["command"] + c["args"]
    argv = argv[argv.index("mainspring"):]
    fill = {"$(POD_NAME)": "trainer-0", "$(POD_IP)": "127.0.0.1", "/fast": fast_root}
    out = []
    for tok in argv:
        flag, eq, value = tok.partition("=")
        if flag in ("--metrics-port", "--temporal-metrics-port"):
            value = str(free_port())
        out.append(f"{flag}{eq}{fill.get(value, value)}" if eq else tok)
    return [os.path.join(os.path.dirname(sys.executable), out[0]), *out[1:]]


def test_the_k8s_trainer_command_as_pid_1_keeps_a_standby_up(temporal_server, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TEMPORAL_ADDRESS": temporal_server.address,
           "DS_ACCELERATOR": "cpu"}  # the manifest's cuda, on this CPU-only machine
    ns = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                           *k8s_trainer_argv(str(tmp_path / "fast"))],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(ns.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + WAIT_S
        while not any("standby_" in ln for ln in seen) and time.monotonic() < deadline:
            assert ns.poll() is None, "".join(seen)[-3000:]
            time.sleep(0.2)
        events = [ln for ln in seen if "standby_" in ln]
        assert events and "standby_ready" in events[0], "".join(seen)[-3000:]
        standby = [p for p in os.listdir("/proc") if p.isdigit()
                   and parent_of(parent_of(int(p))) == ns.pid and is_standby(int(p))]
        time.sleep(1.0)
        assert standby and all(os.path.exists(f"/proc/{p}") for p in standby)
        assert "workers_started" in "".join(seen)
    finally:
        ns.kill()  # unshare --kill-child takes PID 1, and the namespace with it
        ns.wait()


def is_standby(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"trainer.standby" in f.read()
    except OSError:
        return False
