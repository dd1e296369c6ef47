"""train_segment and evaluate: thin adapters that supervise `trainer/` child processes.

Heartbeat details carry only durable facts (DESIGN §3): the last committed checkpoint's
URI and step, when the heartbeat was sent, and — once the attempt has failed — its fault
event's id. A retry's child resumes from the newest checkpoint at or before the segment's
end that verifies on either tier (the fast tier when the retry lands on the same machine);
faults and recoveries are recorded as activities/recovery.py says. Each attempt is a span
(`segment <lo>-<hi>`), the parent of its trainer processes' spans (TRACEPARENT).
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections import deque
from typing import Callable

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError, CancelledError

from activities import drain, nodes
from activities.contracts import (
    EVALUATE,
    TRAIN_SEGMENT,
    EvalPoint,
    EvaluateInput,
    EvaluateResult,
    TrainSegmentInput,
    TrainSegmentResult,
)
from activities.errors import classified
from activities.hang import STEP_WINDOW, HangLimits
from activities.metrics import MeteredEventLog, MetricsForwarder
from activities.recovery import FaultRecorder, Recovery, execution_key, prior_repeat
from activities.supervise import (
    ChildFailure,
    child_env,
    supervise,
    trainer_command,
    trainer_launch,
)
from activities.tracing import activity_span
from common.errors import HardwareFault, MainspringError, NodeFailed, Preempted
from common.fault_kinds import TRANSIENT_KINDS, lost_a_peer
from common.procs import WORKER_PID_ENV
from common.protocol import CommitLine, ProgressLine, SegmentResult
from common.telemetry import child_trace_env
from common.threads import concurrently, in_context
from spec import RunSpec
from storage import fast_tier
from storage.checkpoints import CheckpointStore
from storage.events import EventLog
from trainer.extensions import clear_stale_build_locks

log = structlog.get_logger(__name__)

GANG_STOP_QUIET_S = 5.0  # a stopping gang member with no step since the stop request
HEARTBEAT_EVERY_S = 1.0  # the heartbeat thread's beat (the worker sends at most one a
# second, ops/worker.py: a 5 s heartbeat timeout keeps 4 s of slack)


def segment_workdir(spec: RunSpec, from_step: int, to_step: int) -> str:
    return os.path.join(fast_tier.run_dir(spec.storage.fast, spec.run_id), "segments",
                        f"{from_step:09d}-{to_step:09d}")


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


class DurableCommit:
    """The last committed checkpoint, as the child reports it: the heartbeat's content (and
    when it was sent, so a retry can tell when this attempt was last alive)."""

    def __init__(self, step: int | None, uri: str, repeat: dict | None = None) -> None:
        self.step, self.uri = step, uri
        self.fault: dict | None = None  # this attempt's fault, once recorded (recovery.py)
        self.repeat = repeat or {}  # the run of identical failures so far (recovery.py)

    def details(self) -> dict:
        beat = {"step": self.step, "uri": self.uri, "ts": round(time.time(), 3)}
        if self.repeat:
            beat["repeat"] = self.repeat
        return {**beat, "fault": self.fault} if self.fault else beat

    def on_progress(self, line: ProgressLine) -> None:
        if isinstance(line, CommitLine):
            self.step, self.uri = line.step, line.uri
            activity.heartbeat(self.details())


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
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    # its faults and recoveries are also Prometheus series (activities/metrics.py)
    events = MeteredEventLog(spec.storage.durable, spec.run_id, "supervisor", attempt=attempt)
    recovery = Recovery(events, workdir, inp, attempt, execution, cache_dir=os.path.join(
        fast_tier.cache_dir(spec.storage.fast, spec.run_id), "events")) \
        if attempt > 1 or inp.after_fault else None
    lead = inp.gang is None or inp.gang.node_rank == 0  # a gang's node 0 speaks for it
    if lead:
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

    def beat_fault(details: dict) -> None:
        tracker.fault, tracker.repeat = details["fault"], details["repeat"]
        activity.heartbeat(tracker.details())
    faults = FaultRecorder(events, inp, attempt, execution, beat_fault, prior)
    from activities.server_watch import watching  # the Temporal server's outages
    try:
        with Heartbeats(tracker.details, every_s=HEARTBEAT_EVERY_S) as beats, \
                watching(spec, inp, attempt, execution, workdir, heartbeat=beats.tick):
            return _supervise_segment(spec, inp, workdir, store, events, tracker, faults,
                                      recovery, beats.tick)
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


def retryable(exc: BaseException) -> bool:
    if isinstance(exc, ApplicationError):
        return not exc.non_retryable
    return not isinstance(exc, MainspringError) or exc.retryable


def node_failed(node: str, faults: FaultRecorder) -> NodeFailed:
    """This node's failure for the gang's blame (workflows/gang.py): a rank that lost its
    peer (a connection closed, a collective broken) without a signal of its own failed
    because another node did."""
    f = faults.fault
    peer = lost_a_peer(f["kind"], f.get("signal"),
                       " ".join([str(f.get("evidence", "")), *f.get("log_tail", [])]))
    return NodeFailed(node, f["kind"], str(f.get("evidence", ""))[:500],
                      fault_event_id=faults.event_id, fault_ts=f.get("fault_ts"),
                      detected_ts=f.get("detected_ts"), last_step=faults.last_step,
                      fingerprint=str(f.get("fingerprint", "")), peer=peer,
                      transient=f["kind"] in TRANSIENT_KINDS)


def _supervise_segment(spec: RunSpec, inp: TrainSegmentInput, workdir: str,
                       store: CheckpointStore, events: EventLog, tracker: DurableCommit,
                       faults: FaultRecorder, recovery: Recovery | None,
                       beat: Callable[[], None]) -> TrainSegmentResult:
    attempt = activity.info().attempt
    committed = store.list_committed()  # one listing for both
    checkpoint_bytes = prepare_fast_tier(spec, store, committed)
    latest = max((s for s in committed if s <= inp.to_step), default=None)
    tracker.step, tracker.uri = latest, store.uri(latest) if latest is not None else ""
    info = activity.info()  # the same bounds can be scheduled twice (a stop before step 1)
    metrics = MetricsForwarder(events, spec.ops.metrics_every,
                               segment=f"{inp.from_step}-{inp.to_step}", attempt=attempt,
                               execution=f"{info.workflow_run_id[:8]}.{info.activity_id}")

    def on_progress(line: ProgressLine) -> None:
        tracker.on_progress(line)
        metrics.on_progress(line)
        faults.on_progress(line)
        if recovery:  # the attempt's, or the last restart in place's
            recovery.on_progress(line)
    clear_stale_build_locks(older_than_s=HangLimits.build_lock_s(spec.ops))  # a builder that died
    spec_file = os.path.join(workdir, "spec.json")
    with open(spec_file, "w") as f:
        json.dump(inp.spec, f)
    windows_file = os.path.join(workdir, "lr_windows.json")  # not argv: too long for exec (E2BIG)
    with open(windows_file, "w") as f:
        json.dump(inp.lr_windows, f)
    args = ["--spec", spec_file, "--dataset", inp.dataset_uri, "--to-step", str(inp.to_step),
            "--workdir", workdir, "--attempt", str(attempt),
            "--fast-dir", fast_tier.store_dir(spec.storage.fast, spec.run_id),
            "--cache-dir", fast_tier.cache_dir(spec.storage.fast, spec.run_id),
            "--lr-windows-file", windows_file, "--max-rollbacks", str(inp.max_rollbacks),
            "--micro-split", str(inp.micro_split),
            "--checkpoint-every", str(inp.checkpoint_every)]
    if inp.gang:
        args += ["--nnodes", str(inp.gang.nnodes), "--session", inp.gang.session]
    if inp.rollback:
        args += ["--rollback", inp.rollback.to_json()]
    if inp.to_step not in committed:  # the trainer need not list again to know
        args += ["--unfinished"]
    result_file = os.path.join(workdir, "result.json")
    launch = Launch(spec, inp, workdir, args, faults, checkpoint_bytes)
    try:
        # A cancel (operator pause/rollback/abort) must not interrupt this thread: the
        # supervisor asks the trainer to stop at a checkpoint and waits for it.
        with activity.shield_thread_cancel_exception():
            while True:
                try:
                    launch.run(on_progress, beat)
                    break
                except (HardwareFault, ApplicationError) as exc:
                    if not launch.again_in_place(exc):
                        raise
                    recovery = Recovery(events, workdir, inp, attempt, execution_key(),
                                        in_place=faults, unanswered=recovery)
                    faults.restarted()
                    log.warning("segment_restarting_in_place", restart=faults.restart,
                                error=str(exc)[:300])
    except CancelledError:
        if not os.path.exists(result_file):  # killed before it stopped: a plain cancel
            raise
        log.info("segment_stopped_on_cancel", workdir=workdir)  # report where it stopped
    if inp.gang and inp.gang.node_rank > 0:
        return follower_result(store, inp, attempt)  # a gang's other node: node 0 reports
    with open(result_file) as f:
        res = SegmentResult.from_json(f.read())
    if drain.draining() and res.outcome.stopped == "interrupted":
        raise preempted(faults, res.last_committed_step)
    metrics.close()  # the tail window; flushed with segment_finished below
    if recovery:  # an already-finished segment writes no start line, and no step
        recovery.report(res.resumed_from)
    events.emit("segment_finished", step=res.final_step,
                event_id=f"segment_finished/{inp.from_step}-{inp.to_step}",
                from_step=inp.from_step, to_step=inp.to_step, attempt=attempt,
                train_loss=res.train_loss, resumed_from=res.resumed_from)
    _, committed = concurrently(events.flush, store.list_committed)  # two round trips at once
    return segment_result(res, attempt, committed, in_place_faults=faults.restart)


def flush_kept(events: EventLog) -> None:
    """Flush, or leave the events buffered for the next flush (storage/events.py)."""
    try:
        events.flush()
    except Exception as exc:
        log.warning("event_flush_deferred", error=repr(exc)[:300])


# Failures a restart in place answers: the worker is alive and saw the rank fail; the
# node's device and storage are not suspected (an ECC or CUDA error, an OOM, storage away
# go through a Temporal retry or a decision). At most IN_PLACE_RESTARTS per attempt, then
# the retry (maybe elsewhere); the same failure repeated stops at the repeat budget first.
IN_PLACE_KINDS = frozenset({"rank_lost", "crash", "hang", "nccl"})
IN_PLACE_RESTARTS = 3
POLL_S = 0.25  # the supervisor's loop: how soon a child's end or a lost rank is seen


class Launch:
    """The attempt's trainer child: launched (from this worker's warm standby when it has
    one, activities/standby.py), and launched again in place after a failure the worker
    can answer itself — no heartbeat timeout, no Temporal retry, no new worker."""

    def __init__(self, spec: RunSpec, inp: TrainSegmentInput, workdir: str, args: list[str],
                 faults: FaultRecorder, checkpoint_bytes: int) -> None:
        self.spec, self.inp, self.workdir = spec, inp, workdir
        self.args, self.faults = args, faults
        self.checkpoint_bytes = checkpoint_bytes  # the newest commit's (the hang timeout's)
        # the hang timeout's step times, carried across restarts in place: a restart's
        # timeout is not re-learnt from its first, slow steps
        self.step_times: deque[float] = deque(maxlen=STEP_WINDOW)

    def run(self, on_progress: Callable[[ProgressLine], None],
            heartbeat: Callable[[], None]) -> None:
        spec, inp = self.spec, self.inp
        args = [*self.args, "--restart", str(self.faults.restart)] if self.faults.restart \
            else self.args
        procs = spec.train.procs_per_node

        def seen(line: ProgressLine) -> None:
            # the size of what a restart resumes from (newer, maybe larger) without a listing
            # and a manifest read on the restart's path: the launch's own commits say it
            if isinstance(line, CommitLine):
                self.checkpoint_bytes = max(self.checkpoint_bytes, line.bytes)
            on_progress(line)
        supervise(trainer_command("trainer.segment", procs, args, inp.gang),
                  # a gang launches through torchrun (docs/decisions.md)
                  warm=None if inp.gang else trainer_launch("trainer.segment", procs, args),
                  workdir=self.workdir,
                  env=child_env({**child_trace_env(), WORKER_PID_ENV: str(os.getpid())}),
                  on_failure=self.faults.on_failure,
                  progress_file=os.path.join(self.workdir, "progress.jsonl"),
                  on_progress=seen, heartbeat=heartbeat,
                  is_cancelled=activity.is_cancelled, draining=drain.reason,
                  hang=HangLimits.of(spec, inp.to_step, checkpoint_bytes=self.checkpoint_bytes),
                  stop_grace_s=spec.ops.stop_grace_s, poll_s=POLL_S,
                  # a gang member that cannot finish a step after a stop has lost its
                  # peers: killed, not left in a collective (workflows/gang.py)
                  stop_quiet_s=GANG_STOP_QUIET_S if inp.gang else None,
                  step_times=self.step_times)

    def again_in_place(self, exc: BaseException) -> bool:
        """Whether the failure just recorded is answered by launching again here."""
        f, spec = self.faults.fault, self.spec
        return bool(f) and self.inp.gang is None and retryable(exc) \
            and f["kind"] in IN_PLACE_KINDS and self.faults.restart < IN_PLACE_RESTARTS \
            and not activity.is_cancelled() and not drain.draining() \
            and self.faults.decision(spec.run_id, spec.ops.repeat_failure_limit,
                                     self.inp.micro_split) is None


class Heartbeats:
    """The activity's heartbeat from a thread of its own, every `every_s`: neither a busy
    trainer nor a slow storage call in the supervisor's loop can delay it past the timeout.
    It stops beating when the supervisor shows no life for `stall_s` (a stuck supervisor
    is a lost worker)."""

    def __init__(self, details: Callable[[], dict], every_s: float,
                 stall_s: float = 300.0) -> None:
        self.details, self.every_s, self.stall_s = details, every_s, stall_s
        self.alive = time.monotonic()
        self.stop = threading.Event()

    def tick(self) -> None:
        """The supervisor is alive (and beats now)."""
        self.alive = time.monotonic()
        activity.heartbeat(self.details())

    def __enter__(self) -> Heartbeats:
        in_context(self._run, name="mainspring-heartbeat")
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            if time.monotonic() - self.alive < self.stall_s:
                activity.heartbeat(self.details())


def follower_result(store: CheckpointStore, inp: TrainSegmentInput,
                    attempt: int) -> TrainSegmentResult:
    """What a gang's node other than 0 returns: where the durable store stands (node 0's
    ranks write the segment's result, and the workflow reads node 0's)."""
    last = store.latest_committed(at_or_before=inp.to_step)
    return TrainSegmentResult(final_step=last if last is not None else inp.from_step,
                              last_committed_step=last if last is not None else -1,
                              last_committed_uri=store.uri(last) if last is not None else "",
                              train_loss=None, resumed_from=None, attempt=attempt)


def preempted(faults: FaultRecorder, committed: int | None) -> Preempted:
    """The worker drains: the segment stopped at a committed step; its fault is recorded
    (the next attempt's `recovered` names it) and the retry goes to another worker now."""
    now = time.time()
    faults.on_failure(ChildFailure("preempted", f"{drain.reason()}; committed step {committed}",
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
                              step_time_s=float(step_time) if step_time else None)


@activity.defn(name=EVALUATE)
@classified
def evaluate(inp: EvaluateInput) -> EvaluateResult:
    spec = nodes.on_this_node(RunSpec.from_dict(inp.spec))
    with nodes.occupying(f"{spec.run_id} evaluate", activity.heartbeat), \
            activity_span("evaluate", spec, steps=",".join(map(str, inp.steps))), \
            fast_tier.lease(spec.storage.fast, spec.run_id, spec.storage.durable):
        result = _evaluate(spec, inp)
        # Training is over: this machine's fast tier of the run is a cache of durable
        # commits. Deleted while the lease is held, as every deletion there is.
        fast_tier.release(spec.storage.fast, spec.run_id)
    return result


def _evaluate(spec: RunSpec, inp: EvaluateInput) -> EvaluateResult:
    workdir = os.path.join(fast_tier.run_dir(spec.storage.fast, spec.run_id), "eval",
                           f"attempt-{activity.info().attempt}")
    os.makedirs(workdir, exist_ok=True)
    spec_file, out = os.path.join(workdir, "spec.json"), os.path.join(workdir, "eval.json")
    with open(spec_file, "w") as f:
        json.dump(inp.spec, f)
    cmd = [sys.executable, "-m", "trainer.evaluate",
           "--spec", spec_file, "--dataset", inp.dataset_uri,
           "--steps", ",".join(map(str, inp.steps)), "--workdir", workdir, "--out", out]
    supervise(cmd, workdir=workdir, env=child_env(child_trace_env()),
              heartbeat=activity.heartbeat, is_cancelled=activity.is_cancelled)
    with open(out) as f:
        points = [EvalPoint(**r) for r in json.load(f)["results"]]
    with EventLog(spec.storage.durable, spec.run_id, "evaluator") as events:
        for p in points:
            events.emit("eval", step=p.step, event_id=f"eval/{p.step}", val_loss=p.val_loss,
                        perplexity=p.perplexity if math.isfinite(p.perplexity) else None)
    return EvaluateResult(results=points)
