"""One reader for JSON that comes back from the store. Stdlib only.

The bucket is data, not code, and not trusted to be well-formed (docs/security.md): whoever
can write to it can put a 1 GB record, a list nested 100,000 deep (RecursionError in the
decoder or in whatever walks the result), `Infinity` or `1e999` (an OverflowError the first
time it meets `int()`), a number of 5,000 digits (ValueError in `int()`), or a string where a
step belongs. Every reader of a store record goes through `load_record` (one document) or
`load_line` (one line of a JSON-lines file), and takes its fields with `field_int`,
`field_float`, `field_str`: each failure is one exception, `StoreRecordInvalid`, a
ValueError, so the callers' existing `except ValueError` paths (a corrupt record: skipped,
logged, or the reader's own corruption error) apply, and nothing else escapes.
"""

from __future__ import annotations

import json
import math
from typing import Any

# A record's size: lineage records, pins, RUN.json, scrub records and manifests are a few
# kB; an event line under 64 kB. 16 MiB is far above any record mainspring writes and far
# below what would hurt a worker or a laptop running `mainspring report`.
MAX_RECORD_BYTES = 16 * 1024 * 1024
MAX_LINE_BYTES = 1024 * 1024
# Nesting: mainspring's deepest record (an event's payload holding a span's attributes) is
# under 8 levels; 32 leaves room and keeps every recursive walk far from Python's limit.
MAX_DEPTH = 32
# Integers: a step, a byte count or a nanosecond time fits in 63 bits; anything longer is
# not a quantity mainspring wrote (and int() of 5,000 digits raises ValueError).
MAX_INT_DIGITS = 19


class StoreRecordInvalid(ValueError):
    """A store record that is not what mainspring writes. `what` names the record (a path or
    a field), `problem` says how it fails."""

    def __init__(self, what: str, problem: str) -> None:
        self.what, self.problem = what, problem
        super().__init__(f"{what}: {problem}")


def _reject_constant(name: str) -> Any:
    raise StoreRecordInvalid("number", f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise StoreRecordInvalid("number", f"{text[:40]} is not a finite number")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise StoreRecordInvalid("number", f"an integer of {len(text)} digits")
    return int(text)


def _depth_over(value: Any, limit: int) -> bool:
    """Whether `value` nests deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        # only containers go on the stack: most children are numbers and strings
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False


def too_deep(value: Any, max_depth: int = MAX_DEPTH) -> bool:
    """Whether a value already decoded (by a reader that does not use `load_record`, or
    handed on in memory) nests deeper than `max_depth`: walking it, printing it or
    encoding it again could exhaust the recursion limit."""
    return _depth_over(value, max_depth)


def _null_constant(name: str) -> None:
    return None


def _finite_or_null(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


_INT_BOUND = 10**MAX_INT_DIGITS


def _numbers_plain(value: Any) -> bool:
    """Whether every number in a decoded value is one the hooks of `_decode` return as the
    plain decoder does: finite floats, integers of at most MAX_INT_DIGITS digits. A walk
    of the value once costs a tenth of a hook call per number (a 30-day event log holds
    ~940k numbers). Iterative; the depth is bounded after decoding."""
    stack = [value]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            node = node.values()
        elif type(node) is not list:
            node = (node,)
        for v in node:
            kind = type(v)
            if kind is float:
                if v - v != 0.0:  # inf - inf and nan - nan are nan
                    return False
            elif kind is int:
                if not -_INT_BOUND < v < _INT_BOUND:
                    return False
            elif kind is dict or kind is list:
                stack.append(v)
    return True


def _decode(raw: bytes | str, what: str, max_bytes: int, max_depth: int,
            nonfinite_null: bool = False) -> Any:
    if len(raw) > max_bytes:
        raise StoreRecordInvalid(what, f"{len(raw)} bytes, over the {max_bytes}-byte bound")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise StoreRecordInvalid(what, f"not UTF-8 ({exc.reason})") from None
    try:
        # the common case in one C call; a number out of bounds anywhere in it (rare: no
        # writer of ours puts one) and the hooks decide, as they always did
        value = json.loads(raw)
        if not _numbers_plain(value):
            value = json.loads(raw, parse_int=_bounded_int,
                               parse_constant=_null_constant if nonfinite_null
                               else _reject_constant,
                               parse_float=_finite_or_null if nonfinite_null else _finite_float)
    except StoreRecordInvalid as exc:
        raise StoreRecordInvalid(what, exc.problem) from None
    except RecursionError:
        raise StoreRecordInvalid(what, "nested too deeply to decode") from None
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise StoreRecordInvalid(what, f"not JSON ({str(exc)[:120]})") from None
    # the count of brackets bounds the depth: only a record with many pays for the walk
    if (raw.count("[") + raw.count("{") > max_depth) and _depth_over(value, max_depth):
        raise StoreRecordInvalid(what, f"nested deeper than {max_depth} levels")
    return value


def load_record(raw: bytes | str, what: str, *, max_bytes: int = MAX_RECORD_BYTES,
                max_depth: int = MAX_DEPTH, expect: type | None = dict,
                nonfinite_null: bool = False) -> Any:
    """One JSON document from the store: bounded in size and depth, finite numbers only,
    integers of at most 19 digits, and (by default) an object. StoreRecordInvalid
    otherwise. `nonfinite_null`: read NaN, Infinity and 1e999 as null instead of refusing
    the record, for records whose writer measures (a diverged trial's loss is NaN: its
    event is still the record of that trial)."""
    value = _decode(raw, what, max_bytes, max_depth, nonfinite_null)
    if expect is not None and not isinstance(value, expect):
        raise StoreRecordInvalid(what, f"a JSON {type(value).__name__}, not an "
                                       f"{'object' if expect is dict else expect.__name__}")
    return value


def load_line(raw: bytes | str, what: str, *, max_bytes: int = MAX_LINE_BYTES,
              max_depth: int = MAX_DEPTH, nonfinite_null: bool = False) -> dict[str, Any]:
    """One line of a JSON-lines record (events, spans, quarantine): an object, bounded as
    `load_record` with a smaller size bound."""
    return load_record(raw, what, max_bytes=max_bytes, max_depth=max_depth, expect=dict,
                       nonfinite_null=nonfinite_null)


def field_int(record: dict[str, Any], key: str, what: str, *, low: int = 0,
              high: int = 2**63 - 1, default: int | None = None) -> int:
    """`record[key]` as an int in [low, high] (bool is not an int here; a float with no
    fraction is accepted, as JSON writers produce them). StoreRecordInvalid otherwise."""
    value = record.get(key, default) if isinstance(record, dict) else None
    if value is None and default is not None:
        value = default
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise StoreRecordInvalid(f"{what}.{key}", f"{_shown(value)} is not a whole number")
    if not low <= value <= high:
        raise StoreRecordInvalid(f"{what}.{key}", f"{value} is outside [{low}, {high}]")
    return value


def field_float(record: dict[str, Any], key: str, what: str, *, low: float = -math.inf,
                high: float = math.inf, default: float | None = None) -> float:
    """`record[key]` as a finite float in [low, high]. StoreRecordInvalid otherwise."""
    value = record.get(key, default) if isinstance(record, dict) else None
    if value is None and default is not None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StoreRecordInvalid(f"{what}.{key}", f"{_shown(value)} is not a number")
    try:
        value = float(value)
    except OverflowError:
        raise StoreRecordInvalid(f"{what}.{key}", "a number too large for a float") from None
    if not (math.isfinite(value) and low <= value <= high):
        raise StoreRecordInvalid(f"{what}.{key}", f"{value!r} is outside [{low}, {high}]")
    return value


def field_str(record: dict[str, Any], key: str, what: str, *, max_len: int = 4096,
              default: str | None = None) -> str:
    """`record[key]` as a str of at most `max_len` characters. StoreRecordInvalid
    otherwise."""
    value = record.get(key, default) if isinstance(record, dict) else None
    if value is None and default is not None:
        value = default
    if not isinstance(value, str):
        raise StoreRecordInvalid(f"{what}.{key}", f"{_shown(value)} is not a string")
    if len(value) > max_len:
        raise StoreRecordInvalid(f"{what}.{key}", f"{len(value)} characters, over {max_len}")
    return value


def _shown(value: Any) -> str:
    """A value named in a message: its type, and a short, printable piece of it."""
    text = repr(value)
    return f"{type(value).__name__} {text[:40]!s}".encode("ascii", "backslashreplace").decode()
