"""This trainer worker as a node of the cluster (`mainspring worker --node ...`), and the
orchestrator's `list_nodes` local activity (workflows/nodes.py, workflows/gang.py).

A node worker polls the shared trainer queue and its own (`contracts.node_queue`): both can
hand it work, and a node trains one thing at a time — `occupying` holds the node for an
activity (a second one waits, heartbeating) and the announcement says it is busy, so the
workflow choosing a gang passes it over. `--fast-root` moves the node's fast tier to its own
disk (local NVMe); the spec's storage.fast stays the default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import structlog
from temporalio import activity
from temporalio.client import WorkflowQueryFailedError
from temporalio.service import RPCError, RPCStatusCode

from activities.contracts import LIST_NODES, NODE_REGISTRY_ID, ListNodesResult, NodeInfo
from common.procs import NODE_ENV
from spec import RunSpec

log = structlog.get_logger(__name__)

_identity: NodeInfo | None = None
_fast_root = ""
_slot = threading.Lock()
_busy = ""


def configure(info: NodeInfo | None, fast_root: str = "") -> None:
    """This worker process's node (None: a worker of the shared queue only)."""
    global _identity, _fast_root
    _identity, _fast_root = info, fast_root
    if info is not None:  # its children know where they run (trainer/faults.py `node`)
        os.environ[NODE_ENV] = info.name


def identity() -> NodeInfo | None:
    return _identity


def announcement() -> NodeInfo | None:
    """What the worker announces now: its identity and what keeps it busy."""
    return dataclasses.replace(_identity, busy=_busy) if _identity else None


def default_address(toward: str = "") -> str:
    """The address other nodes most likely reach this host at: the one its name resolves
    to; where that is loopback (a hostname in /etc/hosts as 127.0.x.1, common on cloud
    images), the address this host sends from toward `toward` (the Temporal frontend,
    host:port, which every node reaches: a UDP connect picks the route and sends nothing);
    else 127.0.0.1, a one-machine cluster."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = "127.0.0.1"
    if not addr.startswith("127."):
        return addr
    host, _, port = toward.rpartition(":")
    if host and port.isdigit():
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host.strip("[]"), int(port)))
                addr = s.getsockname()[0]
        except OSError:  # no route, or a name that does not resolve: loopback it is
            addr = "127.0.0.1"
    if addr.startswith("127."):
        return "127.0.0.1"
    log.info("node_address_from_route", address=addr, toward=toward,
             why="the hostname resolves to loopback")
    return addr


def on_this_node(spec: RunSpec) -> RunSpec:
    """The spec as this node runs it: its fast tier under `--fast-root` when given."""
    if not _fast_root or spec.storage.fast == _fast_root:
        return spec
    return spec.replace(**{"storage.fast": _fast_root})


@contextlib.contextmanager
def occupying(what: str, heartbeat: Callable[[], None], poll_s: float = 2.0) -> Iterator[None]:
    """Hold this node for `what` (one training job per node, whichever queue it came from);
    wait, heartbeating, while another holds it. No-op on a worker that is not a node."""
    global _busy
    if _identity is None:
        yield
        return
    waited = time.monotonic()
    while not _slot.acquire(timeout=poll_s):
        heartbeat()
        log.info("node_busy_waiting", node=_identity.name, busy=_busy, wants=what,
                 waited_s=round(time.monotonic() - waited, 1))
    _busy = what
    try:
        yield
    finally:
        _busy = ""
        _slot.release()


@activity.defn(name=LIST_NODES)
async def list_nodes() -> ListNodesResult:
    """The registry's nodes and this clock (a local activity: the answer is in history)."""
    handle = activity.client().get_workflow_handle(NODE_REGISTRY_ID)
    try:
        nodes = await handle.query("nodes", result_type=list[NodeInfo])
    except RPCError as err:
        if err.status != RPCStatusCode.NOT_FOUND:
            raise
        nodes = []  # no node has announced itself yet
    except WorkflowQueryFailedError:
        nodes = []
    return ListNodesResult(nodes=nodes, now=time.time())


