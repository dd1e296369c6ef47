"""What the operator commands do with a store someone else can write to, finding by
finding: an event dated 1e300, a loss window of 10^12 steps, a string span time, escape
sequences in any field, an event naming a URL to fetch, a `../` trial run id, and an
operator note of any length or holding ESC. Each test fails on the code before the rule
(ops/store_fields.py, ops/cli_output.py:printable, ops/cli_quarantine.py:source_refusal,
common/commands.py:text_problem) and passes with it."""

from __future__ import annotations

import contextlib
import io
import time
import tracemalloc

import pytest

from common.commands import MAX_NOTE_CHARS, Pause, Refused, command
from ops.cli import main as cli
from ops.cli_output import printable
from ops.cli_quarantine import OUTSIDE, source_refusal
from ops.report import loss_series
from ops.store_fields import checked_events, checked_spans
from ops.trace_view import tree_text
from storage.runs import claim_run
from tests.ops.hostile_store import ESC, FORBIDDEN, Accesses, put_lines

RUN = "r1"
ACCESSES = Accesses()


def event(i: int, kind_: str, ts: float = 1.7e9, step: int | None = 1, **payload) -> dict:
    """An event record as the log stores it; `payload` may hold a fault's own `kind`."""
    return {"event_id": f"e{i}", "run_id": RUN, "kind": kind_, "ts": ts, "step": step,
            "attempt": 0, "trace_id": "", "payload": payload}


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli(argv)
    return code, out.getvalue()


def test_events_and_explain_skip_an_event_dated_1e300_instead_of_raising(tmp_path):
    store = str(tmp_path / "store")
    put_lines(store, RUN, "events/w-0.jsonl", [
        event(1, "fault", ts=1e300, kind="hang"),
        event(2, "fault", kind="rank_lost", evidence="rank 1 exited", fault_ts=1e300)])
    for argv in (["events", RUN], ["explain", RUN]):
        code, out = run([*argv, "--durable", store])
        assert code == 0, out
        assert "rank_lost" in out and "hang" not in out  # the 1e300 one skipped, not fatal


def test_a_loss_window_claiming_a_trillion_steps_costs_the_report_no_memory_per_step():
    events = checked_events([event(1, "train_metrics", first_step=0, last_step=10**12,
                                   loss_mean=2.0),
                             event(2, "train_metrics", ts=1.8e9, first_step=5, last_step=9,
                                   loss_mean=1.0)])
    tracemalloc.start()
    start = time.monotonic()
    series = loss_series(events)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.monotonic() - start < 1.0 and peak < 1_000_000
    assert [(w.first, w.last) for w in series.current] == [(5, 9), (0, 10**12)]


def test_a_window_with_steps_of_the_wrong_type_is_drawn_nowhere():
    events = checked_events([event(1, "train_metrics", first_step="0", last_step=10),
                             event(2, "train_metrics", first_step=9, last_step=3)])
    assert len(events) == 2 and loss_series(events).current == []


def test_trace_of_a_span_with_a_string_start_ns_draws_the_tree():
    spans = checked_spans([
        {"span_id": "a" * 16, "trace_id": "t", "name": "run r1", "parent_id": None,
         "start_ns": "soon", "end_ns": 5 * 10**18, "attributes": {"first_step": "x"},
         "events": [{"name": "fault", "ts_ns": "later", "attributes": {"step": 1e300}}]},
        {"span_id": "b" * 16, "trace_id": "t", "name": "stage train", "parent_id": "a" * 16,
         "start_ns": 10**18, "end_ns": 10**18 + 10**9, "attributes": []}])
    text = tree_text(spans)
    assert "run r1" in text and "stage train" in text and "1.00 s" in text


def test_escape_sequences_from_the_store_reach_no_terminal(tmp_path):
    store = str(tmp_path / "store")
    put_lines(store, RUN, "events/w-0.jsonl", [
        event(1, f"fault{ESC}[31m", kind=f"hang{ESC}]0;owned\x07", evidence="a\x9bb\nFAKE"),
        event(2, "fault", kind="rank_lost", evidence=f"{ESC}[2J", step=3),
        event(3, "sweep_trial", trial_run_id=f"r1-trial-0{ESC}", source=f"tpe{ESC}[1m",
              params={f"lr{ESC}": 0.1}, result=1.0)])
    put_lines(store, RUN, "spans/a.jsonl", [
        {"span_id": "a" * 16, "trace_id": "t", "name": f"run{ESC}[2J", "start_ns": 10**18,
         "end_ns": 10**18 + 1, "status": "error", "status_message": f"x{ESC}[5m",
         "attributes": {"rank": f"0{ESC}"}, "events": [
             {"name": "fault", "ts_ns": 10**18, "attributes": {"evidence": f"{ESC}[2J"}}]}])
    for argv in (["events", RUN], ["explain", RUN], ["trace", RUN], ["goodput", RUN],
                 ["sweep", RUN]):
        code, out = run([*argv, "--durable", store])
        assert code == 0 and not FORBIDDEN & set(out), (argv, out)
        assert "\\x1b" in out or argv[0] == "goodput", (argv, out)  # shown, escaped


def test_printable_escapes_c0_c1_esc_newlines_and_bidi_and_keeps_the_rest():
    assert printable(f"a{ESC}[31mb\nc\x9b\u202ed é 中") == "a\\x1b[31mb\\nc\\x9b\\u202ed é 中"
    assert printable("x" * 10, 5) == "xxxx…"


@pytest.mark.parametrize("source", ["http://169.254.169.254/latest/meta-data",
                                    "file:///dev/zero", "/etc/hostname",
                                    "CORPUS/../../etc/passwd", "s3://elsewhere/a.jsonl"])
def test_quarantine_never_opens_a_source_outside_the_corpus_and_the_store(tmp_path, source):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('{"text": "x"}\n')
    store = str(tmp_path / "store")
    source = source.replace("CORPUS", str(corpus))
    claim_run(store, RUN, "h", {"run_id": RUN, "data": {"corpus": str(corpus)}})
    put_lines(store, RUN, "events/w-0.jsonl", [
        event(1, "dataset_ready", uri="http://169.254.169.254/MANIFEST.json"),
        event(2, "spike_diagnosed", verdict="data", sources=[
            {"document": 1, "record": -1, "sha256": "ab" * 16, "source": source}])])
    assert source_refusal(source, str(corpus), store) is not None
    assert source_refusal(f"file://{corpus}/a.jsonl", str(corpus), store) is None
    with ACCESSES.watching(str(tmp_path)) as outside:
        code, out = run(["data", "quarantine", RUN, "--durable", store])
    assert code == 0 and OUTSIDE in out
    assert not outside, outside


def test_report_does_not_follow_a_trial_run_id_out_of_the_run_s_store(tmp_path):
    store = str(tmp_path / "store")
    put_lines(store, RUN, "events/w-0.jsonl", [
        event(1, "run_started"),
        event(2, "sweep_trial", trial_run_id="../../victim", result=1.0),
        event(3, "train_metrics", first_step=1, last_step=2, loss_mean=1.0)])
    put_lines(str(tmp_path), "victim", "events/v.jsonl", [
        event(1, "train_metrics", first_step=1, last_step=2, loss_mean=9.0)])
    with ACCESSES.watching(store, str(tmp_path / "out")) as outside:
        code, out = run(["report", RUN, "--durable", store, "--out", str(tmp_path / "out")])
    assert code == 0, out
    assert not [p for p in outside if "victim" in p], outside


@pytest.mark.parametrize("note", ["x" * (MAX_NOTE_CHARS + 1), f"fine{ESC}[2J", "two\nlines"])
def test_an_operator_note_too_long_or_holding_a_control_character_is_refused_naming_note(
        note):
    with pytest.raises(Refused, match=r"pause: note \(--note\) must be"):
        Pause(note=note)
    with pytest.raises(Refused, match=r"rollback: note \(--note\) must be"):
        command("rollback", {"to_step": 3, "note": note})
    assert Pause(note="x" * MAX_NOTE_CHARS).note  # at the bound: accepted


def test_an_abort_signal_with_a_bad_note_still_reads_with_the_note_tamed():
    cmd = command("abort", {"note": f"stop{ESC}[2J" + "y" * 5000}, strict=False)
    assert cmd.note.startswith("stop?[2J") and len(cmd.note) == MAX_NOTE_CHARS


def test_the_store_s_run_listing_shows_only_valid_run_ids(tmp_path):
    store = tmp_path / "store"
    put_lines(str(store), "ok-run", "events/w-0.jsonl", [event(1, "run_started")])
    put_lines(str(store), f"evil{ESC}[2J", "events/w-0.jsonl", [event(1, "run_started")])
    code, out = run(["events", "nope", "--durable", str(store)])
    assert code == 1 and "ok-run" in out and "evil" not in out
