"""`mainspring events RUN [--kind K]... [--json] [--follow]`: a run's event log from its
durable store (storage/events.py), no Temporal needed.

--follow keeps printing events as they are appended (the log is polled every --poll-s)
and stops when the run has finished (its newest event is `run_finished`, whatever --kind
shows) or on Ctrl-C, exit 0 either way. A run with no event log is one line naming the
store and the fix, exit 1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

from common.errors import BadConfig, StorageUnavailable
from common.redact import redact, redact_value, secret_environ
from ops.cli_args import run_command, seconds
from ops.cli_output import json_line, printable
from ops.store_fields import checked_events

# The event the workflow writes last, completed or aborted (workflows/training_run.py).
TERMINAL = "run_finished"


POLL_WHY = "below it --follow lists the event log in a busy loop"


def register(sub: argparse._SubParsersAction) -> None:
    """Add `events RUN [--durable URL] [--kind K]... [--json] [--follow [--poll-s S]]`."""
    p = run_command(sub, "events", "print a run's event log (--follow: as it grows)")
    p.add_argument("--kind", action="append",
                   help="only events of this kind (e.g. fault, recovered); may be repeated")
    p.add_argument("--json", action="store_true", help="one JSON object per event and line")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep printing new events until the run finishes or Ctrl-C")
    p.add_argument("--poll-s", type=seconds(0.1, POLL_WHY), default=1.0,
                   help="with --follow: seconds between reads of the log (default 1)")
    p.set_defaults(fn=cmd_events)


def event_line(event: dict, as_json: bool) -> str:
    """Pure: one checked event (ops/store_fields.py) as a line: a JSON object (ASCII: every
    control character escaped), or `HH:MM:SS step=N kind payload` with the kind escaped
    (ops/cli_output.py:printable) and the payload as ASCII JSON."""
    if as_json:
        return json_line(event)
    stamp = time.strftime("%H:%M:%S", time.localtime(event["ts"]))
    payload = json.dumps(event["payload"], default=str)  # ASCII: \u001b, never ESC itself
    return f"{stamp} step={event['step']} {printable(event['kind'], 40):<20} {payload}"


class Finished:
    """Whether the run has finished: TERMINAL is among its newest events (by time). A run
    started again after an abort writes on, so an older TERMINAL does not count; one at the
    same time as another event does (the workflow writes the last stage's end and the run's
    in one moment, and nothing comes after the run's end)."""

    def __init__(self) -> None:
        self.newest = float("-inf")
        self.seen = False
        self.terminal = False

    def see(self, event: dict) -> None:
        self.seen = True
        if event["ts"] > self.newest:
            self.newest, self.terminal = event["ts"], event["kind"] == TERMINAL
        elif event["ts"] == self.newest:
            self.terminal = self.terminal or event["kind"] == TERMINAL

    def __call__(self) -> bool:
        return self.terminal


def cmd_events(args: argparse.Namespace) -> int:
    from common import telemetry

    # Logs (a damaged batch's warning) to stderr: stdout carries only the events.
    telemetry.configure_logging(os.environ.get("MAINSPRING_LOG_LEVEL", "warning"))
    kinds = tuple(args.kind or ())
    try:
        if args.follow:
            return _follow(args, kinds)
        there = _print_log(args, kinds)
    except (BadConfig, StorageUnavailable) as exc:
        print(f"mainspring events: {' '.join(redact(str(exc)).split())}", file=sys.stderr)
        return 1
    absent = sorted(set(kinds) - there)
    if absent:  # a typo prints nothing at all: say what there is
        print(f"mainspring events: no {printable(', '.join(absent))} events in run "
              f"{args.run_id!r} (kinds there: {printable(', '.join(sorted(there)), 2000)})",
              file=sys.stderr)
    return 0


# Events checked at once: a warning for the dropped ones per chunk, not per event.
CHECK_CHUNK = 4096


def _print_log(args: argparse.Namespace, kinds: tuple[str, ...]) -> set[str]:
    """Print the run's log (of `kinds`) as it is read (storage/events.py stream_events: a
    30-day log is never held whole); the kinds it holds. BadConfig when it holds none."""
    from ops.report import missing_run
    from storage.events import stream_events

    environ = secret_environ()  # read once: os.environ costs more than a line's scrub
    there: set[str] = set()
    stream = stream_events(args.durable, args.run_id)
    while read := list(itertools.islice(stream, CHECK_CHUNK)):
        for event in checked_events(read):
            there.add(event["kind"])
            if not kinds or event["kind"] in kinds:
                print(event_line(redact_value(event, environ), args.json))
    if not there:
        raise missing_run(args.durable, args.run_id)
    return there


def _follow(args: argparse.Namespace, kinds: tuple[str, ...]) -> int:
    from storage.events import follow

    finished, polled, environ = Finished(), False, secret_environ()

    def stop() -> bool:  # called after each poll of the log
        nonlocal polled
        if not polled and not finished.seen:
            print(f"mainspring events: run {args.run_id!r} has no events under {args.durable} "
                  "yet; waiting for them (Ctrl-C stops; check the run id and --durable)",
                  file=sys.stderr, flush=True)
        polled = True
        return finished()

    try:
        for event in follow(args.durable, args.run_id, poll_s=args.poll_s, stop=stop):
            checked = checked_events([event])
            if not checked:
                continue
            event = checked[0]
            finished.see(event)
            if not kinds or event["kind"] in kinds:
                print(event_line(redact_value(event, environ), args.json), flush=True)
    except KeyboardInterrupt:  # Ctrl-C is how a person stops following
        pass
    return 0
