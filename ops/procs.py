"""Worker processes as a local process manager would run them (demo, tests).

`WorkerFleet` starts one `mainspring worker` process per role and, like systemd or a
Kubernetes Deployment, starts a replacement when one dies — the run itself never waits
for a human.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends `sig` to this process when the thread that started it dies.

    Used as `preexec_fn` for every child we start (services, workers, trainers), so a
    killed parent — a worker, a test run — never leaves an orphan holding ports or a GPU.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))


# Graceful stop of a supervised child: the supervisor writes this file in the child's workdir
# (reason inside); the trainer checks it after every step, commits a checkpoint at that step
# and exits 0. A file, not a signal: torchrun treats SIGTERM as a failure of the job.
STOP_FILE = "STOP"


def request_stop(workdir: str, reason: str) -> None:
    with open(os.path.join(workdir, STOP_FILE), "w") as f:
        f.write(reason)


def stop_requested(workdir: str) -> str:
    """The stop reason written by request_stop, or '' when none was requested."""
    try:
        with open(os.path.join(workdir, STOP_FILE)) as f:
            return f.read() or "stop requested"
    except FileNotFoundError:
        return ""


def worker_command(role: str, address: str, namespace: str = "default") -> list[str]:
    return [sys.executable, "-m", "ops.cli", "worker", "--role", role, "--address", address,
            "--namespace", namespace]


@dataclass
class WorkerFleet:
    address: str
    roles: tuple[str, ...] = ("orchestrator", "data", "trainer")
    log_dir: str = ".mainspring/logs"
    restart: bool = True
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def spawn(self, role: str) -> subprocess.Popen:
        os.makedirs(self.log_dir, exist_ok=True)
        out = open(os.path.join(self.log_dir, f"worker-{role}.log"), "ab")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(worker_command(role, self.address), stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=set_parent_death_signal)
        self.procs[role] = proc
        log.info("worker_spawned", role=role, pid=proc.pid)
        return proc

    def start(self) -> "WorkerFleet":
        for role in self.roles:
            self.spawn(role)
        if self.restart:
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            for role, proc in list(self.procs.items()):
                if proc.poll() is not None and not self._stop.is_set():
                    self.restarts[role] = self.restarts.get(role, 0) + 1
                    log.warning("worker_died_restarting", role=role, pid=proc.pid,
                                code=proc.returncode, restarts=self.restarts[role])
                    self.spawn(role)

    def kill(self, role: str, sig: int = signal.SIGKILL) -> int:
        proc = self.procs[role]
        os.kill(proc.pid, sig)
        return proc.pid

    def stop(self) -> None:
        self._stop.set()
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
