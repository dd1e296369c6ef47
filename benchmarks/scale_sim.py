"""The simulated trainer child of the scale harness (benchmarks/scale_nodes.py hosts it):
a thread that speaks the trainer's progress protocol in place of `torchrun -m trainer.segment`.

A SimChild has the Popen surface the supervisor's ChildLoop uses (pid, poll). Rank 0 (a
gang's node 0) writes a start line, a step line per step (every `SimConfig.step_s` real
seconds), a commit line per checkpoint, result.json at the end; it commits each checkpoint
through the real commit protocol (storage/checkpoints.py: one tiny file, the manifest last),
writes the trainer's events (checkpoint_saved, checkpoint_committed) and its `startup`,
`steps a-b` window and `checkpoint stage` spans as trainer/tracing.py lays them out (what
ops/goodput.py from_record reads), and honours the supervisor's stop file (a checkpoint at
the current step, exit 0). A follower mirrors node 0's steps. The members of one launch
step together on a GangClock: a member that dies or stalls stalls the others, as a broken
collective does, until their supervisors kill them. Rank 0's step executions and launches go
to the host's Record (truth.jsonl): the simulation's ground truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from activities.contracts import NodeInfo
from common.procs import STOP_FILE
from common.protocol import (
    CommitLine,
    ProgressLine,
    SegmentOutcome,
    SegmentResult,
    StartLine,
    StepLine,
)
from spec import RunSpec
from storage.checkpoints import CheckpointStore
from storage.events import EventLog
from storage.spans import DurableSpanExporter

log = structlog.get_logger(__name__)

STRIKES = ("rank_lost", "hang", "node_lost")
_PIDS = itertools.count(1 << 30)  # a SimChild's pid: only logged, never signalled


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """How the simulated trainers run."""

    step_s: float  # real seconds a step takes (the simulated step time / compression)
    startup_s: float = 0.5  # real seconds from launch to the start line (process group, restore)
    payload_bytes: int = 64  # a checkpoint's one file

    def __post_init__(self) -> None:
        if not self.step_s > 0:
            raise ValueError(f"step_s must be > 0 real seconds, got {self.step_s!r}: pass a "
                             "larger --step-s or a smaller --compress")


# ---- the ground truth and the counters, shared by the host's threads -----------------------
class Record:
    """What the host saw, for benchmarks/scale.py: rank 0's step executions and launches
    (truth.jsonl) and its counters."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.lock = threading.Lock()
        self.pending: list[dict] = []
        self.heartbeats = 0
        self.activities = 0

    def add(self, rec: dict) -> None:
        with self.lock:
            self.pending.append(rec)

    def flush(self) -> None:
        with self.lock:
            recs, self.pending = self.pending, []
        if recs:
            with open(os.path.join(self.root, "truth.jsonl"), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in recs)


# ---- a node ------------------------------------------------------------------------------
@dataclass(eq=False)
class SimNode:
    """One simulated node: what activities/nodes.py keeps in globals for its one node."""

    info: NodeInfo
    fast_root: str
    slot: threading.Lock = field(default_factory=threading.Lock)
    busy: str = ""
    dead: threading.Event = field(default_factory=threading.Event)
    child: SimChild | None = None
    announcer: asyncio.Task | None = None


# ---- the gang's clock ----------------------------------------------------------------------
class GangClock:
    """One launch's members stepping together (a collective per step): node 0 advances it;
    a member that dies or stalls breaks it, and nobody steps again."""

    def __init__(self, nnodes: int) -> None:
        self.nnodes = nnodes
        self.cond = threading.Condition()
        self.members: dict[int, SimChild] = {}
        self.resumed: int | None = None
        self.begun = self.done = self.broken = False
        self.step, self.step_time = 0, 0.0

    def join(self, rank: int, child: SimChild) -> None:
        with self.cond:
            self.members[rank] = child
            self.cond.notify_all()

    def wait(self, until: Callable[[], bool], child: SimChild) -> bool:
        """Until `until()` or the child is killed / stalled; True when `until()` holds."""
        with self.cond:
            while not until():
                if child.killed.is_set():
                    return False
                self.cond.wait(0.2)
            return True

    def update(self, **changes: Any) -> None:
        with self.cond:
            for k, v in changes.items():
                setattr(self, k, v)
            self.cond.notify_all()

    def stop_reason(self) -> str:
        """A member's supervisor asked to stop (its stop file): every rank stops."""
        for child in list(self.members.values()):
            path = os.path.join(child.workdir, STOP_FILE)
            if os.path.exists(path):
                with contextlib.suppress(OSError), open(path) as f:
                    return f.read() or "stop requested"
        return ""


_GANGS: dict[str, GangClock] = {}
_GANGS_LOCK = threading.Lock()


def gang_clock(session: str, nnodes: int) -> GangClock:
    with _GANGS_LOCK:
        if session not in _GANGS:
            _GANGS[session] = GangClock(nnodes)
        return _GANGS[session]


# ---- the simulated trainer ---------------------------------------------------------------
def trainer_args(cmd: list[str]) -> dict[str, Any]:
    """The trainer.segment arguments and torchrun's node rank / ranks per node, from the
    supervisor's command line (activities/supervise.py trainer_command)."""
    at = cmd.index("trainer.segment")
    launch, args = cmd[:at], cmd[at + 1:]
    out: dict[str, Any] = {"node_rank": 0, "procs": 1, "restart": 0, "nnodes": 1,
                           "session": "", "checkpoint_every": 0}
    for flag in launch:
        if flag.startswith("--node-rank="):
            out["node_rank"] = int(flag.split("=", 1)[1])
        elif flag.startswith("--nproc_per_node="):
            out["procs"] = int(flag.split("=", 1)[1])
    i = 0
    while i < len(args):
        name = args[i].lstrip("-").replace("-", "_")
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[name] = args[i + 1]
            i += 2
        else:
            out[name] = True
            i += 1
    for k in ("to_step", "attempt", "restart", "nnodes", "checkpoint_every"):
        out[k] = int(out[k])
    return out


class SimChild:
    """A trainer launch as a thread, with the Popen surface ChildLoop uses (pid, poll)."""

    config: SimConfig
    record: Record

    def __init__(self, node: SimNode, cmd: list[str], workdir: str) -> None:
        self.node, self.workdir = node, workdir
        self.a = trainer_args(cmd)
        self.pid = next(_PIDS)
        self.returncode: int | None = None
        self.killed = threading.Event()
        self.hung = False
        with open(self.a["spec"]) as f:
            self.spec = RunSpec.from_dict(json.load(f))
        self.gang = gang_clock(self.a["session"] or f"solo-{self.pid}", self.a["nnodes"])
        self.progress_path = os.path.join(workdir, "progress.jsonl")
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"sim-{node.info.name}")

    # the Popen surface
    def poll(self) -> int | None:
        if self.node.dead.is_set():  # a lost node: its supervisor answers nobody again
            threading.Event().wait()
        return self.returncode

    def kill(self) -> None:
        self.killed.set()
        with self.gang.cond:
            self.gang.cond.notify_all()

    # faults
    def strike(self, kind: str) -> None:
        self.gang.update(broken=True)
        if kind == "rank_lost":
            self.returncode = -9  # a rank killed by SIGKILL
        elif kind == "hang":
            self.hung = True

    # the trainer
    def write(self, line: ProgressLine) -> None:
        if not self.hung:
            with open(self.progress_path, "a") as f:
                f.write(line.to_json() + "\n")

    def stalled(self) -> bool:
        return self.gang.broken or self.hung or self.returncode is not None

    def _run(self) -> None:
        try:
            if self.a["node_rank"] == 0:
                self._lead()
            else:
                self._follow()
        except Exception as exc:  # noqa: BLE001 - a bug of the simulation: a crash, logged
            log.exception("sim_trainer_failed", node=self.node.info.name, error=repr(exc))
            if self.returncode is None:
                self.returncode = 1

    def _start_line(self, resumed: int | None) -> None:
        self.write(StartLine(resumed_from=resumed, world_size=self.a["nnodes"] * self.a["procs"],
                             to_step=self.a["to_step"], attempt=self.a["attempt"],
                             restart=self.a["restart"], checkpoint_every=self.every,
                             restore_tier="durable" if resumed is not None else ""))

    @property
    def every(self) -> int:
        return self.a["checkpoint_every"] or self.spec.train.first_checkpoint_every

    def _follow(self) -> None:
        g = self.gang
        g.join(self.a["node_rank"], self)
        if not g.wait(lambda: g.begun, self):
            return
        self._start_line(g.resumed)
        seen = g.resumed or 0
        while True:
            if not g.wait(lambda at=seen: (g.step > at or g.done) and not self.stalled(), self):
                return
            for s in range(seen + 1, g.step + 1):
                self.write(StepLine(step=s, loss=2.0, lr=3e-4, step_time_s=g.step_time))
            seen = g.step
            if g.done:
                self.returncode = 0
                return

    def _lead(self) -> None:
        g, spec, a = self.gang, self.spec, self.a
        launched = time.time()
        g.join(0, self)
        if self.killed.wait(self.config.startup_s):
            return
        store = CheckpointStore(spec.storage.durable, spec.run_id)
        resumed = store.latest_committed(at_or_before=a["to_step"])
        g.update(resumed=resumed, begun=True)
        self._start_line(resumed)
        if not g.wait(lambda: len(g.members) >= g.nnodes, self):  # the rendezvous
            return
        t = Trainer(self, store, launched, resumed)
        t.span("startup", launched, time.time(), {"badput": "startup"})
        step, reason = resumed or 0, ""
        while step < a["to_step"]:
            reason = g.stop_reason()
            if reason:
                break
            began = time.monotonic()
            if self.killed.wait(self.config.step_s):
                return
            if self.stalled():  # a broken collective: nobody finishes this step
                g.wait(lambda: False, self)
                return
            step, took = step + 1, time.monotonic() - began
            g.update(step=step, step_time=took)
            t.stepped(step, took)
            if step % self.every == 0 or step == a["to_step"]:
                t.commit(step)
        if reason and t.window:  # a stop: at a checkpoint of the current step
            t.commit(step)
        t.finish(step, reason)
        g.update(done=True)
        self.returncode = 0


class Trainer:
    """Rank 0's outputs: steps, checkpoints, events, window spans, result.json."""

    def __init__(self, child: SimChild, store: CheckpointStore, launched: float,
                 resumed: int | None) -> None:
        self.c, self.store, self.resumed = child, store, resumed
        spec = child.spec
        self.events = EventLog(spec.storage.durable, spec.run_id, "trainer",
                               attempt=child.a["attempt"])
        self.exporter = DurableSpanExporter("trainer", run=(spec.storage.durable, spec.run_id))
        self.window: list[float] = []
        self.window_began = time.time()
        self.committed: tuple[int, str] | None = None
        self.stall_s, self.checkpoints, self.spans = 0.0, 0, 0
        self.launch = {"launch_ts": launched, "session": child.a["session"],
                       "attempt": child.a["attempt"]}
        child.record.add({"type": "launch", **self.launch, "resumed_from": resumed})

    def stepped(self, step: int, took: float) -> None:
        now = time.time()
        if not self.window:
            self.window_began = now - took
        self.window.append(took)
        self.c.write(StepLine(step=step, loss=2.0, lr=3e-4, step_time_s=took))
        self.c.record.add({"type": "step", "step": step, "time_s": took, "end": now,
                           **self.launch})

    def commit(self, step: int) -> None:
        """The real commit protocol with a tiny payload: files, then the manifest."""
        spec, began = self.c.spec, time.time()
        local = os.path.join(self.c.node.fast_root, spec.run_id, "sim-ckpt", f"{step:09d}")
        os.makedirs(local, exist_ok=True)
        # a name the manifest accepts (storage/manifest.py FILE_PATTERNS); never loaded
        with open(os.path.join(local, "train_state-rank0.pt"), "wb") as f:
            f.write(step.to_bytes(8, "little") * max(1, self.c.config.payload_bytes // 8))
        man = self.store.commit(step, local, tokens_seen=step, data_cursor=step,
                                config_hash=spec.spec_hash(), writer="scale-sim",
                                parent=self.committed[0] if self.committed else None)
        uri, ended = self.store.uri(step), time.time()
        self.committed = (step, uri)
        self.stall_s += ended - began
        self.checkpoints += 1
        self.events.emit("checkpoint_saved", step=step, tier="fast", pause_s=ended - began,
                         waited_s=0.0)
        self.events.emit("checkpoint_committed", step=step, uri=uri, bytes=man.total_bytes)
        self.c.write(CommitLine(step=step, uri=uri, bytes=man.total_bytes,
                                stall_s=ended - began, upload_lag_s=ended - began))
        if self.window:
            first = step - len(self.window) + 1
            self.span(f"steps {first}-{step}", self.window_began, began,
                      {"goodput": True, "first_step": first, "last_step": step, "step": step,
                       "step_times_s": list(self.window), "skipped_steps": []})
        self.span(f"checkpoint stage {step}", began, ended, {"badput": "checkpoint_stall"})
        self.window = []
        self.events.flush()

    def span(self, name: str, start: float, end: float, attributes: dict) -> None:
        """One span as trainer/tracing.py writes it, through the durable exporter's writer."""
        self.spans += 1
        # span ids are unique across the run (read_spans keeps one span per id)
        rec = {"trace_id": f"{self.c.pid:032x}", "span_id": uuid.uuid4().hex[:16],
               "parent_id": None, "name": name, "start_ns": int(start * 1e9),
               "end_ns": int(end * 1e9), "status": "ok", "status_message": "",
               "service": "mainspring-trainer", "pid": self.c.pid, "parent_hint": None,
               "attributes": {"rank": 0, **attributes}, "events": [], "links": []}
        spec = self.c.spec
        self.exporter._write(spec.storage.durable, spec.run_id, [rec])

    def finish(self, step: int, reason: str) -> None:
        step_s = self.c.config.step_s
        res = SegmentResult(
            final_step=step, last_committed_step=self.committed[0] if self.committed else None,
            last_committed_uri=self.committed[1] if self.committed else None, train_loss=2.0,
            tokens_seen=step, steps_run=step - (self.resumed or 0), resumed_from=self.resumed,
            outcome=SegmentOutcome(stopped="interrupted" if reason else ""),
            throughput={"step_time_s": step_s}, checkpoint_stall_s=self.stall_s,
            checkpoints=self.checkpoints)
        path = os.path.join(self.c.workdir, "result.json")
        with open(path + ".tmp", "w") as f:
            f.write(res.to_json())
        os.replace(path + ".tmp", path)

