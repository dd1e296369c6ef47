"""The training map's distill box (ops/report_map.py): the recorded run of
tests/fixtures/report_run with a distill stage appended after its promotion, as
workflows/distill.py records one, and a student run's teacher cost in its training box."""

from __future__ import annotations

import math

import pytest

from ops.goodput import from_record
from ops.report import loss_series, training_map_of, val_series
from ops.report_map import DISTILL_ROW, OTHER, distill_box
from ops.report_map_render import map_html, plot_map
from storage.events import read_events
from storage.runs import stored_spec
from storage.spans import read_spans
from tests.ops.test_report_map import RUN, STORE

STAGE = {"teacher_step": 160, "teacher_val_loss": 3.9, "student_run": f"{RUN}-student",
         "student_val_loss": 4.2, "student_promoted": "file:///s/promoted/step-000000160",
         "steps": 160, "alpha": 0.5, "temperature": 2.0, "student_wall_s": 40.0,
         "baseline_run": f"{RUN}-student-base", "baseline_val_loss": 4.5,
         "baseline_wall_s": 35.0}


def event(kind: str, ts: float, **payload) -> dict:
    return {"event_id": f"{kind}/{ts}", "run_id": RUN, "kind": kind, "ts": ts, "step": None,
            "attempt": 1, "payload": payload}


@pytest.fixture(scope="module")
def distilled():
    events = read_events(STORE, RUN)
    end = max(e["ts"] for e in events)
    events += [event("stage_started", end + 1, stage="distill"),
               event("stage_finished", end + 81, stage="distill", **STAGE)]
    spans = read_spans(STORE, RUN)
    tmap = training_map_of(STORE, RUN, events, spans, stored_spec(STORE, RUN), 0.0)
    return tmap, from_record(events, spans), events


def test_a_run_with_the_distill_stage_gets_a_sixth_box_after_promotion(distilled):
    tmap, _, _ = distilled
    assert [b.stage for b in tmap.boxes][-2:] == ["promote", "distill"]
    box = tmap.boxes[-1]
    assert box.title == "6 · Distillation" and box.wall_s == pytest.approx(80.0)
    assert box.accel_h == pytest.approx(80.0 * tmap.accelerators / 3600)
    text = "\n".join(box.lines)
    for words in (f"{RUN}-student", "teacher: 3.9000", "student: 4.2000",
                  "without teacher: 4.5000", "+0.3000 nats/token"):
        assert words in text, (words, text)
    assert box.figures["gain"] == pytest.approx(0.3)
    assert 'id="stage-distill"' in map_html(tmap, "", RUN)


@pytest.mark.soak  # a PNG drawn: ~2 s, more than the default suite's budget allows
def test_the_six_boxes_fit_the_map_with_no_overlap(distilled, tmp_path):
    tmap, _, events = distilled
    path = str(tmp_path / "map.png")
    assert plot_map(path, RUN, tmap, loss_series(events), val_series(events), events) == []


def test_the_stage_has_its_own_cost_row_and_the_rows_still_add_up(distilled):
    tmap, rec, _ = distilled
    rows = {r.row: r for r in tmap.cost}
    assert rows[DISTILL_ROW].seconds == pytest.approx(80.0)
    assert math.fsum(r.seconds for r in tmap.cost) == pytest.approx(rec["wall_s"], abs=1e-6)
    assert rows[OTHER].seconds == pytest.approx(rec["badput_s"]["other"] - 80.0, abs=1e-6)


def test_a_run_without_the_stage_keeps_five_boxes_and_no_distill_row():
    events, spans = read_events(STORE, RUN), read_spans(STORE, RUN)
    tmap = training_map_of(STORE, RUN, events, spans, stored_spec(STORE, RUN), 0.0)
    assert len(tmap.boxes) == 5 and DISTILL_ROW not in {r.row for r in tmap.cost}


def test_a_student_runs_training_box_names_its_teacher_and_its_forward_cost():
    events, spans = read_events(STORE, RUN), read_spans(STORE, RUN)
    end = max(e["ts"] for e in events)
    events += [event("teacher_cost", end, teacher="base@160", steps=80,
                     forward_s_per_step=0.01, weight_bytes=2_000_000, logits_bytes=4_194_304),
               event("teacher_cost", end, teacher="base@160", steps=80,
                     forward_s_per_step=0.03, weight_bytes=2_000_000, logits_bytes=4_194_304)]
    tmap = training_map_of(STORE, RUN, events, spans, stored_spec(STORE, RUN), 0.0)
    train = next(b for b in tmap.boxes if b.stage == "train")
    assert train.figures["teacher"]["forward_s_per_step"] == pytest.approx(0.02)
    assert "teacher: base@160" in train.lines
    assert "   its memory: weights 2.0 MB, logits 4.2 MB" in train.lines


def test_a_failed_student_is_shown_failed_with_its_reason_and_nothing_promoted_for_it():
    failed = {**STAGE, "student_status": "failed", "student_val_loss": None,
              "student_promoted": None, "student_error": "BadData: shard 3 unreadable",
              "baseline_status": "completed"}
    lines, fig = distill_box([event("stage_finished", 1.0, stage="distill", **failed)])
    text = "\n".join(lines)
    assert "student: failed (BadData: shard 3 unreadable)" in text
    assert "without teacher: 4.5000" in text and fig["gain"] is None
    assert "promoted in its own run" not in text and "teacher's run stands" in text
