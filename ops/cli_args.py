"""Arguments the CLI's subcommands share: a duration flag is held to a documented
minimum the way a RunSpec duration is (spec/codec.py:seconds_problem), so `--poll-s 1e-300`
is a usage error naming the flag, not a loop that reads the event log without pause; and
every command about one recorded run takes the run and the durable store it is read from
(`run_command`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from spec.codec import DAY, seconds_problem


def seconds(lo: float, why: str, hi: float = 7 * DAY) -> Callable[[str], float]:
    """An argparse `type`: seconds in [lo, hi], finite; argparse names the flag."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if problem := seconds_problem(value, lo, hi, why):
            raise argparse.ArgumentTypeError(
                f"{problem}; give at least {lo:g} s (at most {hi:g})")
        return value
    parse.__name__ = "seconds"  # argparse's "invalid seconds value" on an unparsable one
    return parse


DEFAULT_DURABLE = ".mainspring/store"


def run_command(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand `name RUN [--durable URL]`; the caller adds its own flags."""
    p = sub.add_parser(name, help=help)
    p.add_argument("run_id")
    p.add_argument("--durable", default=DEFAULT_DURABLE, help="durable storage URL")
    return p
