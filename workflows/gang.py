"""Multi-node segments: choose the nodes, launch one train_segment per node, all or nothing
(docs/multinode.md). Workflow code: deterministic, no I/O; the pure choices first.

- **Choice.** The `list_nodes` local activity reads the node registry (workflows/nodes.py);
  a node is a candidate when it announced itself within NODE_TTL_S, runs enough ranks
  (procs >= train.procs_per_node), is idle (or busy with this run) and is not set aside.
  Nodes that failed the run before come last; node 0 (the rendezvous store, rank 0) is the
  first of the rest, by name.
- **Too few.** The run waits in `waiting_for_nodes` (status says why) and, once it has
  waited ops.node_wait_s, goes on with fewer nodes when train.min_nodes allows (a divisor
  of train.nodes: the same global batch). It never grows back within the run.
- **All or nothing.** One activity per node on that node's queue, none retried by Temporal
  (maximum_attempts 1): when any member fails, times out or is cancelled, the others are
  cancelled and awaited (a member whose peers are gone is killed, not left in a
  collective: activities/supervise.py Supervision.stop_quiet_s), and the workflow launches the whole
  segment again from the last durable commit, preferring the nodes that did not fail.
- **Blame.** Of the members that failed, the node at fault is the one whose worker was lost
  (a timeout), else one that failed on its own (not by losing a peer). It gets a failure
  in a row; at ops.node_failure_limit it is set aside (`node_set_aside`, with the
  evidence). A lost node's fault is recorded here (kind worker_lost: nobody else saw it);
  the next launch's node 0 records the `recovered` naming it (and the peers' faults).
- **Repeats.** The same failure (fingerprint) ops.repeat_failure_limit launches in a row
  holds the run in needs_attention, as on one node (workflows/adapt.py).
- **Suspects.** A segment that ended well may still name nodes whose ranks' copies of the
  weights disagreed with the others' (silent data corruption, trainer/replicas.py; the
  trainer rolled back and went on): each such node gets a failure in a row as above, so a
  node suspected again, or failing otherwise, is set aside and the next launch runs
  elsewhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    TimeoutError,
    is_cancelled_exception,
)

with workflow.unsafe.imports_passed_through():
    from activities.contracts import (
        LIST_NODES,
        NODE_TTL_S,
        GangMember,
        ListNodesResult,
        NodeInfo,
    )
    from common.errors import NEEDS_DECISION, NON_RETRYABLE
    from common.faults import WORKFLOW, Fault, Repeat, fault_event
    from spec import RunSpec
    from spec.train import TrainConfig
    from workflows.carry import RunCarry

WAIT_POLL_S = 5.0  # how often a run waiting for nodes reads the registry again
LOST, OWN, PEER = 3, 2, 1  # how surely a failed member is the one at fault

# One execution's history, kept under the 10,240 events and 10 MiB past which Temporal warns
# (it terminates a run at 51,200 / 50 MiB). A launch writes per member its scheduled,
# started and closing events, a cancel request when a peer failed, and at worst the three
# events of a workflow task its result woke; each scheduled event holds the member's input
# (the spec, most of it). Temporal suggests continuing as new from
# 4,096 events or 4 MiB, but that is read only between launches: a launch of 1,024 members
# after the suggestion's threshold could carry the history past the warning.
HISTORY_EVENTS_BUDGET, HISTORY_BYTES_BUDGET = 9_216, 9 * 2**20
EVENTS_PER_MEMBER = 8
MEMBER_OVERHEAD_BYTES = 1_024  # a member's events beside its input: ids, times, its result
FRESH_EVENTS = 64  # an execution this new launches whatever the launch costs


def launch_fits(events: int, size: int, members: int, input_bytes: int) -> bool:
    """Pure: whether one more launch of `members` members, each scheduled with an input of
    `input_bytes`, keeps an execution's history (now `events` events, `size` bytes) within
    the budget. A fresh execution always launches: continuing as new cannot make it
    smaller."""
    if events <= FRESH_EVENTS:
        return True
    return (events + members * EVENTS_PER_MEMBER <= HISTORY_EVENTS_BUDGET
            and size + members * (input_bytes + MEMBER_OVERHEAD_BYTES) <= HISTORY_BYTES_BUDGET)


# ---- pure: which nodes --------------------------------------------------------------------
def candidates(nodes: list[NodeInfo], now: float, s: RunSpec, set_aside: dict[str, str]
               ) -> list[NodeInfo]:
    """The nodes a segment of this run may use now."""
    return [n for n in nodes
            if now - n.seen <= NODE_TTL_S and n.procs >= s.train.procs_per_node
            and n.name not in set_aside
            and (not n.busy or n.busy.startswith(f"{s.run_id} "))]


def node_count(t: TrainConfig, available: int, used: int, waited_s: float | None,
               wait_s: float) -> int | None:
    """Nodes for the next segment: `used` (train.nodes, or fewer once elastic) when that
    many are available; after waiting `wait_s`, the largest allowed count that fits; None:
    wait."""
    if available >= used:
        return used
    if waited_s is not None and waited_s >= wait_s:
        fits = [n for n in t.node_counts() if n <= min(available, used)]
        return fits[0] if fits else None
    return None


def choose(nodes: list[NodeInfo], n: int, failed: dict[str, int]) -> list[NodeInfo]:
    """`n` of `nodes`: those with fewer failures in a row first, then by name."""
    return sorted(nodes, key=lambda x: (failed.get(x.name, 0), x.name))[:n]


def waiting_reason(s: RunSpec, used: int, avail: list[NodeInfo], known: list[NodeInfo],
                   set_aside: dict[str, str], now: float) -> str:
    """Pure: why the run waits, in numbers, and what would end it."""
    names = ", ".join(n.name for n in avail) or "none"
    small = sum(1 for n in known if n.procs < s.train.procs_per_node)
    stale = sum(1 for n in known if now - n.seen > NODE_TTL_S)
    busy = sum(1 for n in known if n.busy and not n.busy.startswith(f"{s.run_id} "))
    why = (f"{len(avail)} of {used} nodes available ({names}); {len(known)} registered: "
           f"{stale} silent, {busy} busy with other work, {small} with fewer than "
           f"{s.train.procs_per_node} procs, {len(set_aside)} set aside")
    fix = (f"start `mainspring worker --role trainer --node NAME --procs "
           f"{s.train.procs_per_node}` on {used - len(avail)} more node(s)")
    if s.train.fewest_nodes < used:
        fix += f", or wait {s.ops.node_wait_s:.0f}s: the run goes on with fewer"
    return f"{why}; {fix}"


@dataclass(frozen=True)
class MemberFailure:
    """What one failed member tells about its node: how surely it is at fault, and the
    fault record the member raised with (common/faults.py) or, lost, the one made here."""

    node: str
    how: int  # LOST, OWN or PEER
    fault: Fault


def member_failure(node: str, err: BaseException) -> MemberFailure:
    """Pure: a failed member's ActivityError as blame evidence."""
    cause = err.cause if isinstance(err, ActivityError) else err
    if isinstance(cause, TimeoutError):
        which = getattr(cause.type, "name", cause.type)
        return MemberFailure(node, LOST, Fault(
            "worker_lost", f"node {node}: its activity timed out ({which}): the worker "
                           f"stopped answering", node=node, detected_by=WORKFLOW))
    fault = Fault.from_error_details(
        cause.details if isinstance(cause, ApplicationError) else (),
        error_type=str(getattr(cause, "type", "") or ""), message=str(cause))
    return MemberFailure(node, PEER if fault.peer else OWN, dataclasses.replace(fault, node=node))


def at_fault(failures: list[MemberFailure]) -> list[MemberFailure]:
    """The failures that name the node(s) at fault: the surest kind of blame there is."""
    worst = max(f.how for f in failures)
    return [f for f in failures if f.how == worst]


@dataclass
class GangOutcome:
    """A launch's end: node 0's result, or the failures (and a decision's error)."""

    result: Any = None
    failures: list[MemberFailure] = field(default_factory=list)
    decision: ApplicationError | None = None  # an OOM / repeated failure: adapt.py decides
    fatal: BaseException | None = None  # a non-retryable error: the run fails with it


def gang_options(s: RunSpec) -> dict[str, Any]:
    """One try per member: the workflow retries the gang as a whole. A member whose node
    vanished after the choice never starts: schedule-to-start bounds that wait."""
    return {"schedule_to_close_timeout": timedelta(seconds=s.ops.segment_budget_s),
            "schedule_to_start_timeout": timedelta(seconds=s.ops.heartbeat_timeout_s + 30),
            "heartbeat_timeout": timedelta(seconds=s.ops.heartbeat_timeout_s),
            "retry_policy": RetryPolicy(maximum_attempts=1,
                                        non_retryable_error_types=list(NON_RETRYABLE))}


def members(nodes: list[NodeInfo], session: str) -> list[GangMember]:
    master = f"{nodes[0].address}:{nodes[0].rdzv_port}"
    return [GangMember(node=n.name, node_rank=i, nnodes=len(nodes), master=master,
                       session=session) for i, n in enumerate(nodes)]


# ---- in the workflow ------------------------------------------------------------------
async def list_nodes() -> ListNodesResult:
    return await workflow.execute_local_activity(
        LIST_NODES, result_type=ListNodesResult, start_to_close_timeout=timedelta(seconds=30),
        summary="list the node registry's nodes")


async def pick_nodes(s: RunSpec, c: RunCarry, *, stop: Callable[[], bool],
                     waiting: Callable[[str | None], Awaitable[None]]) -> list[NodeInfo] | None:
    """The nodes of the next launch; None when `stop()` turned true while waiting (an
    operator command, a full history). `waiting(reason)` announces a wait (None: over)."""
    used = c.gang.nodes_used or s.train.nodes
    since = c.gang.waiting.get("since") if c.gang.waiting else None
    announced = False
    while True:
        listed = await list_nodes()
        avail = candidates(listed.nodes, listed.now, s, c.gang.set_aside)
        waited = None if since is None else workflow.now().timestamp() - since
        n = node_count(s.train, len(avail), used, waited, s.ops.node_wait_s)
        if n is not None:
            if c.gang.waiting:
                await waiting(None)
            return choose(avail, n, c.gang.node_failures)
        if since is None:
            since = workflow.now().timestamp()
        if not announced:  # once per call: also after a hold that interrupted the wait
            announced = True
            c.gang.waiting = {"since": since, "reason": waiting_reason(
                s, used, avail, listed.nodes, c.gang.set_aside, listed.now)}
            await waiting(c.gang.waiting["reason"])
        try:
            await workflow.wait_condition(stop, timeout=timedelta(seconds=WAIT_POLL_S))
        except asyncio.TimeoutError:
            continue
        return None


async def run_gang(handles: list[Any], names: list[str],
                   interrupted: Callable[[], bool]) -> GangOutcome:
    """Wait for every member; when one fails (or `interrupted()`: an operator command),
    cancel the rest and wait for them to stop."""
    def failed() -> bool:
        return any(h.done() and not h.cancelled() and h.exception() is not None for h in handles)

    await workflow.wait_condition(lambda: all(h.done() for h in handles) or failed()
                                  or interrupted())
    for h in handles:
        if not h.done():
            h.cancel()
    ends = await asyncio.gather(*handles, return_exceptions=True)
    out = GangOutcome()
    for i, end in enumerate(ends):
        if not isinstance(end, BaseException):
            if i == 0:
                out.result = end
            continue
        if is_cancelled_exception(end):
            continue
        cause = end.cause if isinstance(end, ActivityError) else None
        if isinstance(cause, ApplicationError) and cause.type in NEEDS_DECISION:
            out.decision = out.decision or cause
        elif isinstance(cause, ApplicationError) and cause.non_retryable:
            out.fatal = out.fatal or end
        out.failures.append(member_failure(names[i], end))
    return out


@dataclass
class Blame:
    """What a failed launch changes: the events to record, the fault the next launch's
    recovery answers, and a hold (needs_attention) when the same failure keeps coming."""

    events: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    after_fault: Fault | None = None
    hold: str = ""
    hold_payload: dict[str, Any] = field(default_factory=dict)


def suspected(c: RunCarry, s: RunSpec, suspects: list[dict[str, Any]], nodes: list[str], *,
              lo: int, hi: int, launch: int) -> list[tuple[str, str, dict[str, Any]]]:
    """Pure but for the carry it updates, after a launch that ended well: the failures in a
    row end for every node but those its trainer suspected of silent data corruption
    (`suspects`: {"step", "ranks", "node_ranks"}; `nodes`: the launch's members by node
    rank), which get one more each; at ops.node_failure_limit one is set aside. The events
    to record."""
    named = [nodes[r] for sus in suspects for r in sus.get("node_ranks") or ()
             if 0 <= r < len(nodes)]
    c.gang.node_failures = {n: k for n, k in c.gang.node_failures.items() if n in named}
    events: list[tuple[str, str, dict[str, Any]]] = []
    for sus in suspects:
        for rank in sus.get("node_ranks") or ():
            if not 0 <= rank < len(nodes):
                continue
            node = nodes[rank]
            c.gang.node_failures[node] = c.gang.node_failures.get(node, 0) + 1
            evidence = (f"ranks {sus.get('ranks')} on node {node}: their copy of the weights "
                        f"disagreed with the other ranks' at step {sus.get('step')} "
                        f"(suspected silent data corruption)")
            if (c.gang.node_failures[node] >= s.ops.node_failure_limit
                    and node not in c.gang.set_aside):
                c.gang.set_aside[node] = evidence[:300]
                events.append(("node_set_aside", f"node_set_aside/{node}/{launch}", {
                    "node": node, "failures": c.gang.node_failures[node], "kind": "numerics",
                    "evidence": evidence[:500], "segment": f"{lo}-{hi}",
                    "fix": f"test node {node}'s accelerators (a burn-in, the vendor's field "
                           "diagnostics); restart its worker under a new --node name once "
                           "they pass"}))
    return events


def lost_fault(f: Fault, s: RunSpec, *, lo: int, hi: int, launch: int, now: float) -> Fault:
    """Pure: a lost member's fault, as the workflow records it (nobody else saw it): it
    struck a heartbeat timeout before `now`."""
    return dataclasses.replace(
        f, event_id=f"fault/{lo}-{hi}/gang{launch}/{f.node}", segment=f"{lo}-{hi}",
        fault_ts=now - s.ops.heartbeat_timeout_s, detected_ts=now, facts={"launch": launch})


def blame(c: RunCarry, s: RunSpec, failures: list[MemberFailure], *, lo: int, hi: int,
          launch: int, now: float) -> Blame:
    """Pure but for the carry it updates: the node(s) at fault get a failure in a row (set
    aside at ops.node_failure_limit); a lost node's fault is recorded; the same failure
    ops.repeat_failure_limit launches in a row asks for a human."""
    out = Blame()
    faults: list[tuple[int, Fault]] = []
    for f in failures:
        fault = f.fault
        if f.how == LOST:  # nobody else saw it: its worker is gone
            fault = lost_fault(fault, s, lo=lo, hi=hi, launch=launch, now=now)
            out.events.append(fault_event(fault))
        if fault.event_id:
            faults.append((f.how, fault))
    culprits = at_fault(failures)
    for f in culprits:
        fault = f.fault
        if fault.kind == "preempted":  # a drain: the node is leaving, not failing
            continue
        c.gang.node_failures[f.node] = c.gang.node_failures.get(f.node, 0) + 1
        if (c.gang.node_failures[f.node] >= s.ops.node_failure_limit
                and f.node not in c.gang.set_aside):
            c.gang.set_aside[f.node] = fault.evidence[:300]
            out.events.append(("node_set_aside", f"node_set_aside/{f.node}/{launch}", {
                "node": f.node, "failures": c.gang.node_failures[f.node], "kind": fault.kind,
                "evidence": fault.evidence[:500], "segment": f"{lo}-{hi}",
                "fix": f"look at node {f.node} (its worker's log, dmesg, the fault events); "
                       "restart its worker under a new --node name once it is healthy"}))
    if faults:
        primary = max(faults, key=lambda x: x[0])
        out.after_fault = primary[1].answering(
            *(x[1].event_id for x in faults if x is not primary))
    own = next((f.fault for f in culprits if f.fault.fingerprint and not f.fault.transient),
               None)
    if own is None:
        return out
    prior = Repeat.from_json(c.gang.repeat)
    repeats = prior.repeats + 1 if prior.fingerprint == own.fingerprint else 1
    c.gang.repeat = Repeat(own.fingerprint, repeats).to_json()
    if repeats >= s.ops.repeat_failure_limit:
        out.hold = (f"the same failure {repeats} times in a row on node {own.node} "
                    f"({own.fingerprint}): {own.evidence[:300]}")
        out.hold_payload = {"failure": "RepeatedFailure", "fingerprint": own.fingerprint,
                            "repeats": repeats, "node": own.node, "evidence": own.evidence[:500],
                            "fix": f"fix the cause the fault events show, then "
                                   f"`mainspring run resume {s.run_id}`"}
    return out
