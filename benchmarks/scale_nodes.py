"""Many simulated nodes in one process, for the scale harness (benchmarks/scale.py).

    python -m benchmarks.scale_nodes --address HOST:PORT --names n0000,n0001,... --root DIR
        --step-s 0.25 [--startup-s 0.5] [--polls 1]

Each node is what `mainspring worker --role trainer --node NAME` runs, less the process:
a temporalio Worker on the node's own queue (contracts.node_queue) with the real
train_segment activity, announcing itself to the node registry with ops/worker.py's own
`announce` loop. Everything of the activity is the product's — its heartbeats
(activities/heartbeat.py), the supervisor's loop, hang watch and exit classification
(activities/supervise.py ChildLoop, activities/child_exit.py), fault and recovery records
(activities/recovery.py, fault_ledger.py), the gang member's side (gang_member.py), the
server watch — but for the trainer child.

The seam is `activities.launch.run_child`, the one call where a launch turns into a
process: here it runs the real ChildLoop over a SimChild, a thread that speaks the trainer's
progress protocol (common/protocol.py: a start line, a step line per step, a commit line per
checkpoint, result.json at the end), honours the supervisor's stop file, commits
checkpoints through the real commit protocol (storage/checkpoints.py: tiny payloads, the
manifest last), writes the trainer's events (checkpoint_saved / checkpoint_committed) and
rank 0's `steps a-b` window spans (what ops/goodput.py reads). A gang's members step
together (one GangClock per launch session): a member that dies or stalls stalls the others,
as a broken collective does. A rank's startup (process group, restore) is `--startup-s`.

A node's identity lives in module globals of activities/nodes.py (one node per process in
the product); here they are replaced by a context variable set for each node's worker and
announcer tasks, which temporalio copies into the activity's thread.

Faults come through `<root>/control.jsonl` ({"node", "kind"} per line, from the harness):
`rank_lost` (the child exits by SIGKILL), `hang` (it stops progressing), `node_lost` (the
node stops answering: its heartbeats are dropped, its supervisor freezes, it stops
announcing). The host writes `<root>/stats.jsonl` (its CPU, RSS, threads, heartbeat calls,
activity starts, every 2 s) and `<root>/truth.jsonl` (rank 0's step executions and launches:
the ground truth).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import dataclasses
import itertools
import json
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import structlog
from temporalio import worker as tworker
from temporalio.exceptions import CancelledError

from activities import launch as launch_mod
from activities import nodes as nodes_mod
from activities.child_exit import classify_exit
from activities.contracts import NodeInfo, node_queue
from activities.supervise import ChildLoop, Supervision, _fresh_workdir
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


_NODE: contextvars.ContextVar[SimNode | None] = contextvars.ContextVar("sim_node", default=None)


def _identity() -> NodeInfo | None:
    node = _NODE.get()
    return node.info if node else None


def _announcement() -> NodeInfo | None:
    node = _NODE.get()
    return dataclasses.replace(node.info, busy=node.busy) if node else None


def _on_this_node(spec: RunSpec) -> RunSpec:
    node = _NODE.get()
    return spec.replace(**{"storage.fast": node.fast_root}) if node else spec


@contextlib.contextmanager
def _occupying(what: str, heartbeat: Callable[[], None], poll_s: float = 2.0) -> Iterator[None]:
    """activities/nodes.py occupying, per node."""
    node = _NODE.get()
    if node is None:
        yield
        return
    while not node.slot.acquire(timeout=poll_s):
        heartbeat()
    node.busy = what
    try:
        yield
    finally:
        node.busy = ""
        node.slot.release()


def install() -> None:
    """The seams: the node's identity per context, and the trainer launch simulated."""
    nodes_mod.identity, nodes_mod.announcement = _identity, _announcement
    nodes_mod.on_this_node, nodes_mod.occupying = _on_this_node, _occupying
    launch_mod.run_child = sim_run_child


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


def sim_run_child(cmd: list[str], workdir: str, env: dict[str, str], how: Supervision) -> None:
    """activities/supervise.py run_child with the process replaced by a SimChild: the same
    workdir preparation, ChildLoop and exit classification."""
    node = _NODE.get()
    if node is None:
        raise RuntimeError("sim_run_child outside a simulated node's context")
    log_path = _fresh_workdir(workdir)
    open(log_path, "a").close()
    proc = node.child = SimChild(node, cmd, workdir)
    proc.thread.start()
    loop = ChildLoop(how, workdir, log_path)
    try:
        rc = loop.until_exit(proc)
    finally:
        proc.kill()
    if loop.stop_at is not None and rc != 0:
        raise CancelledError(f"activity cancelled; trainer exited with {rc} while stopping")
    classify_exit(rc, workdir, log_path, how.on_failure, lost_rank=loop.lost_rank)


# ---- the worker side: counts, and a lost node's silence ------------------------------------
class NodeInterceptor(tworker.Interceptor):
    def __init__(self, node: SimNode, record: Record) -> None:
        self.node, self.record = node, record

    def intercept_activity(self, next: tworker.ActivityInboundInterceptor
                           ) -> tworker.ActivityInboundInterceptor:
        return _Inbound(next, self.node, self.record)


class _Inbound(tworker.ActivityInboundInterceptor):
    def __init__(self, next: tworker.ActivityInboundInterceptor, node: SimNode,
                 record: Record) -> None:
        super().__init__(next)
        self.node, self.record = node, record

    def init(self, outbound: tworker.ActivityOutboundInterceptor) -> None:
        super().init(_Outbound(outbound, self.node, self.record))

    async def execute_activity(self, input: tworker.ExecuteActivityInput) -> Any:
        self.record.activities += 1
        return await super().execute_activity(input)


class _Outbound(tworker.ActivityOutboundInterceptor):
    def __init__(self, next: tworker.ActivityOutboundInterceptor, node: SimNode,
                 record: Record) -> None:
        super().__init__(next)
        self.node, self.record = node, record

    def heartbeat(self, *details: Any) -> None:
        if self.node.dead.is_set():  # a lost node's heartbeats never reach the server
            return
        self.record.heartbeats += 1
        super().heartbeat(*details)


def node_worker(client, node: SimNode, record: Record, polls: int) -> tworker.Worker:
    """The node queue's worker as ops/worker.py build_workers makes a trainer node's (one
    slot, heartbeats sent at least every second), with `polls` pollers."""
    from activities.training import train_segment

    return tworker.Worker(
        client, task_queue=node.info.queue, activities=[train_segment],
        activity_executor=ThreadPoolExecutor(2, thread_name_prefix=node.info.name),
        max_concurrent_activities=1, max_concurrent_activity_task_polls=polls,
        max_heartbeat_throttle_interval=timedelta(seconds=1),
        graceful_shutdown_timeout=timedelta(seconds=5),
        interceptors=[NodeInterceptor(node, record)])


# ---- the host -----------------------------------------------------------------------------
def make_nodes(names: list[str], root: str, address: str) -> list[SimNode]:
    return [SimNode(info=NodeInfo(name=n, queue=node_queue(n), address="127.0.0.1",
                                  rdzv_port=29500, procs=1, worker=f"scale-sim-{os.getpid()}"),
                    fast_root=os.path.join(root, "nodes", n, "fast")) for n in names]


def stepping(node: SimNode) -> bool:
    """The node runs a launch that has stepped since it started, and is not failing."""
    c = node.child
    return (c is not None and c.returncode is None and not c.stalled() and not node.dead.is_set()
            and c.gang.begun and c.gang.step > (c.gang.resumed or 0))


def apply_strike(nodes: dict[str, SimNode], rec: dict, rng: random.Random) -> dict | None:
    """A strike from the control file on its node's running launch (rank_lost, hang) or on
    the node itself (node_lost); node "*": one of the nodes training now, at random. None:
    no such node trains now (the caller tries again)."""
    kind = rec.get("kind")
    if kind not in STRIKES:
        return {**rec, "applied": False, "why": f"unknown kind (one of {', '.join(STRIKES)})"}
    if rec.get("node", "*") == "*":
        busy = sorted(n for n, node in nodes.items() if stepping(node))
        if not busy:
            return None
        node = nodes[rng.choice(busy)]
    else:
        node = nodes.get(rec["node"])
        if node is None or not stepping(node):
            return None
    node.child.strike("hang" if kind == "node_lost" else kind)
    if kind == "node_lost":
        node.dead.set()
        if node.announcer is not None:  # it stops announcing: no leave, it is just gone
            node.announcer.cancel()
    return {**rec, "node": node.info.name, "applied": True, "applied_ts": time.time(),
            "segment": node.child.a["to_step"], "session": node.child.a["session"]}


async def watch(nodes: dict[str, SimNode], record: Record, root: str) -> None:
    """Strikes in (each waits until a node trains); stats and truth out every 2 s."""
    me = psutil.Process()
    control, offset, last_stats = os.path.join(root, "control.jsonl"), 0, 0.0
    pending: list[dict] = []
    rng = random.Random(0)
    while True:
        if os.path.exists(control):
            with open(control) as f:
                f.seek(offset)
                text = f.read()
            done, sep, _ = text.rpartition("\n")
            offset += len(done) + len(sep)
            pending += [json.loads(line) for line in done.split("\n") if line.strip()]
        for rec in list(pending):
            applied = apply_strike(nodes, rec, rng)
            if applied is not None:
                pending.remove(rec)
                record.add({"type": "strike", **applied})
                log.warning("strike_applied", **applied)
        if time.monotonic() - last_stats >= 2.0:
            last_stats = time.monotonic()
            cpu = me.cpu_times()
            with open(os.path.join(root, "stats.jsonl"), "a") as f:
                f.write(json.dumps({"ts": time.time(), "cpu_s": cpu.user + cpu.system,
                                    "rss": me.memory_info().rss, "threads": me.num_threads(),
                                    "heartbeats": record.heartbeats,
                                    "activities": record.activities,
                                    "dead": sum(n.dead.is_set() for n in nodes.values())}) + "\n")
            record.flush()
        await asyncio.sleep(0.1)


async def host(args: argparse.Namespace) -> None:
    from activities import server_watch
    from common import telemetry
    from ops.client import connect
    from ops.worker import announce

    install()
    # every span of a run in the run's store, as run_workers adds it (the activities' own)
    telemetry.add_exporter(DurableSpanExporter("worker-trainer"))
    SimChild.config = SimConfig(step_s=args.step_s, startup_s=args.startup_s)
    record = SimChild.record = Record(args.root)
    client = await connect(args.address)
    server_watch.configure(client.service_client.config)  # as run_workers does
    nodes = {n.info.name: n for n in make_nodes(args.names.split(","), args.root, args.address)}
    stop = asyncio.Event()
    tasks = []
    for node in nodes.values():
        ctx = contextvars.copy_context()
        ctx.run(_NODE.set, node)
        w = node_worker(client, node, record, args.polls)
        tasks.append(asyncio.create_task(w.run(), context=ctx))
        node.announcer = asyncio.create_task(announce(client, stop), context=ctx)
    log.info("sim_nodes_started", nodes=len(nodes), pid=os.getpid())
    with open(os.path.join(args.root, "ready"), "w") as f:
        f.write(str(os.getpid()))
    await watch(nodes, record, args.root)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True)
    p.add_argument("--names", required=True, help="the nodes' names, comma-separated")
    p.add_argument("--root", required=True, help="this host's directory")
    p.add_argument("--step-s", type=float, required=True, help="real seconds per step")
    p.add_argument("--startup-s", type=float, default=0.5)
    p.add_argument("--polls", type=int, default=1, help="activity pollers per node worker")
    args = p.parse_args(argv)
    from common import telemetry

    telemetry.configure_logging("warning")
    os.makedirs(args.root, exist_ok=True)
    try:
        asyncio.run(host(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
