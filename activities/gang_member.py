"""A multi-node segment's member (workflows/gang.py launches one per node): what a follower
(a node other than 0) returns, and the NodeFailed a failing member raises for the gang's
blame."""

from __future__ import annotations

import dataclasses

from activities.contracts import TrainSegmentInput, TrainSegmentResult
from activities.errors import with_fault
from activities.recovery import FaultRecorder
from common.errors import NodeFailed
from common.fault_kinds import lost_a_peer
from common.faults import Fault
from storage.checkpoints import CheckpointStore


def is_follower(inp: TrainSegmentInput) -> bool:
    """A gang's node other than 0: node 0's ranks write the segment's result and speak for
    the gang (its segment_started/finished events); the workflow reads node 0's result."""
    return inp.gang is not None and inp.gang.node_rank > 0


def follower_result(store: CheckpointStore, inp: TrainSegmentInput,
                    attempt: int) -> TrainSegmentResult:
    """What a follower returns: where the durable store stands."""
    last = store.latest_committed(at_or_before=inp.to_step)
    return TrainSegmentResult(final_step=last if last is not None else inp.from_step,
                              last_committed_step=last if last is not None else -1,
                              last_committed_uri=store.uri(last) if last is not None else "",
                              train_loss=None, resumed_from=None, attempt=attempt)


def node_failed(node: str, faults: FaultRecorder) -> NodeFailed:
    """This node's failure for the gang's blame (workflows/gang.py): a rank that lost its
    peer (a connection closed, a collective broken) without a signal of its own failed
    because another node did. The error carries the node's fault record (with the node
    and that blame) to the workflow."""
    f = faults.fault or Fault("crash")
    peer = lost_a_peer(f.kind, f.signal, " ".join([f.evidence, *f.log_tail]))
    fault = dataclasses.replace(f, node=node, peer=peer)
    return with_fault(NodeFailed(node, f.kind, f.evidence[:500], fault_event_id=f.event_id,
                                 fault_ts=f.fault_ts, detected_ts=f.detected_ts,
                                 last_step=f.last_step, fingerprint=f.fingerprint, peer=peer,
                                 transient=f.transient), fault)
