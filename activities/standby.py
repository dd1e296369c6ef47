"""A warm trainer launcher per trainer worker (trainer/standby.py): a cold torchrun start spent seconds importing torch and DeepSpeed before each launch.

`warm()` (the worker, at start) keeps one `python -m trainer.standby` process standing by:
torch, DeepSpeed and the trainer imported, nothing run. `take(env)` hands it to the
supervisor for the next launch and starts its replacement at once, so a retry on this
worker, an in-place restart or the run's next segment finds one ready too. A standby whose
import-time environment (`import_key`: the allow-listed child environment without the
per-launch variables) differs from the launch's is not used: the launch starts cold,
through torchrun, as it does where no standby is kept (a test's own supervisor, a worker
started with `--no-standby`).

Every standby is started by one long-lived thread: the parent-death signal fires when the
*thread* that started a child exits (prctl(2)), and a standby must die with the worker, not
with a short-lived helper thread. It is given the worker's pid to compare its parent with
(common/parentage.py), so a worker that is PID 1 of its container keeps one. A standby that
dies is seen at once (its stdout ends), and a launch waiting for it goes cold then.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

import structlog

from common.procs import set_parent_death_signal
from common.protocol import LaunchRequest

log = structlog.get_logger(__name__)

# Set per launch, not at import: a standby started without them serves any of their values.
PER_LAUNCH = frozenset({"TRACEPARENT", "TRACESTATE", "MAINSPRING_WORKER_PID"})
# After a take, the replacement waits for the launch's first step (`launch_stepping`), at
# most this long: its imports (3-7 s of CPU here) would otherwise compete with the ranks'
# start-up, restore and first step for a small node's cores. A launch that
# finds no standby ready hurries it.
REPLACE_AT_MOST_S = 30.0
# how long a standby let go while still importing may take to finish before it is killed
LET_GO_S = 300.0


def import_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """Pure: the part of a child environment a standby fixed when it imported torch."""
    return tuple(sorted((k, v) for k, v in env.items() if k not in PER_LAUNCH))


class Standby:
    """One started standby process; ready once its first line came."""

    def __init__(self, env: dict[str, str]) -> None:
        self.key = import_key(env)
        self.log = os.path.join(tempfile.gettempdir(), f"mainspring-standby-{os.getpid()}.log")
        # Its parent's pid, which it compares its own parent with: a parent that died
        # before the parent-death signal was armed shows as another parent. Not "parent is
        # 1": in a container the worker itself may be PID 1.
        cmd = [sys.executable, "-m", "trainer.standby", "--parent-pid", str(os.getpid())]
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                start_new_session=True, preexec_fn=set_parent_death_signal)
        self.started = time.monotonic()
        self.ready = threading.Event()
        self.settled = threading.Event()  # ready, or dead before it was: a take waits on this

    def wait_ready(self) -> bool:
        """Block until the standby says it is ready (False: it died first: its stdout's EOF
        comes with its exit, so a death is seen at once)."""
        try:
            line = self.proc.stdout.readline() if self.proc.stdout else b""
        except (OSError, ValueError):  # closed under us by a launch or a release
            line = b""
        if line.strip() == b"ready":
            self.ready.set()
            self.settled.set()
            log.info("standby_ready", pid=self.proc.pid,
                     import_s=round(time.monotonic() - self.started, 2))
            return True
        self.settled.set()
        log.warning("standby_failed", pid=self.proc.pid, rc=self.proc.poll(), log=self.log)
        return False

    def launch(self, req: LaunchRequest) -> subprocess.Popen:
        """Hand it the launch; it is the launcher from now on (its own process group)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((req.to_json() + "\n").encode())
        self.proc.stdin.close()
        if self.proc.stdout:
            self.proc.stdout.close()
        return self.proc

    def release(self) -> None:
        """Not to be used: its stdin closed, it exits (killed if it does not)."""
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()

    def let_go(self, grace_s: float) -> None:
        """Not used, and perhaps still importing: its stdin closed, it exits once its imports
        are done. Not killed there and then: inside DeepSpeed's JIT op load it holds the
        build directory's `lock` file, and a kill leaves that behind for every later rank to
        wait on (seen in CI: a standby still importing under load after 30 s was killed, and
        the cold launch's ranks waited on the lock until the test gave up). Killed only if
        it has not gone after `grace_s`. A lock a killed loader leaves anyway (a worker's
        shutdown, the parent-death signal) is an orphan, removed at once by whoever waits
        on it (trainer/extensions.py)."""
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass

        def reap() -> None:
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        threading.Thread(target=reap, name="standby-let-go", daemon=True).start()


class Pool:
    """At most one standby, started (and restarted after each take) by one thread."""

    def __init__(self, env: Callable[[], dict[str, str]]) -> None:
        self.env = env  # read at each start: the worker's environment as it is then
        self.current: Standby | None = None
        self.latest: Standby | None = None  # the last one started, taken or not
        self.lock = threading.Lock()
        self.wanted: queue.Queue[float | None] = queue.Queue()  # a delay; None: stop
        self.hurry = threading.Event()  # a launch waits: start the replacement now
        threading.Thread(target=self._keeper, name="mainspring-standby", daemon=True).start()
        self.wanted.put(0.0)

    def _keeper(self) -> None:
        while (delay := self.wanted.get()) is not None:
            self.hurry.wait(delay)
            self.hurry.clear()
            with self.lock:
                if self.current is not None and self.current.proc.poll() is None:
                    continue
                standby = self.current = self.latest = Standby(self.env())
            if not standby.wait_ready():
                with self.lock:
                    if self.current is standby:
                        self.current = None

    def take(self, env: dict[str, str], wait_s: float) -> Standby | None:
        """The standby for a launch with `env`, waiting up to `wait_s` for one still
        importing; None: launch cold. Its replacement is started either way. A standby that
        dies, before or while the launch waits, sends it cold at once."""
        deadline = time.monotonic() + wait_s
        standby = self._claim(deadline)
        self.hurry.clear()  # a hurry from before this take is not this launch's first step
        self.wanted.put(REPLACE_AT_MOST_S)
        if standby is None:
            return None
        if standby.key != import_key(env):
            log.info("standby_not_matching", pid=standby.proc.pid)
            standby.release()
            return None
        standby.settled.wait(max(0.0, deadline - time.monotonic()))
        if standby.proc.poll() is not None or (standby.settled.is_set()
                                               and not standby.ready.is_set()):
            log.warning("standby_dead", pid=standby.proc.pid, rc=standby.proc.poll(),
                        log=standby.log)
            standby.release()
            return None
        if not standby.ready.is_set():
            log.info("standby_not_ready", pid=standby.proc.pid, waited_s=wait_s)
            standby.let_go(LET_GO_S)
            return None
        return standby

    def _claim(self, deadline: float) -> Standby | None:
        """The current standby, taken from the pool; if there is none (taken a moment ago:
        a restart in place), the next one the keeper starts, hurried. One that dies before
        it is claimed is looked at too: it can come and go between two looks."""
        with self.lock:
            standby, self.current = self.current, None
            before = self.latest
        if standby is not None:
            return standby
        self.wanted.put(0.0)
        self.hurry.set()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            with self.lock:
                standby, self.current = self.current, None
                fresh = self.latest if self.latest is not before else None
            if standby is not None:
                return standby
            if fresh is not None and fresh.settled.is_set() and not fresh.ready.is_set():
                return fresh  # dead: take() sees it and goes cold
        return None

    def close(self) -> None:
        with self.lock:
            standby, self.current = self.current, None
        self.wanted.put(None)
        if standby is not None:
            standby.proc.kill()


_POOL: Pool | None = None


def warm(env: Callable[[], dict[str, str]]) -> Pool:
    """Keep a standby ready in this worker from now on (idempotent)."""
    global _POOL
    if _POOL is None:
        _POOL = Pool(env)
    return _POOL


def launch_stepping() -> None:
    """The launch that took the standby is stepping: start its replacement now."""
    if _POOL is not None:
        _POOL.hurry.set()


def take(env: dict[str, str], wait_s: float = 30.0) -> Standby | None:
    """This worker's ready standby for a launch with `env`, or None (no pool, no match)."""
    return _POOL.take(env, wait_s) if _POOL is not None else None
