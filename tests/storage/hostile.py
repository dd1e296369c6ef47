"""Hostile store records for the reader tests: JSON text fragments no mainspring writer
produces, and a guard that a call opens nothing outside the store and connects nowhere."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator

from hypothesis import strategies as st

DEEP = 100_000  # nesting that exhausts a recursive decoder or walker
# A fragment is spliced into a record as a field's value, or is the whole record.
FRAGMENTS = [
    "NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e300", "-1", "0", "9" * 5000,
    "1" + "0" * 25, "-" + "9" * 30, "true", "null", '""', '"x"', "[]", "{}", "[1, 2]",
    '"\\u001b[2J\\u001b]0;owned\\u0007"', '"\\u0000\\r\\n"', '"../../../etc/passwd"',
    '"http://169.254.169.254/latest/meta-data"', '"file:///dev/zero"', '"s3://elsewhere/x"',
    "[" * DEEP + "]" * DEEP, '{"a":' * 5000 + "1" + "}" * 5000, '"' + "A" * 70_000 + '"',
]


def fragments() -> st.SearchStrategy[str]:
    """A hostile value as JSON text: a fixed nasty one, or any JSON scalar hypothesis finds."""
    scalars = st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                        st.text(max_size=40), st.booleans(), st.none())
    return st.one_of(st.sampled_from(FRAGMENTS), scalars.map(json.dumps))


def splice(template: dict, key: str | None, fragment: str) -> bytes:
    """`template` as JSON with `key`'s value replaced by the raw `fragment` (None: the
    fragment is the whole record)."""
    if key is None:
        return fragment.encode()
    parts = [f"{json.dumps(k)}: {fragment if k == key else json.dumps(v)}"
             for k, v in template.items()]
    if key not in template:
        parts.append(f"{json.dumps(key)}: {fragment}")
    return ("{" + ", ".join(parts) + "}").encode()


def records(template: dict) -> st.SearchStrategy[bytes]:
    """Hostile versions of `template`: each field (or the record itself) made hostile,
    or raw bytes."""
    keys = st.sampled_from([None, *template])
    return st.one_of(st.builds(splice, st.just(template), keys, fragments()),
                     st.binary(max_size=64))


_watch: list[tuple[str, list[str]]] = []


def _audit(event: str, args: tuple) -> None:
    if not _watch:
        return
    root, seen = _watch[-1]
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if not path.startswith((root, sys.prefix, sys.base_prefix)):  # imports: the venv
            seen.append(path)
    elif event in ("socket.connect", "socket.getaddrinfo", "urllib.Request"):
        seen.append(f"{event} {args[1] if len(args) > 1 else args}")


sys.addaudithook(_audit)  # once per process; it does nothing unless `confined` is active


@contextlib.contextmanager
def confined(root: str, within_s: float) -> Iterator[None]:
    """Fail if the body opens a file outside `root` (or the interpreter's own), reaches for
    the network, or takes longer than `within_s`."""
    seen: list[str] = []
    _watch.append((os.path.abspath(root), seen))
    began = time.monotonic()
    try:
        yield
    finally:
        _watch.pop()
    took = time.monotonic() - began
    assert not seen, f"touched outside the store: {seen[:3]}"
    assert took < within_s, f"took {took:.2f}s"
