"""External faults for soak runs (benchmarks/goodput.py): real failures applied from outside
the run, at any moment, the way machines and services fail.

RunSpec faults (trainer/faults.py) fire inside the trainer at a chosen step; these need no
cooperation from the code under test and hit whatever the run is doing at the time:

- `kill_worker`: SIGKILL the trainer worker (a lost node). Its trainer children die with it
  (parent-death signal); the process manager starts a new worker and Temporal retries the
  segment once the heartbeat timeout has passed.
- `drain_worker`: SIGTERM the trainer worker (a pod eviction, a spot notice): it drains
  (activities/drain.py) — its segment commits at the current step and fails over at once
  with `Preempted` — and exits; the process manager starts a new one.
- `kill_rank`: SIGKILL the highest rank of the running segment (a lost GPU or process);
  torchrun stops the others and the supervisor records a `rank_lost` at once.
- `hang`: SIGSTOP the highest rank. The other ranks block in their next collective, the
  progress file goes quiet and the supervisor's `ops.hang_timeout_s` fires; it kills the
  process group (SIGKILL ends stopped processes too) and the segment is retried.
- `corrupt_checkpoint`: flip a byte in the largest file of the newest committed checkpoint
  on every tier that holds it (bit rot on the node's disk and in the object store), then
  SIGKILL the ranks so the retry has to resume: the checksum check reports each copy
  (`checkpoint_corrupt`) and resume falls back to the previous committed checkpoint.
- `s3_outage`: stop the S3 server for some seconds, then start it on the same port and data.
- `server_restart`: stop the Temporal server, wait some seconds (20 by default: a real server
  restart takes 20-30 s), start it on the same database and port
  (ops/services.TemporalDevServer.restart). The trainer trains on meanwhile; its worker
  records a `server_unavailable` fault and its `recovered` (activities/server_watch.py).
  With a heartbeat timeout shorter than the outage the server times the attempt out when
  it is back: the old attempt stops at a commit of its current step, the retry resumes there.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psutil
import structlog

from common.procs import RANK_NAME
from storage.checkpoints import CheckpointStore

log = structlog.get_logger(__name__)

CHAOS_KINDS = ("kill_worker", "drain_worker", "kill_rank", "hang", "corrupt_checkpoint",
               "s3_outage", "server_restart")
SERVER_DOWN_S = 20.0  # server_restart's default outage (a real restart takes 20-30 s)
RANK_MODULE = "trainer.segment"
LAUNCHER_MODULE = "torch.distributed.run"
STANDBY_RANK = re.compile(RANK_NAME.format(r"(\d+)"))


@dataclass(frozen=True)
class ProcInfo:
    """What identifies a trainer process: its pid, command line and RANK (None if unset)."""

    pid: int
    cmdline: tuple[str, ...]
    rank: int | None = None
    name: str = ""  # the kernel's process name (a standby's rank: trainer/standby.py)


def rank_pids(procs: Iterable[ProcInfo]) -> dict[int, int]:
    """{rank: pid} of the trainer ranks among `procs`: processes running `trainer.segment`
    with a RANK, not the torchrun launcher (whose command line names the module too) and not
    a rank's own helpers (the checkpoint writer inherits RANK but runs another module); or
    ranks a warm standby forked (trainer/standby.py), which carry their rank in their name."""
    ranks = {}
    for p in procs:
        if p.rank is not None and RANK_MODULE in p.cmdline and LAUNCHER_MODULE not in p.cmdline:
            ranks[p.rank] = p.pid
        elif (forked := STANDBY_RANK.fullmatch(p.name)) is not None:
            ranks[int(forked.group(1))] = p.pid
    return ranks


def cmdline_arg(cmdline: Iterable[str], flag: str) -> str | None:
    """The value after `flag` (or in `flag=value`) in a command line, else None."""
    args = list(cmdline)
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def process_tree(pid: int) -> list[ProcInfo]:
    """`pid`'s live descendants with their command lines and RANK."""
    out = []
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for child in children:
        try:
            rank = child.environ().get("RANK")
            out.append(ProcInfo(child.pid, tuple(child.cmdline()),
                                int(rank) if rank is not None else None, child.name()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def flip_byte(fs, path: str, offset: int | None = None) -> None:
    """Invert one byte (the middle one by default) of a file on any fsspec filesystem."""
    data = bytearray(fs.cat_file(path))
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0xFF
    fs.pipe_file(path, bytes(data))


def corrupt_newest(stores: Iterable[CheckpointStore]) -> list[dict]:
    """Flip a byte in the largest file of the newest checkpoint committed on any of `stores`,
    on each store that holds that step. Returns what was hit: [{url, step, file}]."""
    stores = list(stores)
    held = {id(s): s.list_committed() for s in stores}
    newest = max((max(steps) for steps in held.values() if steps), default=None)
    hit = []
    for store in stores:
        if newest is None or newest not in held[id(store)]:
            continue
        files = store.manifest(newest).files
        victim = max(sorted(files), key=lambda name: files[name].size)
        flip_byte(store.fs, store.path(newest, victim))
        hit.append({"url": store.url, "step": newest, "file": victim})
    return hit


def wait_gone(pids: Iterable[int], timeout_s: float = 30.0) -> None:
    """Until none of `pids` is alive (zombies count as gone)."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)


def wait_stopped(pid: int, timeout_s: float = 5.0) -> bool:
    """Until `pid` shows as stopped (a signal is delivered when the process next runs)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                return True
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.02)
    return False


@dataclass
class Chaos:
    """Applies CHAOS_KINDS to one run: its trainer worker (looked up anew each time: the
    fleet replaces it), its stores, and optionally the S3 server (stop / start) and the
    Temporal server (restart after the given seconds down)."""

    worker_pid: Callable[[], int]  # the current trainer worker's pid
    durable: CheckpointStore
    fast_root: str  # storage.fast/<run_id>: segment workdirs and the fast tier (ckpt) below
    s3_down: Callable[[], None] | None = None
    s3_up: Callable[[], None] | None = None
    temporal_restart: Callable[[float], object] | None = None  # stop, wait the seconds, start
    log: list[dict] = field(default_factory=list)

    def ranks(self) -> tuple[dict[int, int], list[ProcInfo]]:
        tree = process_tree(self.worker_pid())
        return rank_pids(tree), tree

    def apply(self, kind: str, **kw) -> dict:
        """Inject one fault now; returns its record (kind, ts, evidence). A process fault
        with no segment running returns {"skipped": reason} and injects nothing."""
        ts = time.time()
        evidence = getattr(self, kind)(**kw)
        record = {"kind": kind, "ts": ts, **evidence}
        log.warning("chaos_injected", **record)
        self.log.append(record)
        return record

    def kill_worker(self) -> dict:
        pid = self.worker_pid()
        os.kill(pid, signal.SIGKILL)
        return {"pid": pid}

    def drain_worker(self) -> dict:
        if not self.ranks()[0]:
            return {"skipped": "no trainer rank running"}
        pid = self.worker_pid()
        os.kill(pid, signal.SIGTERM)
        return {"pid": pid}

    def _victim(self) -> tuple[int, int] | None:
        ranks, _ = self.ranks()
        return (max(ranks), ranks[max(ranks)]) if ranks else None

    def kill_rank(self) -> dict:
        victim = self._victim()
        if victim is None:
            return {"skipped": "no trainer rank running"}
        os.kill(victim[1], signal.SIGKILL)
        return {"rank": victim[0], "pid": victim[1]}

    def hang(self) -> dict:
        victim = self._victim()
        if victim is None:
            return {"skipped": "no trainer rank running"}
        os.kill(victim[1], signal.SIGSTOP)
        return {"rank": victim[0], "pid": victim[1], "stopped": wait_stopped(victim[1])}

    def corrupt_checkpoint(self) -> dict:
        ranks, tree = self.ranks()
        if not ranks:
            return {"skipped": "no trainer rank running"}
        # the node's tier: the ranks' --fast-dir (storage/fast_tier.store_dir), not a
        # directory under the segment's workdir
        fast = cmdline_arg(next(p.cmdline for p in tree if p.pid in ranks.values()),
                           "--fast-dir") or os.path.join(self.fast_root, "ckpt")
        for pid in ranks.values():  # the ranks' writer process dies with rank 0
            os.kill(pid, signal.SIGKILL)
        wait_gone([p.pid for p in tree if LAUNCHER_MODULE not in p.cmdline])
        stores = [self.durable]
        if os.path.isdir(fast):
            stores.append(CheckpointStore.local(fast))
        return {"ranks": sorted(ranks), "corrupted": corrupt_newest(stores)}

    def s3_outage(self, seconds: float = 15.0) -> dict:
        t0 = time.time()
        self.s3_down()
        time.sleep(max(0.0, seconds - (time.time() - t0)))
        down = time.time()
        self.s3_up()
        return {"seconds": seconds, "down_s": round(down - t0, 2), "restarted_ts": time.time()}

    def server_restart(self, seconds: float = SERVER_DOWN_S) -> dict:
        if self.temporal_restart is None:
            return {"skipped": "no Temporal server to restart"}
        t0 = time.time()
        self.temporal_restart(seconds)  # returns once the server serves again
        back = time.time()
        return {"seconds": seconds, "down_s": round(back - t0, 2), "restarted_ts": back}
