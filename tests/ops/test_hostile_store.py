"""Every operator command that reads a run's store (`events`, `explain`, `report`, `trace`,
`goodput`, `data quarantine`, `sweep`) fed hostile records: times of 1e300, NaN and
strings, loss windows of 10^12 steps, wrong types, deep nesting, ESC and C1 characters,
`../` run ids and foreign URLs. Each call returns promptly with an exit status (never a
traceback), prints no control character, and touches no file or address outside the store.
`run status` prints what the workflow's query answers: its view is checked on its own."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ops.cli import main as cli
from ops.cli_output import print_status, print_table
from tests.ops.hostile_store import FORBIDDEN, RAW_LINES, Accesses, events, put_lines, spans

RUN = "hostile"
ACCESSES = Accesses()
# Per call: a report draws two PNGs (about a second); the rest read a few lines.
BOUND_S = {"report": 20.0}
FAST = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def run_cli(argv: list[str], root: str) -> tuple[int, str, float, list[str]]:
    """(exit status, stdout + stderr, seconds, accesses outside `root`) of one command."""
    out = io.StringIO()
    start = time.monotonic()
    with ACCESSES.watching(root) as outside, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(out):
        code = cli(argv)
    return code, out.getvalue(), time.monotonic() - start, list(outside)


def hostile_store(evs: list[dict], sps: list[dict]) -> tuple[str, str]:
    """(root, store): a store whose run has the hostile events and spans, a victim run
    outside it (`../../victim` from the run's events) and a quarantine file."""
    root = tempfile.mkdtemp(prefix="hostile-")
    store = os.path.join(root, "store")
    put_lines(store, RUN, "events/w-000000.jsonl", evs, RAW_LINES)
    put_lines(store, RUN, "spans/a.jsonl", sps, RAW_LINES)
    put_lines(store, RUN, "quarantine.jsonl", [{"sha256": "ab" * 16, "source": "/etc/hostname"}])
    put_lines(root, "victim", "events/v.jsonl", [])  # root/runs/victim: outside the store
    return root, store


def check(argv: list[str], root: str) -> None:
    code, text, took, outside = run_cli(argv, root)
    name = argv[0]
    assert code in (0, 1, 2), (argv, code)
    assert took < BOUND_S.get(name, 5.0), (argv, took)
    assert not FORBIDDEN & set(text), (argv, [c for c in text if c in FORBIDDEN][:5])
    assert not outside, (argv, outside[:5])


@FAST
@given(evs=events(), sps=spans())
def test_read_commands_on_a_hostile_store_exit_cleanly_escaped_and_inside_it(evs, sps):
    root, store = hostile_store(evs, sps)
    try:
        for argv in (["events", RUN], ["events", RUN, "--json"], ["explain", RUN],
                     ["explain", RUN, "--json"], ["trace", RUN], ["trace", RUN, "--json"],
                     ["goodput", RUN], ["data", "quarantine", RUN],
                     ["data", "quarantine", RUN, "--json"], ["sweep", RUN],
                     ["sweep", RUN, "--json"]):
            check([*argv, "--durable", store], root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(evs=events(), sps=spans())
def test_report_on_a_hostile_store_exits_cleanly_within_its_bound_and_inside_the_store(evs,
                                                                                      sps):
    root, store = hostile_store(evs, sps)
    try:
        check(["report", RUN, "--durable", store, "--out", os.path.join(root, "out")], root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@FAST
@given(status=st.dictionaries(st.text(max_size=8) | st.just("\x1b[2J"),
                              st.text(max_size=12) | st.just("\x1b]0;x\x07\x9b")
                              | st.integers() | st.none(), max_size=6))
def test_run_status_and_list_views_print_no_control_character(status):
    out = io.StringIO()
    print_status({"run_id": "r", **status}, out)
    print_table([{"run_id": "r", **status}], out)
    assert not FORBIDDEN & set(out.getvalue())
