"""`mainspring report` (ops/report.py): built from a durable event log alone. The log is
written with EventLog and MetricsForwarder the way the supervisor and trainer write it: a
killed attempt whose steps a retry replays, a spike rollback replayed in the same attempt,
evaluations, checkpoints, escalations and an operator command."""

from __future__ import annotations

import base64
import itertools
import json
import os
import subprocess
import sys

import pytest

from activities.metrics import MetricsForwarder
from common.errors import BadConfig
from common.protocol import StepLine
from ops.report import (
    build_report,
    checkpoint_rows,
    fault_rows,
    loss_series,
    val_series,
)
from storage.events import EventLog, read_events

RUN = "r1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Clock:
    """Event timestamps one second apart, so 'later wins' is decided by the script order."""

    def __init__(self) -> None:
        self.t = itertools.count(1_800_000_000)

    def stamp(self, event: dict) -> dict:
        event["ts"] = float(next(self.t))  # the buffered event itself: flush writes this ts
        return event


def steps(forwarder: MetricsForwarder, clock: Clock, span: range, loss: float,
          verdict: str = "ok") -> None:
    original = forwarder.events.emit
    forwarder.events.emit = lambda *a, **kw: clock.stamp(original(*a, **kw))
    for n in span:
        forwarder.on_progress(StepLine(step=n, loss=loss, lr=1e-3, verdict=verdict,
                                       tokens_per_s=1000.0, mfu=0.4, peak_mem_bytes=1 << 20))
    forwarder.events.emit = original


def write_run(url: str) -> None:
    clock = Clock()
    wf = EventLog(url, RUN, "workflow")

    def ev(log: EventLog, kind: str, step: int, fields: dict | None = None, **more) -> None:
        clock.stamp(log.emit(kind, fields, step=step, **more))  # fields: a fault's `kind`
    ev(wf, "run_started", 0, spec_hash="abc")
    ev(wf, "initialized_from", 0, source_run="base", source_step=8, uri=f"{url}/runs/base/promoted/8")
    # Attempt 1 of segment 0-60: commits at 20, reaches 30, is killed at 33.
    a1 = EventLog(url, RUN, "supervisor", attempt=1)
    fwd1 = MetricsForwarder(a1, 10, segment="0-60", attempt=1)
    steps(fwd1, clock, range(1, 21), 3.0)
    ev(a1, "checkpoint_committed", 20, uri=f"{url}/ckpt/20", bytes=100)
    ev(a1, "eval", 20, val_loss=3.1)
    steps(fwd1, clock, range(21, 34), 2.8)
    ev(a1, "fault", 33, {"kind": "kill_worker", "injected": True, "evidence":
                         "SIGKILL to trainer worker pid 123 after step 33; last committed 20"})
    a1.flush()  # the kill: fwd1 never closes, its tail (31-33) is lost with the worker
    # Attempt 2 resumes from 20 and replays 21-30 with other losses.
    a2 = EventLog(url, RUN, "supervisor", attempt=2)
    ev(a2, "recovered", 20, resumed_step=20, lost_steps=13, mttr_s=12.5, attempt=2)
    fwd2 = MetricsForwarder(a2, 10, segment="0-60", attempt=2)
    steps(fwd2, clock, range(21, 41), 2.5)
    ev(a2, "checkpoint_committed", 40, uri=f"{url}/ckpt/40", bytes=100)
    ev(a2, "eval", 40, val_loss=2.9)
    # A spike at 41-44: two skips, then a rollback to 40 and a replay of 41-60.
    steps(fwd2, clock, range(41, 45), 9.0, "skip")
    ev(a2, "fault", 41, {"kind": "corrupt_batches", "injected": True, "cursors": [40, 44]})
    for s in (41, 42):
        ev(a2, "loss_spike", s, loss=9.0, baseline=2.5, threshold=4.0, reason="outlier")
        ev(a2, "batch_skipped", s, loss=9.0, batches=[s - 1, s], reason="outlier")
    ev(a2, "rollback", 44, at_step=44, onset=41, to_step=40, skip=[37, 53], lost_steps=4,
       reason="sustained_spike", loss=9.0, threshold=4.0, discarded=[40])
    steps(fwd2, clock, range(41, 61), 2.0)
    ev(a2, "checkpoint_committed", 40, uri=f"{url}/ckpt/40", bytes=101)
    ev(a2, "eval", 40, val_loss=2.4)  # the replay's evaluation at the same step wins
    ev(a2, "checkpoint_committed", 60, uri=f"{url}/ckpt/60", bytes=100)
    fwd2.close()
    a2.flush()
    ev(wf, "lr_adjusted", 60, scale=0.5, from_step=60, until_step=100, reason="rollbacks")
    ev(wf, "needs_attention", 60, reason="spikes continue after the LR backoff")
    ev(wf, "operator", 60, command="resume", args={"note": "checked <b>shards</b>"},
       who="alice <script>")
    ev(wf, "stage_finished", 60, stage="evaluate", val_loss={"0": 4.0, "60": 1.9})
    ev(wf, "promoted", 60, uri=f"{url}/promoted/60", bytes=100)
    ev(wf, "run_finished", 60, status="completed")
    wf.flush()


CLI = """
import argparse, sys
from ops.report import register
parser = argparse.ArgumentParser()
register(parser.add_subparsers())
args = parser.parse_args(sys.argv[1:])
sys.exit(args.fn(args))
"""


def report_cli(*argv: str) -> subprocess.CompletedProcess:
    """`report ...` in a fresh process, as the CLI runs it (its logging setup is global)."""
    return subprocess.run([sys.executable, "-c", CLI, "report", *argv], check=False,
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})


@pytest.fixture
def url(tmp_path) -> str:
    url = str(tmp_path / "durable")
    write_run(url)
    return url


def test_replayed_steps_plot_the_latest_trajectory_and_keep_the_abandoned_one(url):
    series = loss_series(read_events(url, RUN))
    assert [(w.first, w.last, round(w.mean, 9)) for w in series.current] == [
        (1, 10, 3.0), (11, 20, 3.0), (21, 30, 2.5), (31, 40, 2.5), (41, 50, 2.0),
        (51, 60, 2.0)]
    assert [(w.first, w.last, round(w.mean, 9), w.attempt, w.skipped)
            for w in series.abandoned] == [
        (21, 30, 2.8, 1, 0), (41, 44, 9.0, 2, 4)]


def test_held_out_loss_takes_the_latest_value_per_step(url):
    assert val_series(read_events(url, RUN)) == [(0, 4.0), (20, 3.1), (40, 2.4), (60, 1.9)]


def test_partly_replaced_window_keeps_only_its_own_steps():
    def win(ts, first, last, mean):
        return {"event_id": f"w{ts}", "ts": ts, "kind": "train_metrics", "step": last,
                "attempt": 1, "payload": {"first_step": first, "last_step": last,
                                          "loss_mean": mean, "attempt": 1, "seq": ts}}
    series = loss_series([win(1, 1, 10, 3.0), win(2, 6, 10, 2.0)])
    assert [(w.first, w.last, round(w.mean, 9)) for w in series.current] == [(1, 5, 3.0), (6, 10, 2.0)]
    assert series.abandoned == []


def test_faults_are_paired_with_what_handled_them(url):
    kill, corrupt = fault_rows(read_events(url, RUN))
    assert (kill["kind"], kill["handled_by"], kill["lost_steps"], kill["mttr_s"]) == (
        "kill_worker", ["recovered@20"], 13, 12.5)
    assert corrupt["kind"] == "corrupt_batches"
    assert corrupt["handled_by"][:3] == ["batch_skipped@41", "batch_skipped@42", "rollback@44"]
    assert corrupt["lost_steps"] == 4


def test_checkpoint_rows_mark_discarded_and_promoted(url):
    rows = [(r["step"], r["status"]) for r in checkpoint_rows(read_events(url, RUN))]
    assert rows == [(20, "committed"), (40, "discarded by rollback@44"), (40, "committed"),
                    (60, "promoted")]


def test_report_writes_png_and_escaped_html_with_rollback_and_fault_rows(url, tmp_path):
    paths = build_report(url, RUN, str(tmp_path / "out"))
    with open(paths["png"], "rb") as f:
        png = f.read()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    with open(paths["html"], encoding="utf-8") as f:
        page = f.read()
    assert base64.b64encode(png).decode() in page  # self-contained: the plot is inline
    assert '<tr class="rollback">' in page and "to_step=40 skip=[37, 53]" in page
    assert "<td>kill_worker</td>" in page and "<td>recovered@20</td>" in page
    assert "<td>12.5</td>" in page  # the recovery's MTTR
    assert "<td>sustained_spike</td>" in page  # the rollbacks table
    assert "<td>promoted</td>" in page and "discarded by rollback@44" in page
    assert "alice &lt;script&gt;" in page and "<script>" not in page
    assert "&lt;b&gt;shards&lt;/b&gt;" in page
    assert "<td>1.9</td>" in page  # final held-out loss in the summary
    assert "started from (train.init_from)</th><td>run base, promoted step 8 (" in page
    # each incident in words, as `mainspring explain` tells it
    assert "<h2>Incidents</h2><ol><li>" in page and "rolled back at step" in page


@pytest.mark.process
def test_missing_run_names_the_run_the_store_and_how_to_list_runs(url, tmp_path):
    with pytest.raises(BadConfig) as err:
        build_report(url, "no-such-run", str(tmp_path / "out"))
    text = str(err.value)
    assert "'no-such-run'" in text and f"file://{url}/runs/no-such-run/events" in text
    assert f"runs with an event log there: {RUN}" in text and f"`ls {url}/runs/`" in text
    done = report_cli("no-such-run", "--durable", url, "--out", str(tmp_path / "out"))
    assert done.returncode == 1 and done.stdout == ""
    assert "mainspring report: run_id: no events for run 'no-such-run'" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.process
def test_cli_prints_the_paths_as_one_json_line(url, tmp_path):
    done = report_cli(RUN, "--durable", url, "--out", str(tmp_path / "o"))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"run_id": RUN, "png": str(tmp_path / "o" / "loss.png"),
                                       "map": str(tmp_path / "o" / "training_map.png"),
                                       "html": str(tmp_path / "o" / "report.html")}


GP_RUN, GP_T0 = "g1", 1_800_000_000.0


def write_goodput_run(url: str) -> None:
    """A run of 100 s: a 10 s trainer start, steps 1-30 (1 s each), a real worker loss
    detected in 4 s, a retry that restores (2 s) and replays 21-30, then steps 31-60; the
    spans stored by the real exporter, with the times given."""
    log = EventLog(url, GP_RUN, "workflow")

    def ev(t: float, kind: str, fields: dict | None = None, **more) -> dict:
        e = log.emit(kind, fields, step=None, **more)
        e["ts"] = GP_T0 + t
        return e
    ev(0, "run_started", spec_hash="abc")
    ev(0, "stage_started", stage="train")
    ev(40, "fault", {"kind": "kill_worker", "injected": True})
    lost = ev(41, "fault", {"kind": "worker_lost", "evidence": "no heartbeat for 4 s"})
    ev(50, "recovered", fault_event_id=lost["event_id"], resumed_step=20, lost_steps=10,
       detection_s=4.0, mttr_s=9.0, attempt=2)
    ev(100, "stage_finished", stage="train")
    ev(100, "run_finished", status="completed")
    log.flush()

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from storage.spans import DurableSpanExporter

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(DurableSpanExporter("trainer", (url, GP_RUN))))
    tracer = provider.get_tracer("test")

    def span(name: str, t0: float, t1: float, rank: int = 0, **attrs) -> None:
        s = tracer.start_span(name, start_time=round((GP_T0 + t0) * 1e9),
                              attributes={"rank": rank, **attrs})
        s.end(end_time=round((GP_T0 + t1) * 1e9))

    def window(first: int, last: int, t0: float, rank: int = 0) -> None:
        n = last - first + 1
        span(f"steps {first}-{last}", t0, t0 + n, rank, goodput=True, first_step=first,
             last_step=last, step_times_s=[1.0] * n, skipped_steps=[])
    span("startup", 0, 10, badput="startup")
    window(1, 30, 10)
    window(1, 30, 10, rank=1)  # ranks run side by side: rank 1's time is not counted again
    span("restore", 50, 52, badput="restore")
    window(21, 60, 52)
    provider.shutdown()


def test_goodput_section_comes_from_the_stored_events_and_spans(tmp_path):
    from ops.report import goodput_section
    from storage.spans import read_spans

    url = str(tmp_path / "durable")
    write_goodput_run(url)
    section = goodput_section(read_events(url, GP_RUN), read_spans(url, GP_RUN))
    # kept: steps 1-60, 60 s of 100 s; replayed 21-30 (10 s), startup 10, restore 2,
    # detection 4, other = 100 - 60 - 26 = 14
    assert section["figures"]["goodput"] == pytest.approx(0.6, abs=1e-6)
    assert section["figures"]["train_goodput"] == pytest.approx(0.6, abs=1e-6)
    time_s = {r["cause"]: r["seconds"] for r in section["time"]}
    assert time_s == pytest.approx({"productive": 60.0, "startup": 10.0, "restore": 2.0,
                                    "checkpoint_stall": 0.0, "replayed": 10.0, "skipped": 0.0,
                                    "detection": 4.0, "rollback": 0.0, "evaluation": 0.0,
                                    "sweep": 0.0, "data": 0.0, "paused": 0.0, "other": 14.0},
                                   abs=1e-3)
    assert section["faults"] == [{"kind": "worker_lost", "count": 1, "recovered": 1,
                                  "mttr_s_median": 9.0, "mttr_s_max": 9.0, "lost_steps": 10}]
    assert section["figures"]["injected_faults"] == 1


def test_report_page_shows_goodput_badput_and_mttr_per_fault_kind(tmp_path):
    url = str(tmp_path / "durable")
    write_goodput_run(url)
    with open(build_report(url, GP_RUN, str(tmp_path / "out"))["html"], encoding="utf-8") as f:
        page = f.read()
    section = page.split("<h2>Goodput and badput (from the durable record)</h2>", 1)[1]
    section = section.split("<h2>", 1)[0]
    assert "<th>goodput (kept productive step time ÷ run wall time)</th><td>0.6</td>" in section
    assert "<td>replayed</td><td>10</td><td>10</td>" in section  # seconds, % of wall
    assert "<td>detection</td><td>4</td><td>4</td>" in section
    assert "<td>worker_lost</td><td>1</td><td>1</td><td>9</td><td>9</td><td>10</td>" in section


def test_report_of_a_run_without_spans_says_goodput_is_unknown_not_zero(url, tmp_path):
    from ops.report import goodput_section

    assert goodput_section(read_events(url, RUN), [])["figures"]["goodput"] is None
    with open(build_report(url, RUN, str(tmp_path / "out"))["html"], encoding="utf-8") as f:
        page = f.read()
    assert "no spans stored for this run" in page
    assert "<td>kill_worker</td>" in page  # the injected kill is no real fault: no MTTR row
    section = page.split("MTTR per fault kind (real faults)</h3>", 1)[1].split("<h2>", 1)[0]
    assert section.startswith("<p><em>none</em></p>")


def test_an_oom_is_paired_with_its_adaptation_and_recovery(tmp_path):
    store = str(tmp_path / "oom")
    log = EventLog(store, "oom-run", "supervisor", attempt=1)
    log.emit("fault", step=None, event_id="fault/0-20/x/1", kind="oom", injected=False,
             evidence="rank 0: DefaultCPUAllocator: can't allocate memory")
    log.emit("oom_adapted", step=0, event_id="oom_adapted/0/2",
             micro_batch={"from": 256, "to": 128}, grad_accum={"from": 1, "to": 2},
             global_batch_sequences=256, evidence="can't allocate memory")
    log.emit("recovered", step=0, event_id="recovered/0-20/1", fault_event_id="fault/0-20/x/1",
             resumed_step=0, lost_steps=0, mttr_s=11.0)
    log.flush()
    [row] = fault_rows(read_events(store, "oom-run"))
    assert row["kind"] == "oom" and row["handled_by"] == ["oom_adapted@0", "recovered@0"]
    assert row["mttr_s"] == 11.0


def event(ts: float, type_: str, step: int, **payload) -> dict:
    return {"event_id": f"{type_}/{ts}", "ts": ts, "kind": type_, "step": step, "attempt": 1,
            "payload": payload}


def test_a_recovery_goes_to_the_fault_it_names_not_to_a_later_one():
    # A worker is lost, then an injected bad batch arrives before the retry resumes: the
    # skip answers the bad batch, the recovery (naming the loss) answers the loss.
    events = [event(10, "fault", 30, kind="worker_lost"),
              event(11, "fault", 31, kind="corrupt_batches", injected=True),
              event(12, "batch_skipped", 31),
              event(15, "recovered", 30, fault_event_id="fault/10", mttr_s=5.0, lost_steps=2)]
    lost, bad = fault_rows(events)
    assert (lost["kind"], lost["handled_by"], lost["mttr_s"], lost["lost_steps"]) == (
        "worker_lost", ["recovered@30"], 5.0, 2)
    assert (bad["kind"], bad["handled_by"], bad["mttr_s"], bad["lost_steps"]) == (
        "corrupt_batches", ["batch_skipped@31"], None, 0)


def test_a_multinode_recovery_answers_each_peer_fault_it_lists():
    events = [event(10, "fault", 30, kind="worker_lost"), event(10.5, "fault", 30, kind="nccl"),
              event(16, "recovered", 30, fault_event_id="fault/10", also_answers=["fault/10.5"],
                    mttr_s=6.0, lost_steps=1)]
    a, b = fault_rows(events)
    assert a["handled_by"] == b["handled_by"] == ["recovered@30"]
    assert a["mttr_s"] == b["mttr_s"] == 6.0 and (a["lost_steps"], b["lost_steps"]) == (1, 0)
