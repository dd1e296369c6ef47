"""A trainer worker's drain: SIGTERM to the worker — a Kubernetes pod eviction, a
spot preemption notice — asks each running segment to stop at a committed step; the
activity then fails at once with a retryable `Preempted` error, so the retry starts on
another worker without waiting for a heartbeat timeout. ops/worker.py begins the drain;
activities/launch.py (through the supervisor) and activities/training.py read it."""

from __future__ import annotations

import threading
import time

_DRAINING = threading.Event()
_STATE: dict[str, object] = {}


def begin(reason: str = "worker draining: SIGTERM") -> None:
    """From the worker's signal handler: every running segment stops at its next step."""
    _STATE.update(reason=reason, since=time.time())
    _DRAINING.set()


def draining() -> bool:
    return _DRAINING.is_set()


def reason() -> str:
    """Why the worker drains ('' when it does not): supervise's `draining` callback."""
    return str(_STATE.get("reason", "")) if draining() else ""


def since() -> float | None:
    """When the drain began."""
    return _STATE.get("since") if draining() else None  # type: ignore[return-value]


def reset() -> None:
    """For tests in one process."""
    _DRAINING.clear()
    _STATE.clear()
