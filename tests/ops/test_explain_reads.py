"""`mainspring explain --incident N` reads only what incident N needs (ops/explain.py): the
batches named as holding incidents, and the day around the incident for its step time —
and says what the whole run's incidents say of it, on a record whose batches carry the
names of older code and of this one."""

from __future__ import annotations

import os

import pytest

import storage.events as events_module
from common.errors import BadConfig
from common.redact import redact_value
from ops.explain import STEP_WINDOW_S, explain, incidents
from ops.store_fields import checked_events
from storage.events import EventLog, _batches, list_batches, read_events
from storage.fs import resolve
from storage.runs import claim_run

T0 = 1_700_000_000.0
HOUR = 3600.0
SPEC = {"train": {"nodes": 2, "procs_per_node": 4, "micro_batch_tokens": 1000,
                  "grad_accum": 2}}  # 16,000 tokens a step


def write_run(url: str, hours: int = 72) -> None:
    """`hours` of a run: each hour one segment batch of train_metrics (throughput doubles
    after day one), a fault and its recovery at hours 5, 30 and 60."""
    claim_run(url, "r", "h", SPEC)
    for h in range(hours):
        log = EventLog(url, "r", "supervisor")
        rate = 8000.0 if h < 24 else 16000.0  # 2 s a step, then 1 s
        for i in range(6):
            log.emit("train_metrics", step=h * 60 + i * 10, tokens_per_s=rate,
                     loss_mean=2.0)["ts"] = T0 + h * HOUR + i * 600
        if h in (5, 30, 60):
            fault = log.emit("fault", step=h * 60 + 55, kind="rank_lost", injected=False,
                             detected_by="supervisor", detection_s=3.0)
            fault["ts"] = T0 + h * HOUR + 3500
            log.flush()
            rec = EventLog(url, "r", "supervisor")
            rec.emit("recovered", step=h * 60 + 50, fault_event_id=fault["event_id"],
                     resumed_step=h * 60 + 50, lost_steps=5, mttr_s=40.0,
                     attempt=2)["ts"] = T0 + h * HOUR + 3540
            rec.flush()
        log.flush()


def as_old(url: str, every: int) -> list[str]:
    """Rename every `every`-th batch as older code named them (`<writer>-<seq>.jsonl`)."""
    fs, root = resolve(url)
    renamed = []
    for path in _batches(fs, f"{root}/runs/r/events")[::every]:
        new = os.path.join(os.path.dirname(path), os.path.basename(path).split(".")[0] + ".jsonl")
        os.rename(path, new)
        renamed.append(new)
    return renamed


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("explain") / "store")
    write_run(url)
    as_old(url, 9)
    whole = incidents(checked_events(redact_value(read_events(url, "r"))), SPEC)
    return url, whole


def test_one_incident_is_told_as_the_whole_runs_incidents_tell_it(record):
    url, whole = record
    assert [i.kind for i in whole] == ["fault"] * 3
    assert explain(url, "r") == whole
    for n in (1, 2, 3):
        assert explain(url, "r", n) == [whole[n - 1]]


def test_each_incident_is_priced_at_the_step_time_of_the_day_around_it(record):
    _, whole = record
    step_s = [{f.name: f.value for f in i.figures}["step_s"] for i in whole]
    # 16,000 tokens a step at 8,000 tokens/s for a day, then at 16,000 for two: the whole
    # run's median would price all three at 1 s; hour 30's day holds 5 hours of the first
    # rate and 19 of the second
    assert STEP_WINDOW_S == 12 * HOUR
    assert step_s == [2.0, 1.0, 1.0]


def test_explain_of_one_incident_fetches_the_marked_batches_and_its_day_only(record,
                                                                            monkeypatch):
    url, _ = record
    fetched: list[str] = []
    real_fetch = events_module._fetch

    def counting_fetch(fs, paths):  # the real fetch, recorded
        fetched.extend(paths)
        return real_fetch(fs, paths)

    monkeypatch.setattr(events_module, "_fetch", counting_fetch)
    explain(url, "r", 3)  # hour 60: its day is hours 48-72
    at = T0 + 60 * HOUR + 3500
    needed = {b.path for b in list_batches(url, "r")
              if b.first is None  # older code's batches say nothing: always read
              or b.marked or (b.last >= at - STEP_WINDOW_S and b.first <= at + STEP_WINDOW_S)}
    assert sorted(fetched) == sorted(needed)  # each once
    assert len(needed) < len(list_batches(url, "r")) / 2  # ~34 of 75


def test_an_incident_number_out_of_range_names_the_range(record):
    url, _ = record
    with pytest.raises(BadConfig, match="has 3 incidents, not 4") as caught:
        explain(url, "r", 4)
    assert caught.value.fix == "choose 1 to 3"


def test_a_run_with_no_events_is_named_missing(tmp_path):
    with pytest.raises(BadConfig, match="no events for run 'r'"):
        explain(str(tmp_path / "store"), "r", 1)
