"""common/threads.py: the supervisor's two storage round trips at a segment's end run at
once, and an error of either still fails the attempt."""

from __future__ import annotations

import threading
import time

import pytest

from common.threads import concurrently


def test_both_calls_run_at_once_and_return_their_values_in_order():
    both = threading.Barrier(2, timeout=5)  # neither returns unless the other runs meanwhile

    def one():
        both.wait()
        return "flushed"

    def two():
        both.wait()
        return [0, 10, 20]
    t0 = time.monotonic()
    assert concurrently(one, two) == ("flushed", [0, 10, 20])
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("which", ["first", "second"])
def test_an_error_of_either_call_is_raised_in_the_caller(which):
    def boom():
        raise OSError("storage away")
    calls = (boom, lambda: 1) if which == "first" else (lambda: 1, boom)
    with pytest.raises(OSError, match="storage away"):
        concurrently(*calls)


def test_a_thread_in_context_sees_the_callers_context_variables():
    import contextvars

    from common.threads import in_context
    who = contextvars.ContextVar("who", default="nobody")
    who.set("attempt 2")
    seen = []
    in_context(lambda: seen.append(who.get()), name="unit").join(5)
    assert seen == ["attempt 2"]
