"""Threads that work for the caller: in its context (its span, its structlog fields), so
what they record belongs where the caller is."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

A, B = TypeVar("A"), TypeVar("B")


def in_context(fn: Callable[..., object], *args: object, name: str) -> threading.Thread:
    """Start `fn(*args)` in a daemon thread, in a copy of the caller's context."""
    thread = threading.Thread(target=contextvars.copy_context().run, args=(fn, *args),
                              name=name, daemon=True)
    thread.start()
    return thread


def concurrently(first: Callable[[], A], second: Callable[[], B]) -> tuple[A, B]:
    """Both calls at once (`first` in a thread, in the caller's context); both results, or
    the error of either once both are done."""
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(contextvars.copy_context().run, first)
        value = second()
        return pending.result(), value
