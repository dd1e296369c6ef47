"""Durable per-step training metrics: the supervisor turns progress lines into events.

The trainer's `progress.jsonl` lives on the worker's local disk and is gone with the
machine; the durable event log is what `mainspring report` reads after the run or a crash.
One `train_metrics` event summarises `every` optimizer steps, so a long run adds one small
event per window rather than one per step (DESIGN §3: payloads stay small).

Event ids are `train_metrics/<segment>[/<execution>]/<attempt>/<seq>`: a rollback replays
step numbers within one attempt and a retry replays them in another, and each replay is a
new trajectory that must not collapse onto the first by id (readers keep the earliest copy
of an id). `execution` tells apart two schedulings of the same segment bounds, both attempt
1 (the workflow re-runs a segment that stopped at its first step after a rollback). Within
one forwarder the ids are deterministic, so a window emitted twice dedupes on read.

The same lines also feed the worker's live Prometheus gauges and counters (`LiveMetrics`,
instruments in `common/metrics.py`) when the worker serves metrics; otherwise that is a no-op.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import structlog

from common.errors import StorageUnavailable
from common.metrics import TrainingInstruments, training_instruments
from common.protocol import CommitLine, ProgressLine, StepLine
from storage.events import EventLog

log = structlog.get_logger(__name__)

# Ten steps per event: ~16 events for the demo's 160 steps, ~10 K for a 100 K-step run,
# a few MB of JSON in all — dense enough for a loss curve, small enough for the log.
DEFAULT_EVERY = 10


def aggregate(lines: Iterable[StepLine]) -> dict:
    """Pure: one window's summary of progress `step` lines (common/protocol.py).

    Losses count only when finite (the trainer writes a non-finite loss as null); the
    band is null when none is. A skipped step (verdict "skip") is counted, its loss kept:
    the spike is what the curve should show.
    """
    lines = list(lines)
    if not lines:
        raise ValueError("aggregate needs at least one step line")
    losses = [float(x.loss) for x in lines if _finite(x.loss)]
    tps = [float(x.tokens_per_s) for x in lines if _finite(x.tokens_per_s)]
    mfu = [float(x.mfu) for x in lines if _finite(x.mfu)]
    mem = [int(x.peak_mem_bytes) for x in lines if x.peak_mem_bytes is not None]
    return {
        "first_step": lines[0].step,
        "last_step": lines[-1].step,
        "steps": len(lines),
        "loss_mean": sum(losses) / len(losses) if losses else None,
        "loss_min": min(losses) if losses else None,
        "loss_max": max(losses) if losses else None,
        "nonfinite": len(lines) - len(losses),
        "lr": lines[-1].lr,
        "tokens_per_s": sum(tps) / len(tps) if tps else None,
        "mfu": sum(mfu) / len(mfu) if mfu else None,
        "skipped": sum(1 for x in lines if x.verdict == "skip"),
        "peak_mem_bytes": max(mem) if mem else None,
    }


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class LiveMetrics:
    """One run's progress lines as Prometheus updates: a few instrument calls per step.

    Gauges hold the last value reported (a null, i.e. non-finite, loss leaves the loss
    gauge at its last finite value; the skip it causes is counted). Counters count what
    the worker ran, rollback replays included, so their rate is the work done. Callers
    pass `commit` and `step` lines (MetricsForwarder does).
    """

    def __init__(self, instruments: TrainingInstruments, run_id: str) -> None:
        self.m, self.attrs = instruments, {"run_id": run_id}
        self.gauges = ((instruments.loss, "loss"), (instruments.learning_rate, "lr"),
                       (instruments.tokens_per_second, "tokens_per_s"), (instruments.mfu, "mfu"),
                       (instruments.peak_memory, "peak_mem_bytes"))  # StepLine fields

    @classmethod
    def for_run(cls, run_id: str) -> LiveMetrics | None:
        """None when this process serves no metrics endpoint (common/metrics.py)."""
        instruments = training_instruments()
        return cls(instruments, run_id) if instruments else None

    def on_progress(self, line: StepLine | CommitLine) -> None:
        if isinstance(line, CommitLine):
            self.m.checkpoints_committed.add(1, self.attrs)
            return
        self.m.step.set(line.step, self.attrs)
        self.m.steps.add(1, self.attrs)
        for gauge, key in self.gauges:
            if _finite(value := getattr(line, key)):
                gauge.set(value, self.attrs)
        tokens = step_tokens(line)
        if tokens:
            self.m.tokens.add(tokens, self.attrs)
        if line.verdict == "skip":
            self.m.batches_skipped.add(1, self.attrs)


def step_tokens(line: StepLine) -> int | None:
    """Pure: the tokens one step trained on. The line carries its rate and duration (the
    trainer's Meter divides the step's tokens by its time), so their product is exact up
    to float rounding."""
    tps, dt = line.tokens_per_s, line.step_time_s
    return round(tps * dt) if _finite(tps) and _finite(dt) else None


class MetricsForwarder:
    """Aggregates a segment attempt's `step` progress lines into `train_metrics` events.

    Windows end on multiples of `every` (steps 1–10, 11–20, …) so a retry's or replay's
    windows line up with the first attempt's. A window also ends early when the step
    number goes backwards (a rollback): one event never mixes two trajectories. The
    event log is flushed at each checkpoint commit, so the metrics up to the last durable
    checkpoint survive the worker. One thread calls it (the supervisor's poll loop).
    """

    def __init__(self, events: EventLog, every: int = DEFAULT_EVERY, *, segment: str,
                 attempt: int, execution: str = "") -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.events, self.every, self.segment, self.attempt = events, every, segment, attempt
        self.prefix = "/".join(p for p in ("train_metrics", segment, execution, str(attempt)) if p)
        self.window: list[StepLine] = []
        self.seq = 0
        self.live = LiveMetrics.for_run(events.run_id)

    def on_progress(self, line: ProgressLine) -> None:
        if isinstance(line, CommitLine):
            if self.live:
                self.live.on_progress(line)
            self._flush()
            return
        if not isinstance(line, StepLine) or not isinstance(line.step, int):
            return
        if self.live:
            self.live.on_progress(line)
        if self.window and line.step <= self.window[-1].step:
            self._emit()  # a rollback replays from an earlier step
        self.window.append(line)
        if line.step % self.every == 0:
            self._emit()

    def close(self) -> None:
        """Emit the partial tail window (the caller flushes the event log)."""
        if self.window:
            self._emit()

    def _emit(self) -> None:
        summary = aggregate(self.window)
        self.window = []
        self.events.emit("train_metrics", step=summary["last_step"],
                         event_id=f"{self.prefix}/{self.seq}",
                         segment=self.segment, attempt=self.attempt, seq=self.seq, **summary)
        self.seq += 1

    def _flush(self) -> None:
        # Metrics must not fail a training step: a failed flush keeps the batch in the
        # EventLog's buffer, and segment_finished's flush retries it and raises if it must.
        try:
            self.events.flush()
        except StorageUnavailable as exc:
            log.warning("train_metrics_flush_deferred", url=exc.url, cause=exc.cause)
        except OSError as exc:
            log.warning("train_metrics_flush_deferred", url=self.events.url, cause=repr(exc))
