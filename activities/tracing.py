"""An activity attempt's span and log context: `activity_span` opens a span named after
the work (`segment 1200-1500`, `evaluate`), tags it and the structlog context with the run
id and attempt, and binds its trace to the run, so every span of this worker in that trace
is stored with the run's (storage/spans.py). Under Temporal's RunActivity span, which is a
child of the stage that scheduled it (workflows/tracing.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import structlog
from opentelemetry.trace import Span
from temporalio import activity

from common import telemetry
from spec import RunSpec


@contextlib.contextmanager
def activity_span(name: str, spec: RunSpec, **attributes: Any) -> Iterator[Span]:
    attempt = activity.info().attempt
    with telemetry.tracer().start_as_current_span(
            name, attributes={"run_id": spec.run_id, "attempt": attempt, **attributes}) as span, \
            structlog.contextvars.bound_contextvars(run_id=spec.run_id, attempt=attempt):
        telemetry.bind_run(spec.storage.durable, spec.run_id)
        try:
            yield span
        finally:
            telemetry.flush(2000)  # a fault's span and events leave with it
