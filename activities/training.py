"""train_segment: a thin adapter that supervises a `trainer/` child process for one segment.

Heartbeat details carry only durable facts (DESIGN §3, activities/heartbeat.py): the last
committed checkpoint's URI and step, when the heartbeat was sent, and — once the attempt
has failed — its fault event's id. A retry's child resumes from the newest checkpoint at or
before the segment's end that verifies on either tier (the fast tier when the retry lands
on the same machine); faults and recoveries are recorded as activities/recovery.py says.
The launch and its restarts in place are activities/launch.py, a gang member's side
activities/gang_member.py. Each attempt is a span (`segment <lo>-<hi>`), the parent of its
trainer processes' spans (TRACEPARENT).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import structlog
from temporalio import activity
from temporalio.exceptions import CancelledError

from activities import drain, nodes
from activities.contracts import TRAIN_SEGMENT, TrainSegmentInput, TrainSegmentResult
from activities.errors import classified
from activities.gang_member import follower_result, is_follower, node_failed
from activities.hang import HangLimits
from activities.heartbeat import HEARTBEAT_EVERY_S, DurableCommit, Heartbeats
from activities.launch import Launch, retryable, segment_args
from activities.metrics import MeteredEventLog, MetricsForwarder
from activities.recovery import FaultRecorder, Recovery, execution_key, prior_repeat
from activities.tracing import activity_span
from common.errors import Preempted
from common.faults import Fault
from common.protocol import ProgressLine, SegmentResult
from common.threads import concurrently, in_context
from spec import RunSpec
from storage import fast_tier
from storage.checkpoints import CheckpointStore
from storage.events import EventLog
from storage.quarantine import write_quarantine
from trainer.extensions import clear_stale_build_locks

log = structlog.get_logger(__name__)


def segment_workdir(spec: RunSpec, from_step: int, to_step: int) -> str:
    return os.path.join(fast_tier.run_dir(spec.storage.fast, spec.run_id), "segments",
                        f"{from_step:09d}-{to_step:09d}")


@dataclass(frozen=True)
class Attempt:
    """One attempt of a segment: where it runs and what it records to."""

    spec: RunSpec
    inp: TrainSegmentInput
    number: int  # Temporal's attempt number
    workdir: str
    store: CheckpointStore
    events: EventLog
    tracker: DurableCommit
    faults: FaultRecorder


@activity.defn(name=TRAIN_SEGMENT)
@classified
def train_segment(inp: TrainSegmentInput) -> TrainSegmentResult:
    spec = nodes.on_this_node(RunSpec.from_dict(inp.spec))
    where = {"node": inp.gang.node, "node_rank": inp.gang.node_rank} if inp.gang else {}
    with nodes.occupying(f"{spec.run_id} {inp.from_step}-{inp.to_step}", activity.heartbeat), \
            activity_span(f"segment {inp.from_step}-{inp.to_step}", spec,
                          from_step=inp.from_step, to_step=inp.to_step, **where), \
            fast_tier.lease(spec.storage.fast, spec.run_id, spec.storage.durable):
        return _train_segment(spec, inp)


def _train_segment(spec: RunSpec, inp: TrainSegmentInput) -> TrainSegmentResult:
    attempt, execution = activity.info().attempt, execution_key()
    workdir = segment_workdir(spec, inp.from_step, inp.to_step)
    os.makedirs(workdir, exist_ok=True)
    # its faults and recoveries are also Prometheus series (activities/metrics.py)
    events = MeteredEventLog(spec.storage.durable, spec.run_id, "supervisor", attempt=attempt)
    recovery = Recovery(events, workdir, inp, attempt, execution, cache_dir=os.path.join(
        fast_tier.cache_dir(spec.storage.fast, spec.run_id), "events")) \
        if attempt > 1 or inp.after_fault else None
    if not is_follower(inp):  # a gang's node 0 speaks for it
        events.emit("segment_started", step=inp.from_step,
                    # the execution too: a segment scheduled again after a decision (an OOM)
                    # starts over at attempt 1
                    event_id=f"segment_started/{inp.from_step}-{inp.to_step}/{execution}/{attempt}",
                    from_step=inp.from_step, to_step=inp.to_step, attempt=attempt)
        # written beside the launch's preparation, not before it, so it costs a retry no
        # seconds; a failed write keeps the event for the attempt's next flush
        in_context(flush_kept, events, name="mainspring-segment-started")
    prior = prior_repeat(activity.info().heartbeat_details)
    tracker = DurableCommit(None, "", prior)
    faults = FaultRecorder(events, inp, attempt, execution, tracker.on_fault, prior,
                           on_restart=tracker.on_restart)
    a = Attempt(spec, inp, attempt, workdir, CheckpointStore(spec.storage.durable, spec.run_id),
                events, tracker, faults)
    from activities.server_watch import watching  # the Temporal server's outages
    try:
        with Heartbeats(tracker.details, every_s=HEARTBEAT_EVERY_S) as beats, \
                watching(spec, inp, attempt, execution, workdir, heartbeat=beats.tick):
            return _supervise_segment(a, recovery, beats.tick)
    except CancelledError:
        if inp.gang is not None and faults.fault:  # cancelled, but it had failed first (its
            raise node_failed(inp.gang.node, faults) from None  # peer died): say so
        raise
    except Exception as exc:  # an error of the activity's own, not already recorded
        faults.on_error(exc)
        # an OOM goes back to the workflow; the same failure too often stops the retrying
        decided = faults.decision(spec.run_id, spec.ops.repeat_failure_limit, inp.micro_split)
        if decided is not None:
            log.warning("segment_needs_decision", kind=decided.kind, error=str(decided)[:300])
            raise decided from None
        if inp.gang is not None and faults.fault and retryable(exc):
            raise node_failed(inp.gang.node, faults) from None  # the gang decides (gang.py)
        raise


def _supervise_segment(a: Attempt, recovery: Recovery | None,
                       beat: Callable[[], None]) -> TrainSegmentResult:
    spec, inp = a.spec, a.inp
    committed = a.store.list_committed()  # one listing for both
    checkpoint_bytes = prepare_fast_tier(spec, a.store, committed)
    latest = max((s for s in committed if s <= inp.to_step), default=None)
    a.tracker.step, a.tracker.uri = latest, a.store.uri(latest) if latest is not None else ""
    info = activity.info()  # the same bounds can be scheduled twice (a stop before step 1)
    metrics = MetricsForwarder(a.events, spec.ops.metrics_every,
                               segment=f"{inp.from_step}-{inp.to_step}", attempt=a.number,
                               execution=f"{info.workflow_run_id[:8]}.{info.activity_id}")

    def on_progress(line: ProgressLine) -> None:
        a.tracker.on_progress(line)
        metrics.on_progress(line)
        a.faults.on_progress(line)  # then the launch's recovery (activities/launch.py)
    clear_stale_build_locks(older_than_s=HangLimits.build_lock_s(spec.ops))  # a builder that died
    launch = Launch(spec, inp, a.workdir, segment_args(spec, inp, a.workdir, a.number, committed),
                    attempt=a.number, events=a.events, faults=a.faults, recovery=recovery,
                    checkpoint_bytes=checkpoint_bytes)
    result_file = os.path.join(a.workdir, "result.json")
    try:
        # A cancel (operator pause/rollback/abort) must not interrupt this thread: the
        # supervisor asks the trainer to stop at a checkpoint and waits for it.
        with activity.shield_thread_cancel_exception():
            launch.until_done(on_progress, beat)
    except CancelledError:
        if not os.path.exists(result_file):  # killed before it stopped: a plain cancel
            raise
        log.info("segment_stopped_on_cancel", workdir=a.workdir)  # report where it stopped
    if is_follower(inp):
        return follower_result(a.store, inp, a.number)  # node 0 reports
    with open(result_file) as f:
        res = SegmentResult.from_json(f.read())
    if drain.draining() and res.outcome.stopped == "interrupted":
        raise preempted(a.faults, res.last_committed_step)
    metrics.close()  # the tail window; flushed with segment_finished below
    if launch.recovery:  # an already-finished segment writes no start line, and no step
        launch.recovery.report(res.resumed_from)
    a.events.emit("segment_finished", step=res.final_step,
                  event_id=f"segment_finished/{inp.from_step}-{inp.to_step}",
                  from_step=inp.from_step, to_step=inp.to_step, attempt=a.number,
                  train_loss=res.train_loss, resumed_from=res.resumed_from)
    _, committed = concurrently(a.events.flush, a.store.list_committed)  # two round trips
    if res.outcome.rollbacks:  # a rollback may have found guilty documents
        update_quarantine(spec)
    return segment_result(res, a.number, committed, in_place_faults=a.faults.restart)


def update_quarantine(spec: RunSpec) -> None:
    """Rewrite the run's quarantine from its log (storage/quarantine.py). It is derived and
    written again at promotion, so a failure here costs the segment nothing: logged."""
    try:
        write_quarantine(spec.storage.durable, spec.run_id, cache_dir=os.path.join(
            fast_tier.cache_dir(spec.storage.fast, spec.run_id), "events"))
    except Exception as exc:  # noqa: BLE001 - logged; promote writes it again
        log.warning("quarantine_write_deferred", run_id=spec.run_id, error=repr(exc)[:300])


def prepare_fast_tier(spec: RunSpec, store: CheckpointStore, committed: list[int]) -> int:
    """Before a child writes checkpoints here: free what other runs left on this machine,
    then refuse at once (not retried) when the disk cannot hold what the segment keeps —
    the newest durable copy (of `committed`, the run's durable steps), the snapshots in
    flight and the one being written. Returns the newest durable checkpoint's size (0: none
    yet)."""
    fast_tier.collect_garbage(spec.storage.fast, keep_run=spec.run_id)
    newest = committed[-1] if committed else None
    if newest is None:
        return 0
    size = store.manifest(newest).total_bytes
    fast_tier.ensure_space(fast_tier.store_dir(spec.storage.fast, spec.run_id),
                           size * (spec.storage.max_in_flight + 2))
    return size


def flush_kept(events: EventLog) -> None:
    """Flush, or leave the events buffered for the next flush (storage/events.py)."""
    try:
        events.flush()
    except Exception as exc:
        log.warning("event_flush_deferred", error=repr(exc)[:300])


def preempted(faults: FaultRecorder, committed: int | None) -> Preempted:
    """The worker drains: the segment stopped at a committed step; its fault is recorded
    (the next attempt's `recovered` names it) and the retry goes to another worker now."""
    now = time.time()
    faults.on_failure(Fault("preempted", f"{drain.reason()}; committed step {committed}",
                            signal="SIGTERM", fault_ts=drain.since() or now,
                            detected_ts=drain.since() or now))
    return Preempted(committed, drain.reason())


def segment_result(res: SegmentResult, attempt: int, committed: list[int],
                   in_place_faults: int = 0) -> TrainSegmentResult:
    """The child's result.json as the workflow's contract; `committed` (the durable tier's
    steps after the segment) says how far back an operator rollback can still reach;
    `in_place_faults`: the failures this attempt answered by launching again in place.
    The checkpoint stall and step time are what train.checkpoint_every "auto" is chosen
    from (workflows/interval.py)."""
    out = res.outcome
    step_time = res.throughput.get("step_time_s")
    return TrainSegmentResult(final_step=res.final_step,
                              last_committed_step=res.last_committed_step,
                              last_committed_uri=res.last_committed_uri,
                              train_loss=res.train_loss, resumed_from=res.resumed_from,
                              attempt=attempt, rollbacks=out.rollbacks,
                              skipped_steps=out.skipped_steps, stopped=out.stopped,
                              evals=out.evals,
                              oldest_committed_step=committed[0] if committed else None,
                              faults=in_place_faults, checkpoint_stall_s=res.checkpoint_stall_s,
                              checkpoints=res.checkpoints,
                              step_time_s=float(step_time) if step_time else None,
                              suspects=out.suspects, grad_accum_asked=out.grad_accum_asked)
