"""JSON -> RunSpec sections: types, finite numbers, documented ranges. Stdlib only.

`build` is the only way JSON becomes a spec section (`RunSpec.from_dict`). It rejects
unknown fields, wrong types (a bool is not an int), non-finite numbers (Python's json
reads `Infinity` and `NaN`) and values outside the range a field declares with `num()`,
before the section's own `__post_init__` sees them — so no check or later use of a value
(`timedelta(seconds=...)`, `2.0 ** x`) can overflow. Every error names the dotted field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import MISSING, field
from typing import Any

from common.errors import BadConfig
from common.limits import MAX_STEP

MAX_STR = 4096  # characters in any string field (paths, URLs, names)
STEPS = MAX_STEP  # the most steps any step count or step field may name (the store's too)
DAY = 86400.0  # seconds, for the bounds of durations


def num(default: Any = MISSING, lo: float = 0, hi: float = 0, words: tuple[str, ...] = (),
        *, lo_open: bool = False, hi_open: bool = False, why: str = "") -> Any:
    """A numeric field (or tuple of numbers) with its documented range [lo, hi], inclusive;
    `lo_open`/`hi_open` make an end exclusive (`lr` is in (0, 10]: a rate of 0 trains
    nothing). Every number the spec takes is bounded here, so no check or later use of a
    value can overflow or run long (tests/spec/test_field_bounds.py walks them all).

    `words`: a number-or-word field (typed `float | str` or `int | str`) and the words it
    also takes (`ops.hang_timeout_s`: "auto" or seconds; `train.checkpoint_every`: "auto"
    or steps). `why`: what a value past the bound would mean, for the refusal.
    """
    return field(default=default, metadata={"range": (lo, hi), "words": words,
                                            "open": (lo_open, hi_open), "why": why})


def seconds(default: Any = MISSING, lo: float = 1.0, hi: float = DAY, why: str = "",
            words: tuple[str, ...] = ()) -> Any:
    """A duration field in seconds: finite, within [lo, hi]. `lo` is its documented sane
    minimum (docs/runspec.md) and `why` says what goes wrong below it - a retry interval of
    1e-300 s is a hot loop, a timeout of 1e-300 s fails whatever it guards at once. Held
    by the JSON reader (check_value) and by the section's __post_init__ (check_seconds)."""
    return field(default=default, metadata={"range": (lo, hi), "words": words,
                                            "seconds": why or "a smaller value is no duration"})


def seconds_minimum(f: dataclasses.Field) -> float | None:
    """The documented minimum of a seconds() field; None for any other field."""
    return f.metadata["range"][0] if "seconds" in f.metadata else None


def seconds_problem(value: object, lo: float, hi: float, why: str) -> str | None:
    """Pure: why `value` is not a duration in [lo, hi] (None: it is)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number of seconds, got {_short(value)}"
    if not math.isfinite(value):
        return f"must be a finite number of seconds, got {value!r}"
    if value < lo:
        return f"must be at least {lo:g} s ({why}), got {value!r}"
    if value > hi:
        return f"must be at most {hi:g} s, got {value!r}"
    return None


def _seconds_fix(name: str, lo: float, hi: float, words: tuple[str, ...]) -> str:
    either = "".join(f"{w!r} or " for w in words)
    return f"set {name} to {either}a positive number of seconds between {lo:g} and {hi:g}"


def check_seconds(obj: Any) -> None:
    """For a section's __post_init__: every seconds() field of `obj` (a word it takes,
    such as "auto", passes), so a section built in code meets the same minimum."""
    for f in dataclasses.fields(obj):
        if "seconds" in f.metadata and (value := getattr(obj, f.name)) not in f.metadata["words"]:
            _check_seconds(f, value, f.name)


def _check_seconds(f: dataclasses.Field, value: object, name: str) -> None:
    (lo, hi), words = f.metadata["range"], f.metadata["words"]
    problem = seconds_problem(value, lo, hi, f.metadata["seconds"])
    require(problem is None, name, problem or "", _seconds_fix(name, lo, hi, words))


def require(ok: bool, name: str, problem: str, fix: str) -> None:
    if not ok:
        raise BadConfig(name, problem, fix)


def positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value > 0, name, f"must be > 0, got {value!r}", f"set {name} to a positive number")


def value_range(f: dataclasses.Field) -> tuple[float, float] | None:
    return f.metadata.get("range")


def range_text(f: dataclasses.Field) -> str:
    """A field's documented range as an interval, "(0, 10]"."""
    (lo, hi), (lo_open, hi_open) = f.metadata["range"], f.metadata.get("open", (False, False))
    return f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def in_range(f: dataclasses.Field, v: float) -> bool:
    """Pure: whether the number `v` lies in the field's documented range."""
    (lo, hi), (lo_open, hi_open) = f.metadata["range"], f.metadata.get("open", (False, False))
    return (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)


def control_char(text: str) -> int:
    """Index of the first control character (C0, DEL, C1) in `text`, or -1."""
    return next((i for i, ch in enumerate(text) if ord(ch) < 32 or 0x7F <= ord(ch) < 0xA0), -1)


def check_value(f: dataclasses.Field, value: Any, name: str) -> None:
    """The declared range of numbers and the length/character rules of strings."""
    rng, words = value_range(f), f.metadata.get("words")
    for v in value if isinstance(value, tuple) else (value,):
        if isinstance(v, str) and words and v not in words:
            lo, hi = rng or (0, 0)
            raise BadConfig(name, f"must be {' or '.join(map(repr, words))} or a number, got "
                            f"{_short(v)}", f"use {' or '.join(map(repr, words))}, or a number "
                            f"between {lo} and {hi}")
        if isinstance(v, str):
            _check_str(v, name)
        elif "seconds" in f.metadata:
            _check_seconds(f, v, name)
        elif rng and isinstance(v, (int, float)) and not isinstance(v, bool) \
                and not in_range(f, v):
            raise BadConfig(name, range_problem(f, v), range_fix(f))


def range_problem(f: dataclasses.Field, v: float) -> str:
    """Pure: why the number `v` is outside the field's documented range."""
    why = f" ({f.metadata['why']})" if f.metadata.get("why") else ""
    return f"must be in {range_text(f)}{why}, got {_short(v)}"


def range_fix(f: dataclasses.Field) -> str:
    (lo, hi), ends = f.metadata["range"], f.metadata.get("open", (False, False))
    return f"use a value between {lo} and {hi}" if not any(ends) else \
        f"use a value in {range_text(f)}"


def _check_str(text: str, name: str) -> None:
    if len(text) > MAX_STR:
        raise BadConfig(name, f"is {len(text)} characters long (at most {MAX_STR})",
                        "shorten it")
    at = control_char(text)
    if at >= 0:
        raise BadConfig(name, f"contains the control character {text[at]!r} at position {at}",
                        "remove it (newlines, tabs and NULs are not allowed here)")


def build(tp: Any, raw: Any, path: str) -> Any:
    """Turn JSON-ish `raw` into type `tp`, naming `path` in every error."""
    name = path or "spec"
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build_section(tp, raw, path)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(raw, (list, tuple)):
            raise BadConfig(name, f"expected a list, got {type(raw).__name__}", "write a JSON list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(build(args[0], v, f"{name}[{i}]") for i, v in enumerate(raw))
        if len(raw) != len(args):
            raise BadConfig(name, f"expected {len(args)} items, got {len(raw)}",
                            f"give exactly {len(args)} values")
        return tuple(build(a, v, f"{name}[{i}]") for i, (a, v) in enumerate(zip(args, raw)))
    if origin is dict:
        _, vt = typing.get_args(tp)
        if not isinstance(raw, dict):
            raise BadConfig(name, f"expected an object, got {type(raw).__name__}",
                            "write it as a JSON object")
        for k in raw:
            _check_str(k, name)  # a key (JSON keys are strings)
        return {k: build(vt, v, f"{name}.{k}") for k, v in raw.items()}
    if origin in (typing.Union, types.UnionType):
        number = set(typing.get_args(tp)) - {str}
        if len(number) == 1 and number <= {float, int}:  # a number or a word (num(words=))
            if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
                raise BadConfig(name, f"expected a number or a word, got {_short(raw)}",
                                "write a number, or a word this field takes (docs/runspec.md)")
            return build(str if isinstance(raw, str) else number.pop(), raw, path)
        section = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if len(section) == 1 and set(typing.get_args(tp)) == {str, section[0]}:
            # a word or an object (train.layout: "dp" | {"tp": .., "pp": .., "zero": ..})
            if isinstance(raw, str):
                return raw
            if isinstance(raw, dict):
                return _build_section(section[0], raw, path)
            raise BadConfig(name, f"expected a word or an object, got {_short(raw)}",
                            "write a word this field takes or a JSON object (docs/runspec.md)")
        raise BadConfig(name, "unsupported union type", "report this as a bug")
    if tp is float:
        return _float(raw, name)
    if tp in (int, bool, str):
        if type(raw) is not tp:
            raise BadConfig(name, f"expected {tp.__name__}, got {_short(raw)}",
                            f"write a JSON {'boolean' if tp is bool else tp.__name__}")
        return raw
    raise BadConfig(name, f"unsupported type {tp!r}", "report this as a bug")


def _build_section(tp: Any, raw: Any, path: str) -> Any:
    name = path or "spec"
    if not isinstance(raw, dict):
        raise BadConfig(name, f"expected an object, got {type(raw).__name__}",
                        "write it as a JSON object")
    prefix = f"{path}." if path else ""
    hints, fields = _schema(tp)
    retired = getattr(tp, "RETIRED", {})  # removed fields: accepted, ignored
    raw = {k: v for k, v in raw.items() if k not in retired}
    unknown = sorted((k for k in raw if k not in fields), key=str)
    if unknown:
        raise BadConfig(f"{prefix}{unknown[0]}", "unknown field",
                        f"remove it; known fields here: {', '.join(sorted(fields))}")
    kwargs = {}
    for k, v in raw.items():
        kwargs[k] = build(hints[k], v, f"{prefix}{k}")
        check_value(fields[k], kwargs[k], f"{prefix}{k}")
    try:
        return tp(**kwargs)
    except BadConfig as exc:  # the section's own check: prefix its field with the path
        raise BadConfig(f"{prefix}{exc.field}", exc.problem, exc.fix) from None
    except TypeError as exc:  # a required field is missing
        raise BadConfig(name, str(exc), "add the missing field") from None


@functools.cache
def _schema(tp: Any) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A section's resolved type hints and init fields (resolving hints is the slow part).

    The hints resolve in the section's own module namespace, taken from its __post_init__:
    inside the workflow sandbox `sys.modules` lacks the modules a passed-through module
    imported (spec.data, spec.model, … one per section), which is where get_type_hints
    would look by default.
    """
    post_init = getattr(tp, "__post_init__", None)
    namespace = getattr(post_init, "__globals__", None)
    return (typing.get_type_hints(tp, globalns=namespace),
            {f.name: f for f in dataclasses.fields(tp) if f.init})


def _float(raw: Any, name: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise BadConfig(name, f"expected a number, got {_short(raw)}", "write a number")
    try:
        value = float(raw)
    except OverflowError:  # an int beyond any float
        raise BadConfig(name, f"{_short(raw)} is too large", "write a smaller number") from None
    if not math.isfinite(value):
        raise BadConfig(name, f"must be a finite number, got {value!r}",
                        "write a finite number (Infinity and NaN are not accepted)")
    return value


def _short(raw: Any) -> str:
    text = repr(raw)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def dotted_to_nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "space":
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
