"""Worker processes by role. The orchestrator (workflow) worker never imports torch:
trainer activities only supervise child processes (DESIGN §5)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import structlog
from temporalio import activity
from temporalio.worker import Worker

from activities import drain, nodes, server_watch, standby
from activities.contracts import (
    ANNOUNCE,
    DATA_QUEUE,
    LEAVE,
    NODE_REGISTRY_ID,
    NODE_REGISTRY_TYPE,
    ORCHESTRATOR_QUEUE,
    SPEC_ROOT,
    TRAINER_QUEUE,
    NodeInfo,
)
from activities.supervise import child_env
from common import telemetry
from common.metrics import serve_metrics, serve_temporal_metrics
from common.procs import SLOTS_ENV
from ops.client import connect
from storage.spans import DurableSpanExporter

log = structlog.get_logger(__name__)

ROLES = ("orchestrator", "data", "trainer", "all")
ANNOUNCE_EVERY_S = 5.0  # a node's liveness (contracts.NODE_TTL_S: three missed ones)
SPEC_ROOT_ENV = "MAINSPRING_SPEC_ROOT"
# where this orchestrator anchors a spec's relative paths (spec/paths.py): --spec-root, else
# $MAINSPRING_SPEC_ROOT, else the directory the worker was started in (run_workers)
_spec_root = os.getcwd()


def configure_spec_root(root: str = "") -> str:
    """Set (and return) the orchestrator's root for relative spec paths, made absolute."""
    global _spec_root
    _spec_root = os.path.abspath(root or os.environ.get(SPEC_ROOT_ENV) or os.getcwd())
    return _spec_root


@activity.defn(name=SPEC_ROOT)
def spec_root_activity() -> str:
    """The local activity a TrainingRun asks once, when its spec has a relative path: the
    answer is in the run's history, so every worker and child uses the same place."""
    return _spec_root


def build_workers(client, roles: set[str], trainer_slots: int = 1,
                  drain_timeout_s: float = 300.0, node: NodeInfo | None = None) -> list[Worker]:
    """The role's workers; a trainer that is a node (`--node`) polls its own queue too."""
    from activities.data import prepare_data, promote
    from activities.evaluate import evaluate
    from activities.events import pin_rollback, record_event
    from activities.prune import prune_trial
    from activities.runs import claim_run
    from activities.scrub import scrub_checkpoints
    from activities.suggest import suggest_trials
    from activities.training import train_segment
    from workflows.nodes import NodeRegistry
    from workflows.sweep import Sweep
    from workflows.training_run import TrainingRun

    workers = []
    if roles & {"orchestrator", "all"}:
        workers.append(Worker(client, task_queue=ORCHESTRATOR_QUEUE,
                              workflows=[TrainingRun, Sweep, NodeRegistry],
                              activities=[record_event, suggest_trials, prune_trial, claim_run,
                                          pin_rollback, nodes.list_nodes, spec_root_activity],
                              activity_executor=ThreadPoolExecutor(4)))
    if roles & {"data", "all"}:
        # a slot more than data prep and promotion need: a run's scrub (beside its
        # segments, throttled, often minutes long) never makes another run's data prep wait
        workers.append(Worker(client, task_queue=DATA_QUEUE,
                              activities=[prepare_data, promote, scrub_checkpoints],
                              activity_executor=ThreadPoolExecutor(3), max_concurrent_activities=3))
    if roles & {"trainer", "all"}:
        # One training job per trainer worker: the child uses every core (GPU) it is given.
        for queue in [TRAINER_QUEUE, *([node.queue] if node else [])]:
            workers.append(Worker(client, task_queue=queue, activities=[train_segment, evaluate],
                                  activity_executor=ThreadPoolExecutor(trainer_slots + 1),
                                  max_concurrent_activities=trainer_slots,
                                  # a heartbeat sent at least every second (the segment's
                                  # heartbeat thread beats that often): a heartbeat timeout
                                  # of 5 s keeps 4 s of slack, and a server outage shorter
                                  # than the timeout is survived (activities/server_watch.py)
                                  max_heartbeat_throttle_interval=timedelta(seconds=1),
                                  # a drain: running segments stop at a commit and fail over
                                  graceful_shutdown_timeout=timedelta(seconds=drain_timeout_s)))
    return workers


async def announce(client, stop: asyncio.Event) -> None:
    """Tell the node registry this node is alive, every ANNOUNCE_EVERY_S, until `stop`
    (signal-with-start: the first node's announcement starts the registry). A failed
    announcement is logged and tried again: the server may be restarting."""
    while not stop.is_set():
        info = nodes.announcement()
        if info is None:
            return
        try:
            await client.start_workflow(
                NODE_REGISTRY_TYPE, args=[None], id=NODE_REGISTRY_ID, task_queue=ORCHESTRATOR_QUEUE,
                start_signal=ANNOUNCE, start_signal_args=[dataclasses.asdict(info)])
        except Exception as exc:  # noqa: BLE001 - liveness is best effort, retried
            log.warning("node_announce_failed", node=info.name, error=str(exc)[:200])
        try:
            await asyncio.wait_for(stop.wait(), ANNOUNCE_EVERY_S)
        except asyncio.TimeoutError:
            pass
    me = nodes.identity()
    try:  # stopping: no new gang may choose this node
        await client.get_workflow_handle(NODE_REGISTRY_ID).signal(LEAVE, me.name)
    except Exception as exc:  # noqa: BLE001 - its announcements stop anyway (NODE_TTL_S)
        log.warning("node_leave_failed", node=me.name, error=str(exc)[:200])


async def run_workers(roles: set[str], address: str = "", namespace: str = "",
                      trainer_slots: int = 1, metrics_port: int = 0,
                      temporal_metrics_port: int = 0, drain_timeout_s: float = 300.0,
                      node: NodeInfo | None = None, fast_root: str = "",
                      standby_launcher: bool = True, spec_root: str = "") -> None:
    """Run the role's workers until SIGTERM or SIGINT. Then the worker drains
    (activities/drain.py): it stops polling, each running segment commits at its current
    step and fails over with a retryable Preempted at once, and the worker exits when they
    have (at most `drain_timeout_s`, then they are cancelled). `spec_root`: where an
    orchestrator anchors relative spec paths (configure_spec_root)."""
    configure_spec_root(spec_root)
    # Both before connecting: the Temporal SDK's metrics live in the Runtime the client uses.
    serve_metrics(metrics_port, f"worker-{'-'.join(sorted(roles))}")
    serve_temporal_metrics(temporal_metrics_port)
    # every span of a run, in the run's store (its activities bind their traces to it)
    telemetry.add_exporter(DurableSpanExporter(f"worker-{'-'.join(sorted(roles))}"))
    client = await connect(address, namespace)
    server_watch.configure(client.service_client.config)  # its segments probe this server
    nodes.configure(node, fast_root)
    workers = build_workers(client, roles, trainer_slots, drain_timeout_s, node)
    if roles & {"trainer", "all"}:  # its children share the cores among its slots
        os.environ[SLOTS_ENV] = str(trainer_slots)
    if standby_launcher and roles & {"trainer", "all"}:
        standby.warm(child_env)  # a trainer launcher ready before a segment comes
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("workers_started", roles=sorted(roles), address=address, spec_root=_spec_root)
    tasks = [asyncio.create_task(w.run()) for w in workers]
    if node is not None:  # a drained node stops announcing: no new gang chooses it
        tasks.append(asyncio.create_task(announce(client, stop)))
    await stop.wait()
    drain.begin()
    log.info("workers_stopping", draining=drain.reason())
    await asyncio.gather(*(w.shutdown() for w in workers))
    await asyncio.gather(*tasks, return_exceptions=True)
