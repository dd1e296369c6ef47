"""Reading gently beside training: a rate-limited stream, a store whose reads go through
it, and a thread of its own at low priority (the checkpoint scrub, storage/scrub.py).

Under Linux's autogroup a process in another session gets a full CPU share against the
trainer whatever its niceness, so the rate ceiling is what keeps such a reader off the
training cores; the niceness helps where both share a session.
"""

from __future__ import annotations

import contextvars
import copy
import os
import threading
import time
from collections.abc import Callable

import structlog

from storage.checkpoints import CheckpointStore

log = structlog.get_logger(__name__)

SLICE = 1 << 20  # read size under a rate limit: a sleep per MiB keeps the rate smooth


class Throttled:
    """A read-only stream that delivers at most `bytes_per_s` (0: as fast as it can): each
    slice is followed by a sleep that stretches it to its share of time, so time lost to a
    stall (a slow store, a stopped process) is never made up in a burst beside training;
    `counter` (if given) adds up the bytes read, `on_read` is called after each slice."""

    def __init__(self, stream, bytes_per_s: float, counter: list[int] | None = None,
                 on_read: Callable[[], object] | None = None) -> None:
        self._stream, self._rate, self._counter = stream, bytes_per_s, counter
        self._on_read = on_read

    def read(self, n: int = -1) -> bytes:
        began = time.monotonic()
        if self._rate > 0:
            n = SLICE if n is None or n < 0 else min(n, SLICE)
        chunk = self._stream.read(n)
        if self._counter is not None:
            self._counter[0] += len(chunk)
        if self._on_read is not None:
            self._on_read()
        if self._rate > 0 and (rest := len(chunk) / self._rate
                               - (time.monotonic() - began)) > 0:
            time.sleep(rest)
        return chunk

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> Throttled:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SlowReads:
    """A filesystem whose opens for reading are Throttled; everything else is the real one.
    It lets the scrub run `CheckpointStore.verify` itself rather than a copy of its loop."""

    def __init__(self, fs, bytes_per_s: float, counter: list[int],
                 on_read: Callable[[], object] | None) -> None:
        self._fs, self._rate, self._counter, self._on_read = fs, bytes_per_s, counter, on_read

    def open(self, path: str, mode: str = "rb", **kwargs):
        f = self._fs.open(path, mode, **kwargs)
        return Throttled(f, self._rate, self._counter, self._on_read) if "r" in mode else f

    def __getattr__(self, name: str):
        return getattr(self._fs, name)


def slow_view(store: CheckpointStore, bytes_per_s: float, counter: list[int],
              on_read: Callable[[], object] | None = None) -> CheckpointStore:
    view = copy.copy(store)
    view.fs = SlowReads(store.fs, bytes_per_s, counter, on_read)
    return view


def on_low_priority_thread(fn: Callable[[], object], nice: int) -> object:
    """`fn()` on a thread of its own at `nice` (Linux nices threads one by one; a pool thread
    could not be given its priority back), with this context (structlog, heartbeats)."""
    box: dict[str, object] = {}

    def body() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (OSError, AttributeError) as exc:
            log.info("scrub_priority_unchanged", error=repr(exc)[:120])
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=contextvars.copy_context().run, args=(body,),
                              name="checkpoint-scrub", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")
