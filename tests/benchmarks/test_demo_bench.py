"""benchmarks/demo.py's arithmetic: a stage's seconds come from its own start and finish
events, and a stage that never finished has none."""

from __future__ import annotations

from benchmarks.demo import stage_seconds


def _event(kind: str, stage: str, ts: float) -> dict:
    return {"kind": kind, "ts": ts, "payload": {"stage": stage}}


def test_each_stage_lasts_from_its_start_to_its_finish_event():
    events = [_event("stage_started", "prepare_data", 100.0),
              _event("stage_finished", "prepare_data", 101.5),
              _event("stage_started", "warmup_sweep", 101.5),
              {"kind": "sweep_trial", "ts": 110.0, "payload": {"params": {}}},
              _event("stage_finished", "warmup_sweep", 119.25),
              _event("stage_started", "train", 119.3)]  # killed before it finished
    assert stage_seconds(events) == {"prepare_data": 1.5, "warmup_sweep": 17.75}
