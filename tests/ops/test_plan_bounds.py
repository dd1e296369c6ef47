"""Every numeric `mainspring plan` flag has a documented bound (ops/plan_facts.py BOUNDS): at
the bound the plan is made, one past it (and at 1e300, inf, nan) the flag is refused, exit
2 naming it, and each answer comes within a second."""

from __future__ import annotations

import math
import time

import pytest

from ops.cli import build_parser
from ops.cli import main as cli
from ops.plan_facts import BOUNDS

SECOND = 1.0
BASE = {"--params": "7e9", "--tokens": "2e12", "--accelerators": "64", "--accelerator": "h100",
        "--hour-price": "2"}
# What else a flag's bound needs to make a plan (the others at BASE)
CONTEXT = {
    # a sequence for each accelerator, and failures rarer than every 18 s
    "--accelerators": {"--batch-tokens": str(2**36), "--mtbf-hours": "1e9"},
    "--batch-tokens": {"--accelerators": "1", "--seq-len": "1"},
    "--seq-len": {"--batch-tokens": str(2**36)},
    "--mtbf-hours": {"--goodput": "0.5"},  # failures every 0.06 s: no progress, modelled
    "--tp": {"--layout": "dp", "--accelerators": "1024"},
    "--pp": {"--layout": "dp", "--accelerators": "1024"},
    "--cores": {"--accelerator": "cpu"},
    "--api-price-in": {"--api-tokens-per-month": "5e9"},
    "--api-price-out": {"--api-tokens-per-month": "5e9", "--api-output-share": "1"},
    "--api-tokens-per-month": {"--api-price-in": "1"},
    "--api-output-share": {"--api-tokens-per-month": "5e9", "--api-price-in": "1",
                           "--api-price-out": "1"},
}
NOT_NUMBERS = {"--accelerator", "--layout", "--from-run", "--store", "--mfu-from-run",
               "--mfu-from-throughput", "--json", "--help"}


def _plan(capsys, flag: str, value: str) -> tuple[int, str, float]:
    args = {**BASE, **CONTEXT.get(flag, {}), flag: value}
    start = time.monotonic()
    code = cli(["plan", *[f"{k}={v}" for k, v in args.items()]])  # "=": "-1" is a value
    took = time.monotonic() - start
    return code, capsys.readouterr().err, took


def _ends(flag: str) -> list[tuple[str, bool]]:
    b = BOUNDS[flag]
    if b.whole:
        return [(str(int(b.lo)), True), (str(int(b.hi)), True), (str(int(b.lo) - 1), False),
                (str(int(b.hi) + 1), False)]
    return [(repr(float(b.lo)), True), (repr(float(b.hi)), True),
            (repr(math.nextafter(b.lo, -math.inf)), False),
            (repr(math.nextafter(b.hi, math.inf)), False)]


def test_every_numeric_flag_of_plan_has_a_documented_bound():
    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    flags = {s for a in plan._actions for s in a.option_strings if s.startswith("--")}
    numeric = flags - NOT_NUMBERS - {"--durable"}
    assert numeric == set(BOUNDS)


@pytest.mark.parametrize("flag", sorted(BOUNDS))
def test_each_flag_is_planned_at_its_bound_and_refused_past_it_naming_it(capsys, flag):
    for value, accepted in _ends(flag):
        code, err, took = _plan(capsys, flag, value)
        assert took < SECOND, (flag, value, took)
        if accepted:
            assert code == 0, (flag, value, err)
        else:
            assert code == 2 and f"bad config: {flag}" in err, (flag, value, err)


@pytest.mark.parametrize("flag", sorted(BOUNDS))
def test_absurd_numbers_are_refused_naming_the_flag(capsys, flag):
    for value in ("1e300", "-1e300", "inf", "nan", "1e15000"):
        code, err, took = _plan(capsys, flag, value)
        assert took < SECOND and code == 2 and f"bad config: {flag}" in err, (flag, value, err)


@pytest.mark.parametrize("args, flag", [
    (["--layers", "1e12"], "--layers"),
    (["--batch-tokens", "1e15", "--seq-len", "1"], "--batch-tokens"),
    (["--params", "1e300"], "--params"),
    (["--checkpoint-s", "1e300"], "--checkpoint-s")])
def test_the_plans_that_hung_or_overflowed_are_refused_within_a_second(capsys, args, flag):
    base = [x for kv in BASE.items() for x in kv if kv[0] != args[0]]
    start = time.monotonic()
    assert cli(["plan", *base, *args]) == 2
    assert time.monotonic() - start < SECOND
    assert f"bad config: {flag}" in capsys.readouterr().err


def test_more_accelerators_than_sequences_names_the_batch_flag_not_the_planners_input(capsys):
    assert cli(["plan", *[x for kv in BASE.items() for x in kv], "--accelerators", "2048"]) == 2
    err = capsys.readouterr().err
    assert "bad config: --batch-tokens" in err and "--accelerators" in err
