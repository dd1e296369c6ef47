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
instruments in `common/metrics.py`) when the worker serves metrics, and so do the faults
and recoveries the supervisor records (`MeteredEventLog`); otherwise that is a no-op.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from activities import nvml
from common.errors import StorageUnavailable
from common.metrics import TrainingInstruments, training_instruments
from common.protocol import CommitLine, EvalLine, ProgressLine, StepLine
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


class RunTally:
    """What this worker has seen of one run, across its segments: the goodput's two terms
    and the fault and recovery events already counted (a `worker_lost` that a later retry
    writes again under the same id counts once).

    Goodput, live: the step time of the steps the model kept (each step number's last
    execution, ops/goodput.py's final trajectory) that were applied (verdict ok), over the
    wall time since this worker began its first segment of the run — start-ups, restarts,
    replays, skips, checkpoint pauses and the gaps between segments are the badput.
    `mainspring goodput RUN` is the whole run's figure from its durable record."""

    KEEP_STEPS = 20_000  # step times that can still be replaced: a replay reaches back a
    # checkpoint interval or a spike window, nowhere near this far

    def __init__(self, since: float) -> None:
        self.since, self.productive = since, 0.0
        self.kept: dict[int, float] = {}
        self.seen: set[str] = set()
        self.lock = threading.Lock()

    def step(self, step: int, seconds: float, applied: bool) -> None:
        with self.lock:
            new = seconds if applied else 0.0
            self.productive += new - self.kept.get(step, 0.0)  # a replay replaces it
            self.kept[step] = new
            if len(self.kept) > 2 * self.KEEP_STEPS:
                self.kept = {k: v for k, v in self.kept.items() if k > step - self.KEEP_STEPS}

    def goodput(self, now: float) -> float | None:
        wall = now - self.since
        return min(1.0, max(0.0, self.productive / wall)) if wall > 0 else None

    def first(self, event_id: str) -> bool:
        """True the first time this event id is seen (then remembered)."""
        with self.lock:
            new = event_id not in self.seen
            self.seen.add(event_id)
            return new


_tallies: dict[str, RunTally] = {}
_tallies_lock = threading.Lock()
MAX_RUNS = 1000  # runs remembered per worker process (oldest dropped)


def tally(run_id: str) -> RunTally:
    with _tallies_lock:
        if run_id not in _tallies:
            while len(_tallies) >= MAX_RUNS:
                _tallies.pop(next(iter(_tallies)))
            _tallies[run_id] = RunTally(time.time())
        return _tallies[run_id]


class LiveMetrics:
    """One run's progress lines and supervisor events as Prometheus updates: a few
    instrument calls per line.

    Gauges hold the last value reported (a null, i.e. non-finite, loss leaves the loss
    gauge at its last finite value; the skip it causes is counted). Counters count what
    the worker ran, rollback replays included, so their rate is the work done; the ones
    every run has (rollbacks, skips, recoveries, checkpoint stall time) start at 0, so a
    run without any shows 0 rather than no data. Callers pass `step`, `commit` and `eval`
    lines (MetricsForwarder does) and events (MeteredEventLog does). NVML's GPU gauges take
    the newest sample (activities/nvml.py) with the step lines, at most every NVML_EVERY_S.
    """

    NVML_EVERY_S = 2.0

    def __init__(self, instruments: TrainingInstruments, run_id: str) -> None:
        self.m, self.attrs = instruments, {"run_id": run_id}
        self.gauges = ((instruments.loss, "loss"), (instruments.learning_rate, "lr"),
                       (instruments.tokens_per_second, "tokens_per_s"), (instruments.mfu, "mfu"),
                       (instruments.peak_memory, "peak_mem_bytes"),
                       (instruments.step_time, "step_time_s"),
                       (instruments.grad_norm, "grad_norm"),
                       (instruments.comm_exposed_time, "comm_exposed_s"),
                       (instruments.comm_exposed_fraction, "comm_exposed_frac"))  # StepLine's
        self.tally = tally(run_id)
        for counter in (instruments.rollbacks, instruments.batches_skipped,
                        instruments.recoveries, instruments.checkpoint_stall_time):
            counter.add(0, self.attrs)
        self.gpus = nvml.shared()
        self.sampled = 0.0  # monotonic time of the last NVML sample

    @classmethod
    def for_run(cls, run_id: str) -> LiveMetrics | None:
        """None when this process serves no metrics endpoint (common/metrics.py)."""
        instruments = training_instruments()
        return cls(instruments, run_id) if instruments else None

    def on_progress(self, line: StepLine | CommitLine | EvalLine) -> None:
        if isinstance(line, CommitLine):
            self.m.checkpoints_committed.add(1, self.attrs)
            if _finite(line.stall_s):
                self.m.checkpoint_stall.set(line.stall_s, self.attrs)
                self.m.checkpoint_stall_time.add(line.stall_s, self.attrs)
            if _finite(line.upload_lag_s):
                self.m.upload_lag.set(line.upload_lag_s, self.attrs)
            return
        if isinstance(line, EvalLine):
            if _finite(line.val_loss):
                self.m.validation_loss.set(line.val_loss, self.attrs)
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
        elif line.verdict == "rollback":
            self.m.rollbacks.add(1, self.attrs)
        for rank, allocated, reserved in line.mem_by_rank or ():
            where = {**self.attrs, "rank": str(rank)}
            self.m.memory_peak_allocated.set(allocated, where)
            self.m.memory_reserved.set(reserved, where)
        if _finite(line.step_time_s):
            self.tally.step(line.step, float(line.step_time_s), line.verdict == "ok")
        if (goodput := self.tally.goodput(time.time())) is not None:
            self.m.goodput.set(goodput, self.attrs)
        self.sample_gpus()

    def on_event(self, event: dict) -> None:
        """A supervisor's event: a real fault (by kind) or a recovery (its MTTR)."""
        kind, p = event["kind"], event["payload"]
        if kind not in ("fault", "recovered") or not self.tally.first(event["event_id"]):
            return
        if kind == "fault" and not p.get("injected"):
            self.m.faults.add(1, {**self.attrs, "kind": str(p.get("kind", "unknown"))})
        elif kind == "recovered":
            self.m.recoveries.add(1, self.attrs)
            if _finite(p.get("mttr_s")):
                self.m.mttr.set(p["mttr_s"], self.attrs)

    def sample_gpus(self) -> None:
        now = time.monotonic()
        if self.gpus is None or now - self.sampled < self.NVML_EVERY_S:
            return
        self.sampled = now
        g = self.m.gpu
        for s in self.gpus.latest():
            at = {**self.attrs, "gpu": s.gpu}
            for gauge, value, extra in (
                    (g.utilization, s.utilization, {}), (g.memory_used, s.memory_used, {}),
                    (g.memory_bandwidth, s.memory_bandwidth, {}), (g.power, s.power_w, {}),
                    (g.temperature, s.temperature_c, {}),
                    (g.pcie, s.pcie_tx, {"direction": "tx"}),
                    (g.pcie, s.pcie_rx, {"direction": "rx"}),
                    (g.ecc_errors, s.ecc_corrected, {"type": "corrected"}),
                    (g.ecc_errors, s.ecc_uncorrected, {"type": "uncorrected"})):
                if _finite(value):
                    gauge.set(value, {**at, **extra})


class MeteredEventLog(EventLog):
    """The supervisor's event log: the faults and recoveries it records also count on this
    worker's Prometheus endpoint (LiveMetrics.on_event). A plain EventLog when the worker
    serves no metrics."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.live = LiveMetrics.for_run(self.run_id)

    def emit(self, kind: str, payload: Mapping[str, Any] | None = None, /,
             **fields: Any) -> dict[str, Any]:
        event = super().emit(kind, payload, **fields)
        if self.live is not None:
            self.live.on_event(event)
        return event


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
        if isinstance(line, EvalLine):
            if self.live:
                self.live.on_progress(line)
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
