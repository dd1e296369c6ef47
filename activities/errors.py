"""Error classification at the activity boundary (DESIGN §3).

Every failure leaving an activity is scrubbed of secrets (common/redact.py) here: Temporal
keeps it in the run's history, which anyone with access to the namespace can read.

A `MainspringError` becomes a Temporal `ApplicationError` whose `type` is the class name
(`BadConfig`, `BadData`, `HardwareFault`, ...) and whose retryability is the class's.
Retry policies list `NON_RETRYABLE` so a bad spec or corpus fails at once.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import structlog
from temporalio.exceptions import ApplicationError, TemporalError

from common.errors import NON_RETRYABLE, MainspringError
from common.faults import Fault
from common.redact import redact, redact_value

log = structlog.get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
E = TypeVar("E", bound=MainspringError)

__all__ = ["NON_RETRYABLE", "classified", "to_application_error", "with_fault"]


def with_fault(exc: E, fault: Fault) -> E:
    """`exc`, carrying the fault it is about to the workflow's decision: its
    ApplicationError details hold the record (`fault`, Fault.to_json) beside the error's own
    fields (which older workflow code reads)."""
    exc.fault = fault  # type: ignore[attr-defined]
    return exc


def to_application_error(exc: MainspringError) -> ApplicationError:
    """The failure Temporal records (and keeps in the run's history): message and details
    scrubbed of secrets — a child's log tail or a storage URL can quote one."""
    details = {k: v for k, v in vars(exc).items() if isinstance(v, (str, int, float, type(None)))}
    fault = vars(exc).get("fault")
    if isinstance(fault, Fault):
        details["fault"] = fault.to_json()
    return ApplicationError(redact(str(exc)), redact_value(details), type=exc.kind,
                            non_retryable=not exc.retryable)


def classified(fn: F) -> F:
    """Decorator: log and translate MainspringError into a typed ApplicationError."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MainspringError as exc:
            log.error("activity_failed", activity=fn.__name__, kind=exc.kind, error=str(exc),
                      retryable=exc.retryable)
            # `from None`: Temporal would record the cause's own, unscrubbed message too;
            # the frames stay (with_traceback) and the log line above names the original.
            raise to_application_error(exc).with_traceback(exc.__traceback__) from None
        except TemporalError:
            raise  # cancellation, or an ApplicationError already classified at its source
        except Exception as exc:  # noqa: BLE001 - re-raised, scrubbed, never swallowed
            # A bug or an unclassified library error keeps Temporal's default treatment
            # (retryable, type = class name); only its message is scrubbed on the way.
            log.error("activity_crashed", activity=fn.__name__, kind=type(exc).__name__,
                      error=str(exc))
            raise ApplicationError(redact(str(exc)), type=type(exc).__name__).with_traceback(
                exc.__traceback__) from None

    return wrapper  # type: ignore[return-value]
