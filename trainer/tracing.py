"""A trainer process's spans (docs/design.md, "Traces"), in the style of NVIDIA's resiliency
extension: named after what they measure, each saying whether its time was productive.

The process joins the run's trace from TRACEPARENT (the supervisor's `segment` span) and
stores its spans with the run's (storage/spans.py), also over OTLP when configured:
- `trainer rank <r>`: the process, from its start (the kernel's, not Python's) to its exit;
- `startup` (interpreter start and imports) and `process_group_init`: badput "startup";
- `restore` (tier, bytes, step): badput "restore";
- `steps <a>-<b>`: a window of steps between two checkpoints, goodput, with each step's
  time (`step_times_s`) and the steps whose update was vetoed (`skipped_steps`);
- `checkpoint stage <step>` (the loop's pause): badput "checkpoint_stall"; the upload is the
  writer process's `upload <step>`, linked to it;
- `rollback` and `online_eval`: badput "rollback" / "evaluation".
Spans end as their work does (windows are backdated to their first step), leave every
2 s from the exporter's thread and are flushed at exit: a SIGKILL loses the open ones
only — the process span among them; `parent_hint` still places its children.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import psutil
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from common import telemetry
from common.protocol import StepLine
from spec import RunSpec


def process_start_ns() -> int:
    """When the kernel started this process (the interpreter's own start-up included)."""
    try:
        return int(psutil.Process().create_time() * 1e9)
    except psutil.Error:
        return time.time_ns()


PROCESS: dict[str, Any] = {}  # run_id, rank, attempt: on every span of this process


def start_process_span(spec: RunSpec, rank: int, attempt: int) -> Span:
    """Configure tracing for this rank and open its process span (current from now on)."""
    PROCESS.update(run_id=spec.run_id, rank=rank, attempt=attempt)
    from storage.spans import DurableSpanExporter

    telemetry.configure("trainer", otlp_endpoint=spec.ops.otlp_endpoint, exporters=[
        DurableSpanExporter(f"trainer-rank{rank}", run=(spec.storage.durable, spec.run_id))])
    telemetry.attach_parent_from_env()
    started = process_start_ns()
    span = telemetry.tracer().start_span(
        f"trainer rank {rank}", start_time=started,
        attributes=dict(PROCESS))
    otel_context.attach(trace.set_span_in_context(span))
    done("startup", started, badput="startup")
    return span


def end_process_span(span: Span, code: int) -> None:
    if code:
        span.set_status(Status(StatusCode.ERROR, f"exit code {code}"))
    span.end()
    telemetry.flush()


def done(name: str, start_ns: int, *, badput: str = "", **attributes: Any) -> None:
    """A span that began at `start_ns` and ends now (backdated)."""
    telemetry.tracer().start_span(name, start_time=start_ns,
                                  attributes=_attributes(badput, attributes)).end()


def _attributes(badput: str, attributes: dict[str, Any]) -> dict[str, Any]:
    return {**PROCESS, "goodput": not badput, **({"badput": badput} if badput else {}),
            **attributes}


@contextlib.contextmanager
def span(name: str, *, badput: str = "", **attributes: Any) -> Iterator[Span]:
    """A span around some work on the training path (productive unless `badput` names why
    not); its events are what the run recorded meanwhile (storage/events.py)."""
    with telemetry.tracer().start_as_current_span(name,
                                                  attributes=_attributes(badput, attributes)) as live:
        yield live


class StepWindows:
    """Step lines grouped into `steps <a>-<b>` spans; `close()` ends the open window (at a
    checkpoint, a rollback, the segment's end). Fed by the progress writer."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lines: list[StepLine] = []

    def add(self, line: StepLine) -> None:
        self.lines.append(line)

    def close(self) -> None:
        lines, self.lines = self.lines, []
        if not lines:
            return
        times = [float(x.step_time_s or 0.0) for x in lines]
        start_ns = int((lines[0].ts - times[0]) * 1e9)
        live = telemetry.tracer().start_span(
            f"steps {lines[0].step}-{lines[-1].step}", start_time=start_ns, attributes={
                **PROCESS, "goodput": True, "rank": self.rank, "first_step": lines[0].step,
                "last_step": lines[-1].step, "step": lines[-1].step, "step_times_s": times,
                "skipped_steps": [x.step for x in lines if x.verdict != "ok"]})
        live.end(end_time=int(lines[-1].ts * 1e9))
