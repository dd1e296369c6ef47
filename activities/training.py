"""train_segment and evaluate: thin adapters that supervise `trainer/` child processes.

Heartbeat details carry only durable facts (DESIGN §3): the last committed checkpoint's
URI and step. A retry's child resumes from the newest checkpoint at or before the segment's
end that verifies on either tier (the fast tier when the retry lands on the same machine);
this activity records the recovery with where the child actually resumed.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import structlog
from temporalio import activity
from temporalio.exceptions import CancelledError

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
from activities.metrics import MetricsForwarder
from activities.supervise import ProgressTail, child_env, supervise, trainer_command
from common.procs import WORKER_PID_ENV
from common.protocol import CommitLine, ProgressLine, SegmentResult, StartLine, StepLine
from common.telemetry import child_trace_env
from spec import RunSpec
from storage import fast_tier
from storage.checkpoints import CheckpointStore
from storage.events import EventLog
from trainer.extensions import clear_stale_build_locks

log = structlog.get_logger(__name__)


def segment_workdir(spec: RunSpec, from_step: int, to_step: int) -> str:
    return os.path.join(fast_tier.run_dir(spec.storage.fast, spec.run_id), "segments",
                        f"{from_step:09d}-{to_step:09d}")


def prepare_fast_tier(spec: RunSpec, store: CheckpointStore) -> None:
    """Before a child writes checkpoints here: free what other runs left on this machine,
    then refuse at once (not retried) when the disk cannot hold what the segment keeps —
    the newest durable copy, the snapshots in flight and the one being written."""
    fast_tier.collect_garbage(spec.storage.fast, keep_run=spec.run_id)
    newest = store.latest_committed()
    if newest is not None:
        need = store.manifest(newest).total_bytes * (spec.storage.max_in_flight + 2)
        fast_tier.ensure_space(fast_tier.store_dir(spec.storage.fast, spec.run_id), need)


class DurableCommit:
    """The last committed checkpoint, as the child reports it: the heartbeat's only content."""

    def __init__(self, step: int | None, uri: str) -> None:
        self.step, self.uri = step, uri

    def details(self) -> dict:
        return {"step": self.step, "uri": self.uri}

    def on_progress(self, line: ProgressLine) -> None:
        if isinstance(line, CommitLine):
            self.step, self.uri = line.step, line.uri
            activity.heartbeat(self.details())


class Recovery:
    """A retry's evidence: what the lost attempt reached (read before the child starts) and
    where the new child actually resumed (its `start` line: durable or fast tier)."""

    def __init__(self, events: EventLog, workdir: str, inp: TrainSegmentInput,
                 attempt: int) -> None:
        self.events, self.inp, self.attempt, self.reported = events, inp, attempt, False
        heartbeat = activity.info().heartbeat_details
        self.beat_step = (heartbeat[0].get("step")
                          if heartbeat and isinstance(heartbeat[0], dict) else None)
        seen = [p for p in ProgressTail(os.path.join(workdir, "progress.jsonl"),
                                        from_start=True).read() if isinstance(p, StepLine)]
        self.last_step = seen[-1].step if seen else inp.from_step
        self.last_ts = seen[-1].ts if seen else time.time()

    def report(self, resumed: int | None) -> None:
        if self.reported:
            return
        self.reported = True
        self.events.emit(
            "recovered", step=resumed,
            event_id=f"recovered/{self.inp.from_step}-{self.inp.to_step}/{self.attempt}",
            resumed_step=resumed, heartbeat_step=self.beat_step, last_step_seen=self.last_step,
            lost_steps=max(0, self.last_step - (resumed or 0)),
            mttr_s=round(time.time() - self.last_ts, 2), attempt=self.attempt)
        self.events.flush()


@activity.defn(name=TRAIN_SEGMENT)
@classified
def train_segment(inp: TrainSegmentInput) -> TrainSegmentResult:
    spec = RunSpec.from_dict(inp.spec)
    with fast_tier.lease(spec.storage.fast, spec.run_id, spec.storage.durable):
        return _train_segment(spec, inp)


def _train_segment(spec: RunSpec, inp: TrainSegmentInput) -> TrainSegmentResult:
    attempt = activity.info().attempt
    workdir = segment_workdir(spec, inp.from_step, inp.to_step)
    os.makedirs(workdir, exist_ok=True)
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    events = EventLog(spec.storage.durable, spec.run_id, "supervisor", attempt=attempt)
    recovery = Recovery(events, workdir, inp, attempt) if attempt > 1 else None
    events.emit("segment_started", step=inp.from_step,
                event_id=f"segment_started/{inp.from_step}-{inp.to_step}/{attempt}",
                from_step=inp.from_step, to_step=inp.to_step, attempt=attempt)
    events.flush()
    prepare_fast_tier(spec, store)
    latest = store.latest_committed(at_or_before=inp.to_step)
    tracker = DurableCommit(latest, store.uri(latest) if latest is not None else "")
    info = activity.info()  # the same bounds can be scheduled twice (a stop before step 1)
    metrics = MetricsForwarder(events, spec.ops.metrics_every,
                               segment=f"{inp.from_step}-{inp.to_step}", attempt=attempt,
                               execution=f"{info.workflow_run_id[:8]}.{info.activity_id}")

    def on_progress(line: ProgressLine) -> None:
        tracker.on_progress(line)
        metrics.on_progress(line)
        if recovery and isinstance(line, StartLine):
            recovery.report(line.resumed_from)
    clear_stale_build_locks(older_than_s=spec.ops.hang_timeout_s)  # a builder that died
    spec_file = os.path.join(workdir, "spec.json")
    with open(spec_file, "w") as f:
        json.dump(inp.spec, f)
    windows_file = os.path.join(workdir, "lr_windows.json")  # not argv: E2BIG (issue 11)
    with open(windows_file, "w") as f:
        json.dump(inp.lr_windows, f)
    args = ["--spec", spec_file, "--dataset", inp.dataset_uri, "--to-step", str(inp.to_step),
            "--workdir", workdir, "--attempt", str(attempt),
            "--fast-dir", fast_tier.store_dir(spec.storage.fast, spec.run_id),
            "--lr-windows-file", windows_file, "--max-rollbacks", str(inp.max_rollbacks)]
    if inp.rollback:
        args += ["--rollback", inp.rollback.to_json()]
    result_file = os.path.join(workdir, "result.json")
    try:
        # A cancel (operator pause/rollback/abort) must not interrupt this thread: the
        # supervisor asks the trainer to stop at a checkpoint and waits for it.
        with activity.shield_thread_cancel_exception():
            supervise(trainer_command("trainer.segment", spec.train.world_size, args),
                      workdir=workdir,
                      env=child_env({**child_trace_env(), WORKER_PID_ENV: str(os.getpid())}),
                      progress_file=os.path.join(workdir, "progress.jsonl"),
                      on_progress=on_progress,
                      heartbeat=lambda: activity.heartbeat(tracker.details()),
                      is_cancelled=activity.is_cancelled, hang_timeout_s=spec.ops.hang_timeout_s,
                      stop_grace_s=spec.ops.stop_grace_s)
    except CancelledError:
        if not os.path.exists(result_file):  # killed before it stopped: a plain cancel
            raise
        log.info("segment_stopped_on_cancel", workdir=workdir)  # report where it stopped
    with open(result_file) as f:
        res = SegmentResult.from_json(f.read())
    metrics.close()  # the tail window; flushed with segment_finished below
    if recovery:  # an already-finished segment writes no start line
        recovery.report(res.resumed_from)
    events.emit("segment_finished", step=res.final_step,
                event_id=f"segment_finished/{inp.from_step}-{inp.to_step}",
                from_step=inp.from_step, to_step=inp.to_step, attempt=attempt,
                train_loss=res.train_loss, resumed_from=res.resumed_from)
    events.flush()
    return segment_result(res, attempt, store.list_committed())


def segment_result(res: SegmentResult, attempt: int, committed: list[int]) -> TrainSegmentResult:
    """The child's result.json as the workflow's contract; `committed` (the durable tier's
    steps after the segment) says how far back an operator rollback can still reach."""
    out = res.outcome
    return TrainSegmentResult(final_step=res.final_step,
                              last_committed_step=res.last_committed_step,
                              last_committed_uri=res.last_committed_uri,
                              train_loss=res.train_loss, resumed_from=res.resumed_from,
                              attempt=attempt, rollbacks=out.rollbacks,
                              skipped_steps=out.skipped_steps, stopped=out.stopped,
                              evals=out.evals,
                              oldest_committed_step=committed[0] if committed else None)


@activity.defn(name=EVALUATE)
@classified
def evaluate(inp: EvaluateInput) -> EvaluateResult:
    spec = RunSpec.from_dict(inp.spec)
    with fast_tier.lease(spec.storage.fast, spec.run_id, spec.storage.durable):
        result = _evaluate(spec, inp)
    # Training is over: this machine's fast tier of the run is a cache of durable commits.
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
