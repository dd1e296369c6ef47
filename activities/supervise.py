"""Child-process supervision for trainer activities (DESIGN §1, §5).

The worker never trains in its own interpreter: it launches a child in its own process
group with a parent-death signal (no orphan keeps a GPU when the worker dies), tails the
child's progress file, heartbeats, detects hangs, and turns the child's exit into a
classified outcome: 0 = done; an error.json written by the child names the class
(BadConfig/BadData non-retryable, StorageUnavailable retryable); anything else is a
retryable HardwareFault.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import structlog
from temporalio.exceptions import ApplicationError, CancelledError

from activities import standby
from activities.contracts import GangMember
from activities.hang import HangLimits, HangWatch, Timeout
from common.cgroup import oom_kill_count, oom_kills_since
from common.errors import NON_RETRYABLE, HardwareFault
from common.fault_kinds import classify, signal_name, torchrun_root_cause
from common.procs import (
    STOP_FILE,
    allowed_env,
    request_stop,
    set_parent_death_signal,
    with_repo_on_path,
)
from common.protocol import ErrorReport, LaunchRequest, ProgressLine, StepLine, parse_line
from common.redact import redact, redact_value

log = structlog.get_logger(__name__)

@dataclass(frozen=True)
class ChildFailure:
    """What the supervisor saw of a child that failed (a retryable failure: bad input and
    divergence are decisions, not faults): the fault kind (common/fault_kinds.py) and its
    evidence — the failed rank and its exit code (torchrun's root cause), the signal, the
    type error.json named, the last log lines (scrubbed), when it happened and when seen."""

    kind: str
    evidence: str
    exit_code: int | None = None
    signal: str | None = None
    rank: int | None = None
    error_type: str = ""
    frame: str = ""  # where the exception was raised (error.json), for the repeat signature
    log_tail: tuple[str, ...] = ()
    fault_ts: float = 0.0
    detected_ts: float = 0.0
    # a hang's timeout: which fired, its value, how it came about, the measured p99 step
    timeout: dict | None = None

    def payload(self) -> dict:
        return {**(self.timeout or {}), "kind": self.kind, "injected": False, "evidence": self.evidence,
                "exit_code": self.exit_code, "signal": self.signal, "rank": self.rank,
                "error_type": self.error_type, "frame": self.frame,
                "log_tail": list(self.log_tail),
                "fault_ts": round(self.fault_ts, 3), "detected_ts": round(self.detected_ts, 3),
                "detection_s": round(max(0.0, self.detected_ts - self.fault_ts), 3)}


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


def supervise(cmd: list[str], *, workdir: str, env: dict[str, str],
              progress_file: str | None = None, on_progress: Callable[[ProgressLine], None] = lambda _: None,
              heartbeat: Callable[[], None] = lambda: None,
              is_cancelled: Callable[[], bool] = lambda: False,
              hang: HangLimits | float = 600.0, stop_grace_s: float = 300.0,
              poll_s: float = 1.0,
              on_failure: Callable[[ChildFailure], None] = lambda _: None,
              draining: Callable[[], str] = lambda: "",
              stop_quiet_s: float | None = None,
              warm: LaunchRequest | None = None,
              step_times: deque[float] | None = None) -> None:
    """Run a child to completion; raise a classified error if it does not succeed.

    With `warm` (the same launch as `cmd`) and a standby ready in this worker
    (activities/standby.py), the standby launches it without torchrun's and the ranks'
    imports; otherwise `cmd` is started. `step_times` (activities/hang.py HangWatch) carries
    the step times the hang timeout is measured by from an earlier launch of the attempt.

    On cancellation, or when `draining()` gives a reason (the worker got SIGTERM,
    activities/drain.py), the child is asked to stop (common/procs.py STOP_FILE: it commits
    a checkpoint at the end of its current step and exits 0) and given `stop_grace_s`
    before it is killed; a child that stopped that way counts as success (its result says
    so; the caller tells a drain from a cancel).
    A retryable failure is described to `on_failure` (ChildFailure) before it is raised.
    With `stop_quiet_s` (a multi-node segment) a child that shows no step within
    max(stop_quiet_s, 3 x the time between its last two steps) of the stop request is
    killed at once: its peers are gone or stuck, and it cannot stop at a step without them.
    A child whose progress file stays quiet past the timeout `hang` sets (activities/hang.py;
    a number: that many seconds, fixed) is hung: it is killed and a HardwareFault raised.
    """
    os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, "child.log")
    tail = ProgressTail(progress_file) if progress_file else None
    for stale in ("error.json", "result.json", STOP_FILE, *(
            n for n in os.listdir(workdir) if n.startswith("rank") and n.endswith(".pid"))):
        if os.path.exists(os.path.join(workdir, stale)):
            os.unlink(os.path.join(workdir, stale))
    oom_before = oom_kill_count()  # a rank the kernel kills for memory raises it
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
    last_progress_ts, stop_at, lost_rank = time.time(), None, None
    seen_since_stop, steps = False, StepGaps()
    watch = HangWatch(hang if isinstance(hang, HangLimits) else HangLimits.fixed(hang),
                      started=time.monotonic(), times=step_times)
    launcher = LauncherLog(log_path)
    try:
        while True:
            rc = proc.poll()
            for line in tail.read() if tail else ():
                watch.seen(line, time.monotonic())
                last_progress_ts = time.time()
                seen_since_stop = seen_since_stop or stop_at is not None
                if steps.last_ts is None and isinstance(line, StepLine):
                    standby.launch_stepping()  # its replacement may import now
                steps.seen(line, time.monotonic())
                on_progress(line)
            heartbeat()
            if rc is not None:
                break
            if stop_at is None and (is_cancelled() or draining()):
                why = draining() or "activity cancelled"
                request_stop(workdir, why)
                stop_at, watch.stopping = time.monotonic(), True
                log.info("child_stop_requested", pid=proc.pid, grace_s=stop_grace_s, reason=why)
            if (stop_at is not None and stop_quiet_s is not None and not seen_since_stop
                    and time.monotonic() - stop_at > max(stop_quiet_s, 3 * steps.last_gap)):
                raise CancelledError(f"activity cancelled; no step within "
                                     f"{time.monotonic() - stop_at:.1f}s of the stop request "
                                     "(its peers are gone): killed")
            if stop_at is not None and time.monotonic() - stop_at > stop_grace_s:
                raise CancelledError(f"activity cancelled; trainer did not stop within "
                                     f"{stop_grace_s:.0f}s and was killed")
            if stop_at is None and launcher.stopping_peers():
                # torchrun saw a rank die and is stopping the rest: they may be blocked in a
                # collective and ignore its SIGTERM for 30 s — nothing is left to wait for
                # who died: a standby's summary names it; torchrun's comes later, so the
                # rank seen gone before the kill
                rank = lost_rank = first_failed_rank(launcher, workdir)
                if os.path.exists(os.path.join(workdir, "error.json")):
                    rc = 1  # the rank said why it failed (an OOM, a crash): classify that
                    break
                why = (f"rank {rank} died" if rank is not None else "a rank died") + \
                    "; torchrun was stopping the others"
                on_failure(ChildFailure("rank_lost", why, rank=rank,
                                        log_tail=tuple(_last_lines(log_path)),
                                        fault_ts=time.time(), detected_ts=time.time()))
                raise HardwareFault(why)
            late = watch.overdue(time.monotonic()) if tail else None
            if late:
                raise _hung(late[0], late[1], workdir, log_path, last_progress_ts, on_failure)
            time.sleep(poll_s)
    finally:
        _kill_group(proc)
    if stop_at is not None and rc != 0:
        raise CancelledError(f"activity cancelled; trainer exited with {rc} while stopping")
    _classify_exit(rc, workdir, log_path, on_failure, oom_kills=oom_kills_since(oom_before),
                   lost_rank=lost_rank)


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


class LauncherLog:
    """New output of the child's log, watched for torchrun stopping the surviving ranks
    (`Sending process N closing signal SIGTERM`): the sign that one of them died."""

    SIGN = "closing signal SIGTERM"

    def __init__(self, path: str) -> None:
        self.path = path
        self.start = self.offset = os.path.getsize(path) if os.path.exists(path) else 0

    def since_start(self, limit: int = 1 << 16) -> str:
        """The last `limit` bytes this launch wrote."""
        try:
            with open(self.path, "rb") as f:
                f.seek(max(self.start, os.path.getsize(self.path) - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stopping_peers(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                new = f.read()
        except OSError:
            return False
        self.offset += len(new)
        return self.SIGN.encode() in new


def _hung(timeout: Timeout, waited_s: float, workdir: str, log_path: str, last_ts: float,
          on_failure: Callable[[ChildFailure], None]) -> HardwareFault:
    """The fault of a child that went quiet past `timeout`: described, then to be raised."""
    why = timeout.evidence(waited_s)
    rank = stopped_rank(workdir)
    if rank is not None:  # SIGSTOP (ops/chaos.py `hang`), or a debugger holding it
        why += f"; rank {rank} is stopped"
    on_failure(ChildFailure("hang", why, rank=rank, log_tail=tuple(_last_lines(log_path)),
                            fault_ts=last_ts, detected_ts=time.time(),
                            timeout=timeout.payload(waited_s)))
    log.warning("trainer_hung", timeout=timeout.name, timeout_s=round(timeout.limit_s, 1),
                waited_s=round(waited_s, 1), p99_step_s=timeout.p99_step_s, rank=rank)
    return HardwareFault(why)


def stopped_rank(workdir: str) -> int | None:
    """The lowest rank whose process (its `rank<r>.pid` file) is stopped (state T or t)."""
    for rank, pid in _rank_pids(workdir):
        if pid and _state(pid) in ("T", "t"):
            return rank
    return None


def _rank_pids(workdir: str) -> list[tuple[int, int]]:
    out = []
    for name in sorted(os.listdir(workdir)):
        if name.startswith("rank") and name.endswith(".pid"):
            try:
                with open(os.path.join(workdir, name)) as f:
                    out.append((int(name[4:-4]), int(f.read().strip() or 0)))
            except (OSError, ValueError):
                continue
    return sorted(out)


def _state(pid: int) -> str:
    """A process's state letter from /proc (R, S, T, Z, ...); "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def first_failed_rank(launcher: LauncherLog, workdir: str) -> int | None:
    """The rank this launch's failure summary names, else the lowest one gone."""
    rank, _ = torchrun_root_cause(launcher.since_start())
    return rank if rank is not None else dead_rank(workdir)


def dead_rank(workdir: str) -> int | None:
    """The lowest rank whose process (its `rank<r>.pid` file, trainer/segment.py) is gone."""
    for rank, pid in _rank_pids(workdir):
        if pid and _state(pid) in ("", "Z", "X"):
            return rank
    return None


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)


def _classify_exit(rc: int, workdir: str, log_path: str,
                   on_failure: Callable[[ChildFailure], None] = lambda _: None,
                   oom_kills: int = 0, lost_rank: int | None = None) -> None:
    if rc == 0:
        return
    seen = time.time()
    error_file = os.path.join(workdir, "error.json")
    lines = _last_lines(log_path, 200)
    rank, rank_code = torchrun_root_cause("\n".join(lines))
    if rank is None:  # stopped before torchrun's summary: the rank seen gone at the time
        rank = lost_rank
    code = rank_code if rank_code is not None else rc  # torchrun itself exits 1
    # torchrun exits 1 whatever its rank's code was, so error.json (removed before each
    # start) is the evidence of bad input, not the exit code alone.
    if os.path.exists(error_file):
        with open(error_file) as f:
            # the message may quote a URL or a config
            err = ErrorReport.from_json(redact_value(json.load(f)))
        retryable = err.type not in NON_RETRYABLE and err.retryable
        if retryable:
            kind = classify(code, err.type, lines, oom_kills=oom_kills, message=err.message)
            on_failure(ChildFailure(kind, err.message[:500], exit_code=code,
                                    signal=signal_name(code), rank=rank, error_type=err.type,
                                    frame=err.frame, log_tail=tuple(lines[-8:]),
                                    fault_ts=seen, detected_ts=seen))
        raise ApplicationError(err.message, err.to_dict(), type=err.type,
                               non_retryable=not retryable)
    name = signal_name(code)
    who = f"rank {rank}" if rank is not None else "trainer"
    how = f"killed by {name}" if name else f"exit code {code}"
    last = " | ".join(line[:300] for line in lines[-6:])
    if oom_kills:
        how += f" (the kernel's OOM killer killed {oom_kills} process(es) in this cgroup)"
    on_failure(ChildFailure(classify(code, "", lines, oom_kills=oom_kills), f"{who} {how}",
                            exit_code=code,
                            signal=name, rank=rank, log_tail=tuple(lines[-8:]), fault_ts=seen,
                            detected_ts=seen))
    raise HardwareFault(f"{who} {how}; last output: {last}", exit_code=code)


def _last_lines(path: str, lines: int = 8) -> list[str]:
    """The child's last lines, scrubbed: they go into a failure that Temporal keeps in the
    run's history and into the fault event, and a crashing child may have printed a key or
    its environment. Scrubbed before cutting, so a cut cannot halve a secret."""
    try:
        with open(path, errors="replace") as f:
            return [redact(line.rstrip())[:500] for line in deque(f, maxlen=lines)
                    if line.strip()]
    except OSError:
        return []
