"""Error classification at the activity boundary (DESIGN §3).

A `MainspringError` becomes a Temporal `ApplicationError` whose `type` is the class name
(`BadConfig`, `BadData`, `HardwareFault`, ...) and whose retryability is the class's.
Retry policies list `NON_RETRYABLE` so a bad spec or corpus fails at once.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import structlog
from temporalio.exceptions import ApplicationError

from ops.errors import NON_RETRYABLE, MainspringError

log = structlog.get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["NON_RETRYABLE", "classified", "to_application_error"]


def to_application_error(exc: MainspringError) -> ApplicationError:
    details = {k: v for k, v in vars(exc).items() if isinstance(v, (str, int, float, type(None)))}
    return ApplicationError(str(exc), details, type=exc.kind, non_retryable=not exc.retryable)


def classified(fn: F) -> F:
    """Decorator: log and translate MainspringError into a typed ApplicationError."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MainspringError as exc:
            log.error("activity_failed", activity=fn.__name__, kind=exc.kind, error=str(exc),
                      retryable=exc.retryable)
            raise to_application_error(exc) from exc

    return wrapper  # type: ignore[return-value]
