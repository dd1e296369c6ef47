"""NodeRegistry: the trainer workers a multi-node segment can be gang-scheduled on, as
durable workflow state (one long-lived workflow per namespace, id `mainspring-nodes`).

Each trainer worker started with `--node` signals `announce` with its NodeInfo every few
seconds (ops/worker.py, signal-with-start: the first announcement starts the registry),
and `leave` when it stops.
An announcement is the node's liveness: the registry stamps it with its own clock, and a
node not heard from for NODE_TTL_S is not healthy (workflows/gang.py chooses among the
healthy). `nodes` (a query) is read by the `list_nodes` local activity of a TrainingRun
(activities/nodes.py), so the choice a run makes is in its history. The registry continues
as new every ANNOUNCEMENTS_PER_RUN signals with the nodes it knows, so its history stays
bounded however long the cluster lives. Deterministic; no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.contracts import ANNOUNCE, LEAVE, NODE_REGISTRY_TYPE, NodeInfo

ANNOUNCEMENTS_PER_RUN = 2000  # ~3 hours of 3 nodes announcing every 5 s
FORGET_AFTER_S = 24 * 3600.0  # a node silent this long leaves the registry
# as many as a spec may ask for (spec/train.py MAX_NODES): a flood of made-up names cannot
# grow the registry (or a run's list_nodes result in its history) past that
MAX_REGISTERED = 4096


def well_formed(n: NodeInfo) -> bool:
    """Pure: an announcement every reader can use (types and ranges)."""
    def whole(x: object, lo: int, hi: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi
    return (all(isinstance(v, str) for v in (n.name, n.queue, n.address, n.busy, n.worker))
            and bool(n.name) and bool(n.queue) and bool(n.address)
            and whole(n.rdzv_port, 1, 65535) and whole(n.procs, 1, 1 << 16)
            and whole(n.gpus, 0, 1 << 16))


@workflow.defn(name=NODE_REGISTRY_TYPE)
class NodeRegistry:
    @workflow.init
    def __init__(self, known: list[dict[str, Any]] | None = None) -> None:
        self._nodes: dict[str, NodeInfo] = {
            n["name"]: NodeInfo(**n) for n in (known or []) if isinstance(n, dict)}
        self._signals = 0

    @workflow.signal(name=ANNOUNCE)
    def announce(self, info: dict[str, Any]) -> None:
        """A node is alive (and what it offers). Malformed input is dropped, never fatal:
        the registry outlives every worker that talks to it."""
        self._signals += 1
        if not isinstance(info, dict):
            return
        try:
            node = NodeInfo(**{k: v for k, v in info.items()
                               if k in {f.name for f in dataclasses.fields(NodeInfo)}})
        except TypeError:
            node = None
        if node is None or not well_formed(node):
            workflow.logger.warning("announcement dropped: %r", info)
            return
        if node.name not in self._nodes and len(self._nodes) >= MAX_REGISTERED:
            workflow.logger.warning("registry full (%d nodes): %s dropped", MAX_REGISTERED,
                                    node.name)
            return
        self._nodes[node.name] = dataclasses.replace(node, seen=workflow.now().timestamp())

    @workflow.signal(name=LEAVE)
    def leave(self, name: str) -> None:
        """A node's worker stops (drained): it is no longer a candidate, at once."""
        self._signals += 1
        self._nodes.pop(str(name), None)

    @workflow.query
    def nodes(self) -> list[NodeInfo]:
        return sorted(self._nodes.values(), key=lambda n: n.name)

    @workflow.run
    async def run(self, known: list[dict[str, Any]] | None = None) -> None:
        await workflow.wait_condition(lambda: self._signals >= ANNOUNCEMENTS_PER_RUN
                                      or workflow.info().is_continue_as_new_suggested())
        now = workflow.now().timestamp()
        keep = [dataclasses.asdict(n) for n in self._nodes.values()
                if now - n.seen < FORGET_AFTER_S]
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(args=[keep])
