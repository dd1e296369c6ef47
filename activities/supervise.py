"""Child-process supervision for trainer activities (DESIGN §1, §5).

The worker never trains in its own interpreter: it launches a child in its own process
group with a parent-death signal (no orphan keeps a GPU when the worker dies), tails the
child's progress file, heartbeats, detects hangs, and turns the child's exit into a
classified outcome (activities/child_exit.py). How a child is watched is one typed
Supervision; run_child runs one, ChildLoop is its loop.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import structlog
from temporalio.exceptions import CancelledError

from activities import standby
from activities.child_exit import (
    LauncherLog,
    classify_exit,
    first_failed_rank,
    hung,
    last_lines,
)
from activities.contracts import GangMember
from activities.hang import HangLimits, HangWatch
from common.cgroup import oom_kill_count, oom_kills_since
from common.errors import HardwareFault
from common.faults import Fault
from common.procs import (
    STOP_FILE,
    allowed_env,
    request_stop,
    set_parent_death_signal,
    with_repo_on_path,
)
from common.protocol import LaunchRequest, ProgressLine, StepLine, parse_line

log = structlog.get_logger(__name__)


def trainer_command(module: str, procs: int, args: list[str],
                    gang: GangMember | None = None) -> list[str]:
    """torchrun for the trainer entry points: `procs` ranks on this node — one node
    (`--standalone`), or this node's share of a multi-node segment with the static
    rendezvous the workflow chose (node ranks fixed, node 0's store; docs/decisions.md)."""
    if gang is None:
        launch = ["--standalone"]
    else:
        host, _, port = gang.master.rpartition(":")
        launch = [f"--nnodes={gang.nnodes}", f"--node-rank={gang.node_rank}",
                  f"--master-addr={host}", f"--master-port={port}", "--max-restarts=0"]
    return [sys.executable, "-m", "torch.distributed.run", *launch,
            f"--nproc_per_node={procs}", "-m", module, *args]


def trainer_launch(module: str, procs: int, args: list[str],
                   gang: GangMember | None = None) -> LaunchRequest:
    """The same launch as `trainer_command`, for a warm standby (trainer/standby.py); the
    supervisor fills in where it runs (cwd, log, env)."""
    at = {}
    if gang is not None:
        host, _, port = gang.master.rpartition(":")
        at = {"nnodes": gang.nnodes, "node_rank": gang.node_rank, "master_addr": host,
              "master_port": int(port)}
    return LaunchRequest(module=module, args=list(args), procs=procs, cwd="", log="", env={},
                         **at)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A trainer child's environment: the allow-listed part of ours (common/procs.py — never
    the Temporal credentials), the accelerator, and `extra` (the caller's own choice)."""
    env = allowed_env()
    env.setdefault("DS_ACCELERATOR", "cpu" if not _has_cuda_device() else "cuda")
    env["PYTHONUNBUFFERED"] = "1"
    env = with_repo_on_path(env)
    env.update(extra or {})
    return env


def _has_cuda_device() -> bool:
    return os.path.exists("/dev/nvidia0") and bool(os.environ.get("CUDA_VISIBLE_DEVICES", "0"))


class ProgressTail:
    """Reads the progress lines (common/protocol.py) appended since construction (or all of
    them, from_start); a line of a kind this version does not know is passed over."""

    def __init__(self, path: str, from_start: bool = False) -> None:
        self.path = path
        self.offset = 0 if from_start or not os.path.exists(path) else os.path.getsize(path)
        self._partial = ""

    def read(self) -> list[ProgressLine]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            text = f.read()
            self.offset = f.tell()
        text, self._partial = self._partial + text, ""
        lines = text.split("\n")
        if lines and lines[-1]:
            self._partial = lines.pop()
        return [p for p in map(parse_line, lines) if p is not None]


def _ignore(_: object) -> None:
    return None


def _nothing() -> None:
    return None


def _never() -> bool:
    return False


def _not_draining() -> str:
    return ""


@dataclass(frozen=True)
class Supervision:
    """How a child is watched (supervise / run_child). Every field has a default, so a
    caller names only what it needs.

    progress_file, on_progress: the child's progress lines (common/protocol.py), each passed
        to on_progress as it is read; heartbeat: called on every poll.
    is_cancelled, draining: when either says so (the activity was cancelled; the worker got
        SIGTERM, activities/drain.py, and draining() gives the reason) the child is asked to
        stop (common/procs.py STOP_FILE: it commits a checkpoint at the end of its current
        step and exits 0) and given stop_grace_s before it is killed; a child that stopped
        that way counts as success (its result says so; the caller tells a drain from a
        cancel).
    stop_quiet_s: a multi-node segment's member that shows no step within max(stop_quiet_s,
        3 x the time between its last two steps) of the stop request is killed at once: its
        peers are gone or stuck, and it cannot stop at a step without them.
    hang: the timeout a quiet progress file is hung after (activities/hang.py; a number:
        that many seconds, fixed); step_times (HangWatch) carries the step times it is
        measured by from an earlier launch of the attempt.
    on_failure: a retryable failure is described to it (a Fault) before it is raised.
    warm: the same launch as the command, for a standby ready in this worker
        (activities/standby.py), which launches it without torchrun's and the ranks' imports.
    poll_s: how often the loop looks.
    """

    progress_file: str | None = None
    on_progress: Callable[[ProgressLine], None] = _ignore
    heartbeat: Callable[[], None] = _nothing
    is_cancelled: Callable[[], bool] = _never
    draining: Callable[[], str] = _not_draining
    stop_grace_s: float = 300.0
    stop_quiet_s: float | None = None
    hang: HangLimits | float = 600.0
    step_times: deque[float] | None = None
    on_failure: Callable[[Fault], None] = _ignore
    warm: LaunchRequest | None = None
    poll_s: float = 1.0


def supervise(cmd: list[str], *, workdir: str, env: dict[str, str], **options: Any) -> None:
    """run_child with the Supervision fields given by name."""
    run_child(cmd, workdir, env, Supervision(**options))


def run_child(cmd: list[str], workdir: str, env: dict[str, str], how: Supervision) -> None:
    """Run a child to completion in `workdir`; raise a classified error if it does not
    succeed: a retryable HardwareFault (a hang, a lost rank, a crash), the ApplicationError
    its error.json names, or CancelledError when it was stopped and did not stop cleanly."""
    log_path = _fresh_workdir(workdir)
    oom_before = oom_kill_count()  # a rank the kernel kills for memory raises it
    proc = _start(cmd, workdir, env, log_path, how.warm)
    loop = ChildLoop(how, workdir, log_path)
    try:
        rc = loop.until_exit(proc)
    finally:
        _kill_group(proc)
    if loop.stop_at is not None and rc != 0:
        raise CancelledError(f"activity cancelled; trainer exited with {rc} while stopping")
    classify_exit(rc, workdir, log_path, how.on_failure, oom_kills=oom_kills_since(oom_before),
                   lost_rank=loop.lost_rank)


def _fresh_workdir(workdir: str) -> str:
    """The workdir without what an earlier launch left there to be read; the log's path."""
    os.makedirs(workdir, exist_ok=True)
    for stale in ("error.json", "result.json", STOP_FILE, *(
            n for n in os.listdir(workdir) if n.startswith("rank") and n.endswith(".pid"))):
        if os.path.exists(os.path.join(workdir, stale)):
            os.unlink(os.path.join(workdir, stale))
    return os.path.join(workdir, "child.log")


def _start(cmd: list[str], workdir: str, env: dict[str, str], log_path: str,
           warm: LaunchRequest | None) -> subprocess.Popen:
    """The child: from this worker's warm standby when it has one ready, else `cmd` in its
    own process group with a parent-death signal."""
    ready = standby.take(env) if warm is not None else None
    if ready is not None:
        proc = ready.launch(dataclasses.replace(warm, cwd=workdir, log=log_path, env=env))
    else:
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=set_parent_death_signal)
    log.info("child_started", pid=proc.pid, cmd=" ".join(cmd[-8:]), log=log_path,
             warm=ready is not None)
    return proc


class ChildLoop:
    """The supervisor's loop over one child: read its progress, heartbeat, ask it to stop
    when cancelled or draining, and raise when it hangs, a rank is lost, or a stop is not
    honoured in time."""

    def __init__(self, how: Supervision, workdir: str, log_path: str) -> None:
        self.how, self.workdir, self.log_path = how, workdir, log_path
        self.tail = ProgressTail(how.progress_file) if how.progress_file else None
        hang = how.hang if isinstance(how.hang, HangLimits) else HangLimits.fixed(how.hang)
        self.watch = HangWatch(hang, started=time.monotonic(), times=how.step_times)
        self.launcher = LauncherLog(log_path)
        self.steps = StepGaps()
        self.last_progress_ts = time.time()
        self.stop_at: float | None = None  # monotonic time of the stop request
        self.seen_since_stop = False
        self.lost_rank: int | None = None

    def until_exit(self, proc: subprocess.Popen) -> int:
        """The child's exit code (1 when a lost rank left an error.json to classify)."""
        while True:
            rc = proc.poll()
            self.read_progress()
            self.how.heartbeat()
            if rc is not None:
                return rc
            self.stop_if_asked(proc.pid)
            self.check_stop_deadlines()
            if self.stop_at is None and self.launcher.stopping_peers() and self.rank_lost():
                return 1  # the rank said why it failed (an OOM, a crash): classify that
            late = self.watch.overdue(time.monotonic()) if self.tail else None
            if late:
                raise hung(late[0], late[1], self.workdir, self.log_path,
                            self.last_progress_ts, self.how.on_failure)
            time.sleep(self.how.poll_s)

    def read_progress(self) -> None:
        for line in self.tail.read() if self.tail else ():
            self.watch.seen(line, time.monotonic())
            self.last_progress_ts = time.time()
            self.seen_since_stop = self.seen_since_stop or self.stop_at is not None
            if self.steps.last_ts is None and isinstance(line, StepLine):
                standby.launch_stepping()  # its replacement may import now
            self.steps.seen(line, time.monotonic())
            self.how.on_progress(line)

    def stop_if_asked(self, pid: int) -> None:
        """Cancelled or draining: ask the child to stop at its next step (once)."""
        how = self.how
        if self.stop_at is None and (how.is_cancelled() or how.draining()):
            why = how.draining() or "activity cancelled"
            request_stop(self.workdir, why)
            self.stop_at, self.watch.stopping = time.monotonic(), True
            log.info("child_stop_requested", pid=pid, grace_s=how.stop_grace_s, reason=why)

    def check_stop_deadlines(self) -> None:
        """A child asked to stop that shows no step in time (a gang member), or does not
        stop within the grace: killed (the caller's finally), the activity cancelled."""
        if self.stop_at is None:
            return
        waited = time.monotonic() - self.stop_at
        quiet = self.how.stop_quiet_s
        if quiet is not None and not self.seen_since_stop \
                and waited > max(quiet, 3 * self.steps.last_gap):
            raise CancelledError(f"activity cancelled; no step within {waited:.1f}s of the "
                                 "stop request (its peers are gone): killed")
        if waited > self.how.stop_grace_s:
            raise CancelledError(f"activity cancelled; trainer did not stop within "
                                 f"{self.how.stop_grace_s:.0f}s and was killed")

    def rank_lost(self) -> bool:
        """torchrun saw a rank die and is stopping the rest: they may be blocked in a
        collective and ignore its SIGTERM for 30 s, so nothing is left to wait for. Who
        died: a standby's summary names it; torchrun's comes later, so the rank seen gone
        before the kill. True when the rank said why (its error.json) for the exit to be
        classified by; else the fault is described and raised here."""
        rank = self.lost_rank = first_failed_rank(self.launcher, self.workdir)
        if os.path.exists(os.path.join(self.workdir, "error.json")):
            return True
        why = (f"rank {rank} died" if rank is not None else "a rank died") + \
            "; torchrun was stopping the others"
        self.how.on_failure(Fault("rank_lost", why, rank=rank,
                                  log_tail=tuple(last_lines(self.log_path)),
                                  fault_ts=time.time(), detected_ts=time.time()))
        raise HardwareFault(why)


class StepGaps:
    """The time between the child's last two step lines (0 before two were seen)."""

    def __init__(self) -> None:
        self.last_ts: float | None = None
        self.last_gap = 0.0

    def seen(self, line: ProgressLine, now: float) -> None:
        if isinstance(line, StepLine):
            if self.last_ts is not None:
                self.last_gap = now - self.last_ts
            self.last_ts = now


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)


