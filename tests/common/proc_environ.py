"""The environment a child process was really started with, read from /proc."""

from __future__ import annotations

import time


def environ_of(pid: int, within_s: float = 10.0) -> dict[str, str]:
    """`pid`'s environment as exec'd. Popen returns once exec has replaced the child's
    memory, a moment before the kernel records where the new environment lies: until then
    /proc reads it as empty (seen on a loaded 2-core machine), so an empty read is retried."""
    deadline = time.monotonic() + within_s
    while True:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
        if raw or time.monotonic() > deadline:
            return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
        time.sleep(0.01)
