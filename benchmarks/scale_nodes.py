"""Many simulated nodes in one process, for the scale harness (benchmarks/scale.py).

    python -m benchmarks.scale_nodes --address HOST:PORT --names n0000,n0001,... --root DIR
        --step-s 0.25 [--startup-s 0.5] [--polls 1] [--per-client 16]

Each node is what `mainspring worker --role trainer --node NAME` runs, less the process:
a temporalio Worker on the node's own queue (contracts.node_queue) with the real
train_segment activity, announcing itself to the node registry with ops/worker.py's own
`announce` loop. Everything of the activity is the product's — its heartbeats
(activities/heartbeat.py), the supervisor's loop, hang watch and exit classification
(activities/supervise.py ChildLoop, activities/child_exit.py), fault and recovery records
(activities/recovery.py, fault_ledger.py), the gang member's side (gang_member.py), the
server watch — but for the trainer child.

The seam is `activities.launch.run_child`, the one call where a launch turns into a
process: sim_run_child runs the same workdir preparation, the real ChildLoop and the real
exit classification over a SimChild (benchmarks/scale_sim.py), a thread that speaks the
trainer's progress protocol and commits checkpoints through the real commit protocol. A
thread, not a process: 1,024 nodes' children cannot each be a Python process on a small
machine, and a process's start-up is the trainer's cost, not the orchestrator's. Nothing in
product code knows about the simulation.

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
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
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
from benchmarks.scale_sim import STRIKES, Record, SimChild, SimConfig, SimNode
from spec import RunSpec
from storage.spans import DurableSpanExporter

log = structlog.get_logger(__name__)


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
    nodes = {n.info.name: n for n in make_nodes(args.names.split(","), args.root, args.address)}
    # A connection of its own for every `per_client` nodes: a node's long poll holds an
    # HTTP/2 stream for up to a minute, and the frontend serves ~100 streams a connection;
    # past that, polls and heartbeats queue behind each other (seen at 256 nodes on one
    # connection: schedule-to-start and heartbeat timeouts). A real node has its own.
    clients = [await connect(args.address)
               for _ in range(math.ceil(len(nodes) / args.per_client))]
    server_watch.configure(clients[0].service_client.config)  # as run_workers does
    stop = asyncio.Event()
    tasks = []
    for i, node in enumerate(nodes.values()):
        client = clients[i // args.per_client]
        ctx = contextvars.copy_context()
        ctx.run(_NODE.set, node)
        w = node_worker(client, node, record, args.polls)
        tasks.append(asyncio.create_task(w.run(), context=ctx))
        node.announcer = asyncio.create_task(announce(client, stop), context=ctx)
    log.info("sim_nodes_started", nodes=len(nodes), clients=len(clients), pid=os.getpid())
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
    p.add_argument("--per-client", type=int, default=16,
                   help="nodes sharing one client connection")
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
