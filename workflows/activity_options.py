"""Timeouts and retry policies of the activities the workflows schedule (DESIGN §3).

Deterministic and I/O-free; imported by the workflows inside the sandbox.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio.common import RetryPolicy

from common.errors import NON_RETRYABLE
from spec import RunSpec

RETRYABLE_FOREVER = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                                maximum_interval=timedelta(seconds=30), maximum_attempts=0,
                                non_retryable_error_types=list(NON_RETRYABLE))


# A segment's retry follows a lost worker: the heartbeat timeout has already waited, so the
# first retry goes at once (0.2 s: a recovery counts in seconds). A failure that repeats is
# stopped by the repeat budget (activities/recovery.py), not by this backoff.
SEGMENT_RETRY = RetryPolicy(initial_interval=timedelta(seconds=0.2), backoff_coefficient=2.0,
                            maximum_interval=timedelta(seconds=30), maximum_attempts=0,
                            non_retryable_error_types=list(NON_RETRYABLE))


def segment_options(spec: RunSpec) -> dict:
    """train_segment: unlimited retries bounded by a schedule-to-close budget (DESIGN §3)."""
    return {"schedule_to_close_timeout": timedelta(seconds=spec.ops.segment_budget_s),
            "heartbeat_timeout": timedelta(seconds=spec.ops.heartbeat_timeout_s),
            "retry_policy": SEGMENT_RETRY}


def short_options(spec: RunSpec, hours: float = 6.0) -> dict:
    """Data prep, evaluation, promotion: heartbeating, retried, bounded to `hours`."""
    return {"schedule_to_close_timeout": timedelta(hours=hours),
            "heartbeat_timeout": timedelta(seconds=max(60.0, spec.ops.heartbeat_timeout_s)),
            "retry_policy": RETRYABLE_FOREVER}


def suggest_options() -> dict:
    """suggest_trials (a local activity): pure and deterministic, so a failure is a bug —
    a few attempts, then the sweep fails with it rather than retrying forever."""
    return {"start_to_close_timeout": timedelta(seconds=60),
            "retry_policy": RetryPolicy(maximum_attempts=3,
                                        non_retryable_error_types=list(NON_RETRYABLE))}
