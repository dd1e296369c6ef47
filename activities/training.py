"""train_segment and evaluate: thin adapters that supervise `trainer/` child processes.

Heartbeat details carry only durable facts (DESIGN §3): the last committed checkpoint's
URI and step. A retry resumes from the store's newest committed step at or before the
segment's end, which the child finds itself; this activity records the recovery.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import structlog
from temporalio import activity

from activities.contracts import (EVALUATE, TRAIN_SEGMENT, EvalPoint, EvaluateInput,
                                  EvaluateResult, TrainSegmentInput, TrainSegmentResult)
from activities.errors import classified
from activities.supervise import ProgressTail, child_env, supervise, trainer_command
from ops.spec import RunSpec
from ops.telemetry import child_trace_env
from storage.checkpoints import CheckpointStore
from storage.events import EventLog
from trainer.faults import WORKER_PID_ENV

log = structlog.get_logger(__name__)


def segment_workdir(spec: RunSpec, from_step: int, to_step: int) -> str:
    return os.path.join(os.path.abspath(spec.storage.fast), spec.run_id, "segments",
                        f"{from_step:09d}-{to_step:09d}")


class DurableCommit:
    """The last committed checkpoint, as the child reports it: the heartbeat's only content."""

    def __init__(self, step: int | None, uri: str) -> None:
        self.step, self.uri = step, uri

    def details(self) -> dict:
        return {"step": self.step, "uri": self.uri}

    def on_progress(self, line: dict) -> None:
        if line.get("type") == "commit":
            self.step, self.uri = line["step"], line["uri"]
            activity.heartbeat(self.details())


def _record_recovery(events: EventLog, workdir: str, store: CheckpointStore,
                     inp: TrainSegmentInput, attempt: int) -> None:
    """On a retry: what was lost, from where we resume, and how long it took (MTTR)."""
    heartbeat = activity.info().heartbeat_details
    beat_step = heartbeat[0].get("step") if heartbeat and isinstance(heartbeat[0], dict) else None
    # Resume from the newer of the store's latest commit and the last heartbeat (DESIGN §3);
    # the child reads the store, so a heartbeat newer than the store is an inconsistency.
    resumed = store.latest_committed(at_or_before=inp.to_step)
    if beat_step is not None and (resumed is None or beat_step > resumed):
        log.error("heartbeat_ahead_of_store", heartbeat_step=beat_step, store_step=resumed)
    progress = os.path.join(workdir, "progress.jsonl")
    seen = [p for p in ProgressTail(progress, from_start=True).read() if p.get("type") == "step"]
    last_step = seen[-1]["step"] if seen else inp.from_step
    last_ts = seen[-1]["ts"] if seen else time.time()
    events.emit("recovered", step=resumed, event_id=f"recovered/{inp.from_step}-{inp.to_step}/{attempt}",
                resumed_step=resumed, heartbeat_step=beat_step, last_step_seen=last_step,
                lost_steps=max(0, last_step - (resumed or 0)), mttr_s=round(time.time() - last_ts, 2),
                attempt=attempt)


@activity.defn(name=TRAIN_SEGMENT)
@classified
def train_segment(inp: TrainSegmentInput) -> TrainSegmentResult:
    spec = RunSpec.from_dict(inp.spec)
    attempt = activity.info().attempt
    workdir = segment_workdir(spec, inp.from_step, inp.to_step)
    os.makedirs(workdir, exist_ok=True)
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    events = EventLog(spec.storage.durable, spec.run_id, "supervisor", attempt=attempt)
    if attempt > 1:
        _record_recovery(events, workdir, store, inp, attempt)
    events.emit("segment_started", step=inp.from_step,
                event_id=f"segment_started/{inp.from_step}-{inp.to_step}/{attempt}",
                from_step=inp.from_step, to_step=inp.to_step, attempt=attempt)
    events.flush()
    latest = store.latest_committed(at_or_before=inp.to_step)
    tracker = DurableCommit(latest, store.uri(latest) if latest is not None else "")
    spec_file = os.path.join(workdir, "spec.json")
    with open(spec_file, "w") as f:
        json.dump(inp.spec, f)
    args = ["--spec", spec_file, "--dataset", inp.dataset_uri, "--to-step", str(inp.to_step),
            "--workdir", workdir, "--attempt", str(attempt)]
    supervise(trainer_command("trainer.segment", spec.train.world_size, args), workdir=workdir,
              env=child_env({**child_trace_env(), WORKER_PID_ENV: str(os.getpid())}),
              progress_file=os.path.join(workdir, "progress.jsonl"),
              on_progress=tracker.on_progress, heartbeat=lambda: activity.heartbeat(tracker.details()),
              is_cancelled=activity.is_cancelled, hang_timeout_s=spec.ops.hang_timeout_s)
    with open(os.path.join(workdir, "result.json")) as f:
        res = json.load(f)
    events.emit("segment_finished", step=res["final_step"],
                event_id=f"segment_finished/{inp.from_step}-{inp.to_step}",
                from_step=inp.from_step, to_step=inp.to_step, attempt=attempt,
                train_loss=res["train_loss"], resumed_from=res["resumed_from"])
    events.flush()
    return TrainSegmentResult(final_step=res["final_step"],
                              last_committed_step=res["last_committed_step"],
                              last_committed_uri=res["last_committed_uri"],
                              train_loss=res["train_loss"], resumed_from=res["resumed_from"],
                              attempt=attempt)


@activity.defn(name=EVALUATE)
@classified
def evaluate(inp: EvaluateInput) -> EvaluateResult:
    spec = RunSpec.from_dict(inp.spec)
    workdir = os.path.join(os.path.abspath(spec.storage.fast), spec.run_id, "eval",
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
