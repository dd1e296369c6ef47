"""Faults and recoveries of a training segment, as the supervisor sees them (docs/design.md,
"Faults and recoveries").

Whoever sees a fault first writes its `fault` event, under a stable id: the failure of
attempt N of a segment is `fault/<lo>-<hi>/<execution>/<N>`.
- The supervisor of attempt N, for a child that exits by a signal or non-zero code, hangs,
  or loses a rank (`FaultRecorder`, fed by the detectors' Fault records), and for an error of
  its own; it also leaves the fault's id and times in its last heartbeat's details.
- Attempt N+1, when attempt N's last launch ended with no fault of its own (its worker
  vanished: a heartbeat timeout): nobody else saw it, so it writes a `worker_lost` fault
  under that launch's id from the heartbeat details (last heartbeat time and committed
  step) and, on the same machine, the progress file. Which fault that is, and whether it
  is still open, is read from the event log (activities/fault_ledger.py): a fault an
  in-place restart already recovered is closed, and is never answered again.
Attempt N+1 then writes `recovered`, naming the fault it answers, once its first step is
done: the step it resumed from, the steps lost, and the time split into detection (fault
-> seen), restart (seen -> the new child starts restoring) and restore, and mttr_s (fault
-> the end of the first new step). One `recovered` per fault: its id is the fault's
(common/faults.py `recovered_id`), and of two closers of one fault (a Temporal outage past
the heartbeat timeout: the server watch when the server answers, this retry at its first
step) the second finds it written and writes nothing, so the fault has one MTTR.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from typing import Any, Callable

import structlog
from temporalio import activity

from activities.contracts import TrainSegmentInput
from activities.errors import with_fault
from activities.fault_ledger import Answer, answer, fault_of, ledger, segment_prefix
from activities.heartbeat import Beat
from activities.supervise import ProgressTail
from common.errors import (
    MainspringError,
    OutOfMemory,
    RepeatedFailure,
    StorageUnavailable,
)
from common.faults import (
    NEXT_ATTEMPT,
    SUPERVISOR,
    Fault,
    Repeat,
    detection_between,
    record_fault,
    recovered_id,
    to_ms,
)
from common.protocol import StartLine, StepLine, launch_tag
from common.threads import in_context
from storage.events import EventLog, read_events

log = structlog.get_logger(__name__)


def execution_key() -> str:
    """Tells apart two schedulings of the same segment bounds (both attempt 1)."""
    info = activity.info()
    return f"{info.workflow_run_id[:8]}.{info.activity_id}"


def fault_id(inp: TrainSegmentInput, execution: str, attempt: int, restart: int = 0) -> str:
    return f"fault/{inp.from_step}-{inp.to_step}/{execution}/{launch_tag(attempt, restart)}"


def round_s(x: float | None) -> float | None:
    return None if x is None else round(max(0.0, x), 3)


# ---- the repeated-failure budget (ops.repeat_failure_limit) ------------------------------
def fingerprint(fault: Fault) -> str:
    """Pure: what makes two failures "the same" — kind, step, exception type (or signal)
    and the innermost frame."""
    what = fault.error_type or fault.signal or ""
    return f"{fault.kind} at step {fault.last_step} {what} {fault.frame}".strip()


def prior_repeat(heartbeat_details: Any) -> Repeat:
    """The run of identical failures the last attempt left in its heartbeat (none: empty)."""
    return Beat.from_details(heartbeat_details).repeat


# what a human does about a failure that repeats, by kind (docs/faults.md)
FIXES = {
    "crash": "read the traceback (the fault events' log_tail and frame); fix the code, or "
             "skip the data with `mainspring run rollback RUN --to-step STEP --skip-data`",
    "ecc": "take the GPU or node the fault events name out of service",
    "cuda": "check the driver and the node the fault events name; take it out of service",
    "nccl": "check the network between the nodes and NCCL's settings",
    "hang": "look at the hung rank's stack (py-spy dump); if a step is legitimately that "
            "slow, raise ops.hang_floor_s or ops.hang_step_factor (or fix ops.hang_timeout_s)",
    "rank_lost": "see which rank keeps dying and why (dmesg, the node's health)",
}


def fix_for(kind: str, run_id: str) -> str:
    what = FIXES.get(kind, "fix the cause the fault events show")
    return f"{what}, then `mainspring run resume {run_id}`"


class FaultRecorder:
    """Attempt N's own faults: one `fault` event at most, flushed at once (the process may
    be about to die with the segment); the record also goes into the heartbeat."""

    def __init__(self, events: EventLog, inp: TrainSegmentInput, attempt: int,
                 execution: str, heartbeat: Callable[[Fault, Repeat], None],
                 repeat: Repeat | None = None,
                 on_restart: Callable[[int], None] | None = None) -> None:
        self.events, self.inp, self.attempt, self.heartbeat = events, inp, attempt, heartbeat
        self.event_id = fault_id(inp, execution, attempt)
        self.recorded = False
        self.last_step: int | None = None
        self.repeat = repeat or Repeat()  # the run of identical failures, this one included
        self.fault: Fault | None = None  # this attempt's fault, once recorded
        self.execution, self.restart = execution, 0
        self.on_restart = on_restart or (lambda _: None)  # the heartbeat's (heartbeat.py)

    def restarted(self) -> None:
        """The attempt's child is started again in place (activities/launch.py): the next
        failure is a fault of its own; the run of identical failures goes on. The heartbeat
        names the new launch and no longer the fault, which the restart's recovery closes."""
        self.restart += 1
        self.event_id = fault_id(self.inp, self.execution, self.attempt, self.restart)
        self.recorded, self.fault = False, None
        self.on_restart(self.restart)

    def on_progress(self, line: object) -> None:
        if isinstance(line, StepLine):
            self.last_step = line.step

    def on_failure(self, seen: Fault) -> None:
        """A detector's fault (activities/child_exit.py, supervise.py, training.py)."""
        self._record(seen)

    def on_error(self, exc: BaseException) -> None:
        """An error of the activity itself (not its child's): recorded unless it is a
        decision (bad input, divergence: not retried) or a fault already recorded."""
        if self.recorded or (isinstance(exc, MainspringError) and not exc.retryable):
            return
        now = time.time()
        kind = "storage_outage" if isinstance(exc, StorageUnavailable) else "crash"
        self._record(Fault(kind, f"{type(exc).__name__}: {str(exc)[:400]}",
                           error_type=type(exc).__name__, fault_ts=now, detected_ts=now))

    def _record(self, seen: Fault) -> None:
        """The detector's fault, with where it struck (this attempt, its last step) and its
        identity: recorded, and beaten into the heartbeat."""
        if self.recorded:
            return
        self.recorded = True
        fault = dataclasses.replace(
            seen, event_id=self.event_id, attempt=self.attempt, last_step=self.last_step,
            restart=self.restart, segment=f"{self.inp.from_step}-{self.inp.to_step}",
            detected_by=SUPERVISOR)
        fault = dataclasses.replace(fault, fingerprint=fingerprint(fault))
        self.repeat = self.repeat.after(fault)
        self.fault = dataclasses.replace(fault, repeats=self.repeat.repeats)
        record_fault(self.events, self.fault)
        try:
            self.events.flush()
        except StorageUnavailable as exc:  # the next attempt records a worker_lost instead
            log.warning("fault_event_not_stored", error=exc.cause[:200])
        self.heartbeat(self.fault, self.repeat)

    def decision(self, run_id: str, limit: int, micro_split: int) -> MainspringError | None:
        """What this attempt's failure needs instead of a plain retry: an out-of-memory
        goes back to the workflow to adapt the micro-batch; the same failure `limit` times
        in a row stops the retrying. None: retry as usual. The error carries the fault
        (activities/errors.py `with_fault`) to the workflow's decision."""
        f = self.fault
        if f is None:
            return None
        which = {"fault_event_id": f.event_id, "fault_ts": f.fault_ts,
                 "last_step": f.last_step}
        if f.kind == "oom":
            return with_fault(OutOfMemory(f.evidence[:500], micro_split, **which), f)
        if self.repeat.repeats >= limit and not f.transient:
            return with_fault(RepeatedFailure(self.repeat.fingerprint, self.repeat.repeats,
                                              f.evidence[:500], fix_for(f.kind, run_id),
                                              **which), f)
        return None


def already_recovered(events: EventLog, fault_event_id: str,
                      cache_dir: str | None = None) -> bool:
    """Whether another closer already wrote the fault's one `recovered` (common/faults.py);
    False when the log cannot be read (a second copy is then dropped on read)."""
    try:
        return any(e["event_id"] == recovered_id(fault_event_id)
                   for e in read_events(events.url, events.run_id, kinds=("recovered",),
                                        cache_dir=cache_dir))
    except StorageUnavailable as exc:
        log.warning("recovered_unread", error=exc.cause[:200])
        return False


def server_outage(events: EventLog, inp: TrainSegmentInput, execution: str,
                  attempt: int, cache_dir: str | None = None) -> Fault | None:
    """The Temporal outage the server watch recorded for `attempt` (activities/
    server_watch.py), as a fault to answer (`outage_in`), read from the event log."""
    try:
        seen = read_events(events.url, events.run_id, kinds=("fault",), cache_dir=cache_dir)
    except StorageUnavailable:
        return None
    return outage_in(seen, inp, execution, attempt)


def outage_in(seen: list[dict], inp: TrainSegmentInput, execution: str,
              attempt: int) -> Fault | None:
    """Pure: the newest Temporal outage recorded for `attempt` among a run's events: with a
    heartbeat timeout shorter than the outage the server retries the attempt when it is
    back, although its worker was never lost — that retry answers the outage instead of
    recording a worker_lost."""
    prefix = f"fault/server_unavailable/{inp.from_step}-{inp.to_step}/{execution}/{attempt}/"
    found = [fault_of(e) for e in seen
             if e["kind"] == "fault" and e["event_id"].startswith(prefix)]
    return next((f for f in reversed(found) if f is not None), None)


class Recovery:
    """Attempt N+1's view of attempt N's fault (read before its child starts) and of its own
    recovery (the child's `start` line, then its first step)."""

    def __init__(self, events: EventLog, workdir: str, inp: TrainSegmentInput, attempt: int,
                 execution: str, in_place: FaultRecorder | None = None,
                 unanswered: Recovery | None = None, cache_dir: str | None = None) -> None:
        """For attempt N > 1 from attempt N-1's heartbeat; for the first attempt of a segment
        the workflow scheduled again after a decision (an OOM adapted, a pause for a
        repeated failure), from `inp.after_fault`; for a restart in place, from the fault
        the attempt's own recorder holds (`in_place`, before its restarted()). A restart in
        place also answers the faults of the launch before it that never reached a step
        (`unanswered`: a retry's first launch that crashed still owes its worker_lost).
        `cache_dir`: this machine's copies of the event log's batches (storage/events.py)."""
        self.events, self.inp, self.attempt, self.reported = events, inp, attempt, False
        self.execution, self.restart = execution, in_place.restart + 1 if in_place else 0
        self.start: StartLine | None = None
        self._settling: threading.Thread | None = None
        self.cache_dir = cache_dir
        # the fault has another closer (the server watch that recorded it): the first wins
        self.shared = False
        if in_place is not None:
            f = in_place.fault or Fault("crash")
            self.beat_step, self.fault_event_id = None, in_place.event_id
            earlier = unanswered.settled() \
                if unanswered is not None and not unanswered.reported else None
            self.also = [i for i in (earlier.fault_event_id, *earlier.also) if i] \
                if earlier is not None else []
            self.fault_ts = f.fault_ts or to_ms(time.time())
            self.detected_ts = f.detected_ts or self.fault_ts
            self.last_step = in_place.last_step if in_place.last_step is not None \
                else inp.from_step
            return
        info = activity.info()
        beat = Beat.from_details(info.heartbeat_details)
        self.beat_step = beat.step
        seen = [p for p in ProgressTail(os.path.join(workdir, "progress.jsonl"),
                                        from_start=True).read() if isinstance(p, StepLine)]
        local_step = seen[-1].step if seen else None
        local_ts = seen[-1].ts if seen else None
        # this attempt was scheduled when Temporal gave up on the last one (the timeout)
        scheduled = info.current_attempt_scheduled_time.timestamp() \
            if info.current_attempt_scheduled_time else time.time()
        decided = Fault.from_json(inp.after_fault) if inp.after_fault else None
        prior = beat.fault if attempt > 1 else None
        settle = functools.partial(self._settle, beat_ts=beat.ts, local_step=local_step,
                                   local_ts=local_ts, scheduled=scheduled)

        # Which fault is open is the event log's to say (activities/fault_ledger.py): the
        # heartbeat's fault may be one a restart in place already recovered. The read runs
        # beside the launch; every reader of this Recovery waits for it (settled).
        def look() -> None:
            try:
                record = read_events(events.url, events.run_id, kinds=("fault", "recovered"),
                                     cache_dir=cache_dir)
            except Exception as exc:  # noqa: BLE001 — unread: nothing is known closed
                log.warning("fault_record_unread", error=repr(exc)[:300])
                record = None
            # a retry the server made after its outage answers the outage (one closer each)
            outage = outage_in(record or [], inp, execution, attempt - 1) \
                if attempt > 1 and prior is None else None
            self.shared = outage is not None
            prefix = segment_prefix(inp.from_step, inp.to_step, execution)
            try:
                found = Answer(outage.event_id, outage) if outage is not None else answer(
                    attempt, prefix, prior=prior, decided=decided, beat_launch=beat.restart,
                    book=None if record is None else ledger(record, prefix))
            except Exception as exc:  # noqa: BLE001 — a record unread is nothing known closed
                log.warning("fault_record_unread", error=repr(exc)[:300])
                found = answer(attempt, prefix, prior=prior, decided=decided,
                               beat_launch=beat.restart)
            try:
                settle(found)
            except StorageUnavailable as exc:  # the fault event stays buffered: next flush
                log.warning("worker_lost_not_stored", error=exc.cause[:200])
        # in the activity's context: the fault is an event of the attempt's span too
        self._settling = in_context(look, name="mainspring-recovery")

    def settled(self) -> Recovery:
        """This Recovery, once the fault it answers is known (and a worker_lost recorded)."""
        if self._settling is not None:
            self._settling.join()
            self._settling = None
        return self

    def _settle(self, found: Answer, *, beat_ts: float | None, local_step: int | None,
                local_ts: float | None, scheduled: float) -> None:
        """The fault this attempt answers (activities/fault_ledger.py): the one its
        predecessor or a decision recorded, else a worker_lost of its own making, from the
        heartbeat and progress file; none when a decided fault is already closed."""
        seen = found.fault or Fault("worker_lost")
        self.fault_event_id = found.event_id
        # a multi-node launch's other faults (its peers' broken collectives), and the
        # execution's other open faults: answered too
        self.also = list(found.also)
        known = [t for t in (beat_ts, local_ts) if t is not None]
        # to the millisecond, as the fault event keeps them: its detection_s is ours
        self.fault_ts = seen.fault_ts or to_ms(max(known) if known else scheduled)
        self.detected_ts = seen.detected_ts or to_ms(scheduled)
        candidates = [s for s in (seen.last_step, local_step, self.beat_step)
                      if s is not None]
        self.last_step = max(candidates) if candidates else self.inp.from_step
        if found.worker_lost:
            self._worker_lost(beat_ts, local_step, found.launch)

    def _worker_lost(self, beat_ts: float | None, local_step: int | None,
                     launch: int) -> None:
        ago = f"{self.detected_ts - self.fault_ts:.1f}s before this retry was scheduled"
        record_fault(self.events, Fault(
            "worker_lost", f"attempt {self.attempt - 1}'s worker stopped heartbeating; last "
                           f"sign of life {ago} (heartbeat: committed step {self.beat_step})",
            event_id=self.fault_event_id, detected_by=NEXT_ATTEMPT, attempt=self.attempt - 1,
            restart=launch, segment=f"{self.inp.from_step}-{self.inp.to_step}",
            last_step=self.last_step, fault_ts=self.fault_ts, detected_ts=self.detected_ts,
            facts={"heartbeat_step": self.beat_step, "heartbeat_ts": beat_ts,
                   "local_step": local_step}))
        self.events.flush()

    def on_progress(self, line: object) -> None:
        if isinstance(line, StartLine):
            self.start = line
        elif isinstance(line, StepLine) and self.start is not None:
            self.report(self.start.resumed_from, first_step_ts=line.ts)

    def report(self, resumed: int | None, first_step_ts: float | None = None) -> None:
        self.settled()
        if self.reported:
            return
        self.reported = True
        if not self.fault_event_id:  # its decided fault was closed already: none to close
            return
        start = self.start
        restore_s = start.restore_s if start else 0.0
        restore_began = (start.ts - restore_s) if start else None
        mttr_s = round_s((first_step_ts or time.time()) - self.fault_ts)
        if self.shared and already_recovered(self.events, self.fault_event_id, self.cache_dir):
            log.info("fault_already_recovered", fault_event_id=self.fault_event_id,
                     attempt=self.attempt, resumed_step=resumed, mttr_s_here=mttr_s)
            return
        self.events.emit(
            "recovered", step=resumed, event_id=recovered_id(self.fault_event_id),
            fault_event_id=self.fault_event_id, resumed_step=resumed,
            **({"also_answers": self.also} if self.also else {}),
            heartbeat_step=self.beat_step, last_step_seen=self.last_step,
            lost_steps=max(0, self.last_step - (resumed or 0)), attempt=self.attempt,
            **({"restart": self.restart, "in_place": True} if self.restart else {}),
            tier=start.restore_tier if start else "",
            detection_s=detection_between(self.fault_ts, self.detected_ts),
            restart_s=round_s(restore_began - self.detected_ts) if restore_began else None,
            restore_s=round_s(restore_s),
            mttr_s=mttr_s)
        self.events.flush()
