"""A train_segment attempt's trainer launch: its command line, the launch (from this
worker's warm standby when it has one, activities/standby.py) supervised to its end, and
the restart-in-place policy: a failure the worker can answer itself is launched again
here, with no heartbeat timeout, no Temporal retry and no new worker."""

from __future__ import annotations

import json
import os
from collections import deque
from typing import Callable

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import drain
from activities.contracts import TrainSegmentInput
from activities.hang import STEP_WINDOW, HangLimits
from activities.recovery import FaultRecorder, Recovery, execution_key
from activities.supervise import (
    Supervision,
    child_env,
    run_child,
    trainer_command,
    trainer_launch,
)
from common.errors import HardwareFault, MainspringError
from common.procs import WORKER_PID_ENV
from common.protocol import CommitLine, ProgressLine
from common.telemetry import child_trace_env
from spec import RunSpec
from storage import fast_tier
from storage.events import EventLog

log = structlog.get_logger(__name__)

# Failures a restart in place answers: the worker is alive and saw the rank fail; the
# node's device and storage are not suspected (an ECC or CUDA error, an OOM, storage away
# go through a Temporal retry or a decision). At most IN_PLACE_RESTARTS per attempt, then
# the retry (maybe elsewhere); the same failure repeated stops at the repeat budget first.
IN_PLACE_KINDS = frozenset({"rank_lost", "crash", "hang", "nccl"})
IN_PLACE_RESTARTS = 3
POLL_S = 0.25  # the supervisor's loop: how soon a child's end or a lost rank is seen
GANG_STOP_QUIET_S = 5.0  # a stopping gang member with no step since the stop request


def retryable(exc: BaseException) -> bool:
    if isinstance(exc, ApplicationError):
        return not exc.non_retryable
    return not isinstance(exc, MainspringError) or exc.retryable


def segment_args(spec: RunSpec, inp: TrainSegmentInput, workdir: str, attempt: int,
                 committed: list[int]) -> list[str]:
    """trainer.segment's arguments. The spec and the LR windows are written into `workdir`
    and passed as files (the windows are too long for exec's argv: E2BIG); `committed`,
    the durable tier's steps, says whether the segment is finished already."""
    spec_file = os.path.join(workdir, "spec.json")
    with open(spec_file, "w") as f:
        json.dump(inp.spec, f)
    windows_file = os.path.join(workdir, "lr_windows.json")
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
    return args


class Launch:
    """The attempt's trainer child: launched, and launched again in place after a failure
    the worker can answer itself (until_done). `recovery` is the attempt's recovery (a
    retry, or a segment after a decided fault), then the last restart in place's: the
    progress it is fed says when training went on."""

    def __init__(self, spec: RunSpec, inp: TrainSegmentInput, workdir: str, args: list[str],
                 *, attempt: int, events: EventLog, faults: FaultRecorder,
                 recovery: Recovery | None, checkpoint_bytes: int) -> None:
        self.spec, self.inp, self.workdir, self.args = spec, inp, workdir, args
        self.attempt, self.events, self.faults, self.recovery = attempt, events, faults, recovery
        self.checkpoint_bytes = checkpoint_bytes  # the newest commit's (the hang timeout's)
        # the hang timeout's step times, carried across restarts in place: a restart's
        # timeout is not re-learnt from its first, slow steps
        self.step_times: deque[float] = deque(maxlen=STEP_WINDOW)

    def until_done(self, on_progress: Callable[[ProgressLine], None],
                   heartbeat: Callable[[], None]) -> None:
        """Launch, and again in place after each failure again_in_place answers."""
        while True:
            try:
                self.run(on_progress, heartbeat)
                return
            except (HardwareFault, ApplicationError) as exc:
                if not self.again_in_place(exc):
                    raise
                self.recovery = Recovery(self.events, self.workdir, self.inp, self.attempt,
                                         execution_key(), in_place=self.faults,
                                         unanswered=self.recovery)
                self.faults.restarted()
                log.warning("segment_restarting_in_place", restart=self.faults.restart,
                            error=str(exc)[:300])

    def run(self, on_progress: Callable[[ProgressLine], None],
            heartbeat: Callable[[], None]) -> None:
        """One launch, supervised to its end (activities/supervise.py)."""
        spec, inp = self.spec, self.inp
        args = [*self.args, "--restart", str(self.faults.restart)] if self.faults.restart \
            else self.args
        procs = spec.train.procs_per_node
        run_child(trainer_command("trainer.segment", procs, args, inp.gang), self.workdir,
                  child_env({**child_trace_env(), WORKER_PID_ENV: str(os.getpid())}),
                  Supervision(
                      progress_file=os.path.join(self.workdir, "progress.jsonl"),
                      on_progress=lambda line: self._seen(line, on_progress),
                      heartbeat=heartbeat, is_cancelled=activity.is_cancelled,
                      draining=drain.reason, stop_grace_s=spec.ops.stop_grace_s,
                      # a gang member that cannot finish a step after a stop has lost its
                      # peers: killed, not left in a collective (workflows/gang.py)
                      stop_quiet_s=GANG_STOP_QUIET_S if inp.gang else None,
                      hang=HangLimits.of(spec, inp.to_step,
                                         checkpoint_bytes=self.checkpoint_bytes),
                      step_times=self.step_times, on_failure=self.faults.on_failure,
                      # a gang launches through torchrun (docs/decisions.md)
                      warm=None if inp.gang else trainer_launch("trainer.segment", procs, args),
                      poll_s=POLL_S))

    def _seen(self, line: ProgressLine, on_progress: Callable[[ProgressLine], None]) -> None:
        # the size of what a restart resumes from (newer, maybe larger) without a listing
        # and a manifest read on the restart's path: the launch's own commits say it
        if isinstance(line, CommitLine):
            self.checkpoint_bytes = max(self.checkpoint_bytes, line.bytes)
        on_progress(line)
        if self.recovery:  # the attempt's, or the last restart in place's
            self.recovery.on_progress(line)

    def again_in_place(self, exc: BaseException) -> bool:
        """Whether the failure just recorded is answered by launching again here."""
        f, spec = self.faults.fault, self.spec
        return f is not None and self.inp.gang is None and retryable(exc) \
            and f.kind in IN_PLACE_KINDS and self.faults.restart < IN_PLACE_RESTARTS \
            and not activity.is_cancelled() and not drain.draining() \
            and self.faults.decision(spec.run_id, spec.ops.repeat_failure_limit,
                                     self.inp.micro_split) is None
