"""The operator commands TrainingRun's updates and abort signal take (DESIGN §6): the
client/workflow boundary, shared by the workflow's validators (workflows/operator_handlers.py)
and `mainspring run` (ops/cli_runs.py). Each command is a frozen dataclass that checks its own
fields; `command()` reads one from its JSON input, or raises Refused naming the field.

Stdlib only: the workflow sandbox imports this.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from common.limits import MAX_STEP

# Their input as it arrives: a JSON object, or a bare string (or nothing) as the command's
# note. Temporal decodes it no further; `<Command>.from_json` does (docs/decisions.md).
CommandInput = dict[str, Any] | str | None
MAX_LR_SCALE = 10.0
# A note is a sentence or two for the `operator` event, `explain` and the report; `who` is
# user@host. The bounds keep a pasted log or a binary out of the run's history and events.
MAX_NOTE_CHARS = 1000
MAX_WHO_CHARS = 200


class Refused(ValueError):
    """An operator command that cannot be accepted now; the message says why and what to do."""


def as_object(raw: CommandInput) -> dict[str, Any]:
    """The input as a JSON object: a bare string (or nothing) is the note."""
    return {"note": raw or ""} if raw is None or isinstance(raw, str) else raw


def field_means(means: str) -> Any:
    """A required field; `means` completes "<command>: <field> is required (...)"."""
    return field(metadata={"means": means})


def _require(cmd: Command, ok: bool, name: str, must: str) -> None:
    if not ok:
        raise Refused(f"{cmd.name}: {name} must be {must}, got {getattr(cmd, name)!r}")


def text_problem(value: object, limit: int) -> str | None:
    """Pure: why `value` cannot be a command's `note` or `who` (None: it can): not a
    string, over `limit` characters, or holding a character that is not printable (a
    control character such as ESC or a newline, a bidi override), which would reach every
    terminal that shows the run's events."""
    if not isinstance(value, str):
        return f"a string, not {type(value).__name__}"
    if len(value) > limit:
        return f"at most {limit} characters, not {len(value)}"
    bad = next((ch for ch in value if ch != " " and not ch.isprintable()), None)
    if bad is not None:
        return (f"printable text: it holds the control or format character U+{ord(bad):04X}"
                " (write it on one line, without escape sequences)")
    return None


def tamed_text(value: object, limit: int) -> str:
    """Pure: `value` as text that `text_problem` accepts: every character it refuses
    replaced by '?', cut at `limit`. For a command already admitted read again, and the
    abort signal, which has no validator to refuse it: the run must still stop."""
    text = value if isinstance(value, str) else str(value)
    text = "".join(ch if ch == " " or ch.isprintable() else "?" for ch in text[:limit])
    return text


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, kw_only=True)
class Command:
    """What every operator command has: who sent it and why (its `operator` event). Each
    subclass is one update (or the signal) and checks its own fields in __post_init__."""

    name: ClassVar[str]  # the update's (signal's) name
    who: str = ""
    note: str = ""  # "reason" on the wire too

    def __post_init__(self) -> None:
        for name, limit in (("note", MAX_NOTE_CHARS), ("who", MAX_WHO_CHARS)):
            problem = text_problem(getattr(self, name), limit)
            if problem:  # the value shown ASCII and short: the refusal is printed too
                shown = ascii(getattr(self, name))
                raise Refused(f"{self.name}: {name} (--{name}) must be {problem}; got "
                              f"{shown[:60]}{'…' if len(shown) > 60 else ''}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object the update takes (what `mainspring run` sends)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: CommandInput, *, strict: bool = True) -> Self:
        """The command from its input, or Refused naming the field that is wrong. The
        validators read `strict`ly. Not strict (a command already admitted, read again;
        the abort signal, which has no validator) a field another command takes is
        ignored, as the one untyped parser did: histories from then replay the same."""
        obj = as_object(raw)
        if not isinstance(obj, dict):
            raise Refused(f"{cls.name}: expected a JSON object, got {type(obj).__name__}")
        own = {f.name for f in dataclasses.fields(cls)} | {"reason"}
        if unknown := sorted(set(obj) - (own if strict else ANY_FIELD)):
            raise Refused(f"{cls.name}: unknown field(s) {unknown}; known: {sorted(own)}")
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING and f.name not in obj:
                raise Refused(f"{cls.name}: {f.name} is required ({f.metadata['means']})")
        given = {k: v for k, v in obj.items() if k in own - {"who", "note", "reason"}}
        who, note = str(obj.get("who") or ""), str(obj.get("note") or obj.get("reason") or "")
        if not strict:
            who, note = tamed_text(who, MAX_WHO_CHARS), tamed_text(note, MAX_NOTE_CHARS)
        return cls(who=who, note=note, **given)


@dataclass(frozen=True, kw_only=True)
class Pause(Command):
    name: ClassVar[str] = "pause"


@dataclass(frozen=True, kw_only=True)
class Resume(Command):
    name: ClassVar[str] = "resume"


@dataclass(frozen=True, kw_only=True)
class Abort(Command):
    name: ClassVar[str] = "abort"


@dataclass(frozen=True, kw_only=True)
class Rollback(Command):
    name: ClassVar[str] = "rollback"
    to_step: int = field_means("the step to go back to")
    skip_data: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self, _is_int(self.to_step) and self.to_step >= 0, "to_step", "an integer >= 0")
        _require(self, self.to_step <= MAX_STEP, "to_step", f"at most {MAX_STEP} (MAX_STEP)")
        _require(self, isinstance(self.skip_data, bool), "skip_data", "true or false")


@dataclass(frozen=True, kw_only=True)
class SetLrScale(Command):
    name: ClassVar[str] = "set_lr_scale"
    scale: float = field_means(f"a number in (0, {MAX_LR_SCALE:g}]")
    steps: int = 0  # 0: to the end of the run

    def __post_init__(self) -> None:
        super().__post_init__()
        x = self.scale
        _require(self, isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
               and 0 < x <= MAX_LR_SCALE, "scale", f"a number in (0, {MAX_LR_SCALE:g}]")
        _require(self, _is_int(self.steps) and self.steps >= 0, "steps",
               "an integer >= 0 (0: to the end of the run)")
        _require(self, self.steps <= MAX_STEP, "steps", f"at most {MAX_STEP} (MAX_STEP)")
        object.__setattr__(self, "scale", float(x))


COMMANDS: dict[str, type[Command]] = {
    c.name: c for c in (Pause, Resume, Rollback, SetLrScale, Abort)}
ANY_FIELD = {f.name for c in COMMANDS.values() for f in dataclasses.fields(c)} | {"reason"}


def command(name: str, raw: CommandInput, *, strict: bool = True) -> Command:
    """The typed command `name` from its input (Command.from_json)."""
    if name not in COMMANDS:
        raise Refused(f"unknown command {name!r}; use one of {', '.join(COMMANDS)}")
    return COMMANDS[name].from_json(raw, strict=strict)
