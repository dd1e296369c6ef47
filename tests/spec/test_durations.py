"""Every duration a run or a command takes has a documented sane minimum (spec/codec.py:
seconds). A retry interval of 1e-300 s is a hot loop against a store that is down, a
timeout of 1e-300 s fails at once whatever it guards; both were accepted as "> 0". The
minimum is declared once on the field; the spec's JSON reader, a section built in code
and docs/runspec.md all hold the same number."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from common.errors import BadConfig
from ops.cli import build_parser
from spec import OpsConfig, RunSpec, StorageConfig
from spec.codec import seconds_minimum

DOCS = Path(__file__).resolve().parents[2] / "docs" / "runspec.md"

# (dotted field, its minimum in seconds): what docs/runspec.md promises
MINIMA = [
    ("storage.upload_retry_s", 0.1), ("storage.upload_retry_max_s", 0.1),
    ("storage.drain_timeout_s", 10.0), ("ops.heartbeat_timeout_s", 1.0),
    ("ops.hang_timeout_s", 1.0), ("ops.hang_floor_s", 1.0), ("ops.startup_timeout_s", 1.0),
    ("ops.startup_floor_s", 1.0), ("ops.stop_grace_s", 1.0), ("ops.segment_budget_s", 1.0),
    ("ops.mtbf_s", 1.0),
]


def spec_with(dotted: str, value: object) -> dict:
    section, name = dotted.split(".")
    return {"run_id": "r", section: {name: value}}


def refusal(raw: dict) -> BadConfig:
    with pytest.raises(BadConfig) as err:
        RunSpec.from_dict(raw)
    return err.value


@pytest.mark.parametrize("field, minimum", MINIMA)
@pytest.mark.parametrize("scale", [1e-300, 0.5])
def test_a_duration_below_its_minimum_is_refused_naming_the_field_the_minimum_and_the_fix(
        field, minimum, scale):
    err = refusal(spec_with(field, minimum * scale))
    assert err.field == field
    assert f"at least {minimum:g} s" in err.problem, err.problem
    assert field in err.fix and f"{minimum:g}" in err.fix, err.fix


@pytest.mark.parametrize("field, minimum", MINIMA)
def test_a_duration_at_its_minimum_is_taken(field, minimum):
    section, name = field.split(".")
    raw = spec_with(field, minimum)
    if name == "upload_retry_max_s":  # the ceiling may not sit below the first backoff
        raw["storage"]["upload_retry_s"] = minimum
    assert getattr(getattr(RunSpec.from_dict(raw), section), name) == minimum


@pytest.mark.parametrize("section, field", [
    (StorageConfig, "upload_retry_s"), (StorageConfig, "drain_timeout_s"),
    (OpsConfig, "hang_timeout_s"), (OpsConfig, "stop_grace_s")])
def test_a_section_built_in_code_holds_its_durations_to_the_same_minimum(section, field):
    with pytest.raises(BadConfig) as err:
        section(**{field: 1e-300})
    assert err.value.field == field and "at least" in err.value.problem


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_section_built_in_code_refuses_a_duration_that_is_not_finite(value):
    with pytest.raises(BadConfig) as err:
        OpsConfig(stop_grace_s=value)
    assert err.value.field == "stop_grace_s" and "finite" in err.value.problem


def durations() -> list[tuple[str, dataclasses.Field]]:
    """Every field of the spec measured in seconds (`_s`; `_per_s` is a rate)."""
    found, todo = [], [("", RunSpec)]
    while todo:
        prefix, cls = todo.pop()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                todo.append((f"{prefix}{f.name}.", tp))
            elif f.name.endswith("_s") and not f.name.endswith("_per_s"):
                found.append((f"{prefix}{f.name}", f))
    return found


def documented_range(dotted: str) -> str:
    section, name = dotted.rsplit(".", 1)
    text = DOCS.read_text()
    table = text[text.index(f"## `{section}`"):]
    row = re.search(rf"^\| `{name}` \|.*\| ([^|]*) \|$", table, re.MULTILINE)
    assert row, f"docs/runspec.md has no row for {dotted}"
    return row.group(1)


def test_every_duration_in_the_spec_declares_its_minimum_and_the_docs_state_it():
    found = durations()
    assert {name for name, _ in found} >= {name for name, _ in MINIMA}
    for name, f in found:
        minimum = seconds_minimum(f)
        assert minimum is not None, f"{name}: declare it with spec.codec.seconds()"
        assert f"≥ {minimum:g} s" in documented_range(name), (name, documented_range(name))


@pytest.mark.parametrize("argv, flag, minimum", [
    (["worker", "--role", "all", "--drain-timeout-s", "1e-300"], "--drain-timeout-s", 1.0),
    (["events", "r", "--follow", "--poll-s", "1e-300"], "--poll-s", 0.1),
    (["events", "r", "--follow", "--poll-s", "nan"], "--poll-s", 0.1),
])
def test_a_command_line_duration_below_its_minimum_is_a_usage_error_naming_it(
        argv, flag, minimum, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and flag in err and f"at least {minimum:g} s" in err, err


def test_a_command_line_duration_at_its_minimum_is_taken():
    args = build_parser().parse_args(["events", "r", "--follow", "--poll-s", "0.1"])
    assert args.poll_s == 0.1
