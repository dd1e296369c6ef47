"""`mainspring explain`: every incident of a recorded run is named, and every figure in its
sentences is the record's own (tests/fixtures/report_run/store: a real faulted run)."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from ops.cli import main as cli
from ops.explain import explain, incidents
from storage.events import read_events

STORE = "file://" + str(Path(__file__).resolve().parents[1] / "fixtures" / "report_run" / "store")
RUN = "map-run"


@pytest.fixture(scope="module")
def record():
    events = {e["event_id"]: e for e in read_events(STORE, RUN)}
    spec = json.loads((Path(STORE[len("file://"):]) / "runs" / RUN / "RUN.json").read_text())
    return events, spec["spec"], explain(STORE, RUN)


def recorded(event: dict, key: str):
    return event[key] if key in ("ts", "step") else event["payload"][key]


def written_as(value: float, text: str) -> bool:
    """`text` is `value` rounded to the decimals it shows."""
    shown = re.search(r"-?\d+(?:\.(\d+))?", text)
    decimals = len(shown.group(1) or "")
    return abs(float(shown.group(0)) - value) <= 0.5 * 10 ** -decimals + 1e-12


def test_every_fault_and_spike_of_the_run_is_an_incident(record):
    events, _, found = record
    assert [i.kind for i in found] == ["fault", "spike"]
    told = {eid for i in found for eid in i.event_ids}
    wanted = {eid for eid, e in events.items()
              if e["kind"] in ("fault", "recovered", "loss_spike", "batch_skipped", "rollback")}
    assert wanted <= told, wanted - told
    fault, spike = found
    assert "worker_lost" in fault.text and "injected kill_worker" in fault.text
    assert "injected corrupt_batches" in spike.text and "rolled back" in spike.text


def test_every_figure_in_a_sentence_is_one_the_record_holds(record):
    events, spec, found = record
    for incident in found:
        figs = {f.name: f for f in incident.figures}
        rest = incident.text.split(": ", 1)[1]  # after "Incident N: "
        for f in sorted(incident.figures, key=lambda f: -len(f.text)):
            assert f.text in rest, (f.name, f.text, incident.text)
            rest = rest.replace(f.text, "", 1)
            if f.event_id:  # read from the record: the same value, written as the text says
                value = recorded(events[f.event_id], f.field)
                if f.name in ("skip_from", "skip_to"):
                    assert f.value in value
                else:
                    assert f.value == value, (f.name, f.value, value)
                if isinstance(f.value, (int, float)) and f.name != "time":
                    assert written_as(f.value, f.text), f
        assert not re.search(r"\d", rest), f"a number no figure accounts for: {rest!r}"
        if "z" in figs:
            z = (figs["loss"].value - figs["baseline"].value) / figs["spread"].value
            assert figs["z"].value == pytest.approx(z, abs=0.05)
        accels = spec["train"]["nodes"] * spec["train"]["procs_per_node"]
        assert figs["accelerators"].value == accels == 2
        rates = [e["payload"]["tokens_per_s"] for e in events.values()
                 if e["kind"] == "train_metrics"]
        step_s = spec["train"]["micro_batch_tokens"] * accels / statistics.median(rates)
        assert figs["step_s"].value == pytest.approx(step_s, abs=0.001)
        again = figs["steps_again"].value * step_s
        assert figs["again_s"].value == pytest.approx(again, rel=1e-3)
        hours = (figs["wall_s"].value + again) * accels / 3600
        assert figs["accelerator_hours"].value == pytest.approx(hours, rel=1e-3)
        for name in ("z", "step_s", "again_s", "accelerator_hours", "wall_s"):
            if name in figs:
                assert written_as(figs[name].value, figs[name].text), figs[name]


def test_the_fault_is_dated_when_it_happened_and_costs_its_recovery(record):
    events, _, (fault, _) = record
    figs = {f.name: f for f in fault.figures}
    rec = next(e for e in events.values() if e["kind"] == "recovered")
    assert figs["time"].field == "fault_ts"  # not when the supervisor wrote it down
    assert figs["wall_s"].value == rec["payload"]["mttr_s"]
    assert figs["steps_again"].value == rec["payload"]["lost_steps"] == 10
    assert figs["resumed_step"].value == 40


def ev(event_kind: str, step: int, ts: float, **payload) -> dict:
    return {"kind": event_kind, "step": step, "ts": ts, "attempt": 1, "payload": payload,
            "event_id": f"{event_kind}/{step}/{ts}"}


def test_operator_commands_holds_and_undetected_injections_are_incidents_too():
    found = incidents([
        ev("operator", 30, 100.0, command="rollback", who="ana", note="bad shard",
           accepted_at_step=28, applied=True, span_id="00c0ffee00c0ffee"),
        ev("operator", 31, 101.0, command="set_lr_scale", who="ana", note="",
           accepted_at_step=31, applied=False, why_not="the run is paused"),
        ev("needs_attention", 40, 200.0, reason="3 rollbacks in 1000 steps",
           fix="mainspring run resume RUN"),
        ev("fault", 50, 300.0, kind="lr_burst", injected=True, at_step=50, steps=1),
    ])
    assert [i.kind for i in found] == ["operator", "operator", "needs_attention", "fault"]
    assert ("rollback from ana — bad shard; sent at step 28 (span 00c0ffee00c0ffee of the "
            "run's trace). Applied") in found[0].text
    assert "Not applied: the run is paused" in found[1].text
    assert "3 rollbacks in 1000 steps" in found[2].text
    assert found[3].text.startswith("Incident 4: injected fault at step 50")
    assert "No recovery is recorded" in found[3].text
    assert [i.number for i in found] == [1, 2, 3, 4]


def test_a_spike_that_went_away_costs_nothing_and_is_told_so():
    spike = ev("loss_spike", 70, 50.0, loss=9.0, baseline=5.0, spread=0.5, threshold=8.0,
               reason="outlier")
    (one,) = incidents([spike, ev("batch_skipped", 70, 50.1, batches=[69, 70], loss=9.0)])
    assert "z 8.0" in one.text and "skipped the update of step 70 " in one.text
    assert "went on" in one.text and "nothing lost" in one.text


def test_a_record_without_detected_faults_pairs_the_injection_with_the_next_recovery():
    """Older records hold only the injected fault: its recovery (naming no fault) is its
    own, and a rollback dated after its spike's last outlier still closes the spike."""
    found = incidents([
        ev("fault", 33, 10.0, kind="kill_worker", injected=True, evidence="SIGKILL pid 123"),
        ev("recovered", 20, 22.5, resumed_step=20, lost_steps=13, mttr_s=12.5, attempt=2),
        ev("loss_spike", 41, 30.0, loss=9.0, baseline=2.5, threshold=4.0, reason="outlier"),
        ev("loss_spike", 42, 30.5, loss=9.0, baseline=2.5, threshold=4.0, reason="outlier"),
        ev("rollback", 44, 31.0, onset=41, to_step=40, lost_steps=4, skip=[37, 53]),
    ])
    assert [i.kind for i in found] == ["fault", "spike"]
    assert "attempt 2 resumed at step 20" in found[0].text and "12.5 s to recover" in found[0].text
    assert "rolled back at step 44 to step 40" in found[1].text
    assert "on 1 accelerator." in found[0].text


def test_a_diagnosed_spike_says_what_the_replay_found_with_figures_from_its_event():
    found = incidents([
        ev("loss_spike", 76, 1.0, loss=7.1, baseline=3.0, spread=0.2, threshold=4.2,
           reason="outlier"),
        ev("spike_diagnosed", 78, 1.3, verdict="data", documents=[], batches=[75, 76, 77],
           forward_passes=16, replay_s=0.021, onset=76, rank=0, replay_disagreement=0.0),
        ev("rollback", 78, 1.4, onset=76, to_step=70, lost_steps=8, skip=[73, 81],
           outlier_steps=[76, 77, 78]),
    ])
    (spike,) = found
    assert "Replayed on step 70's weights, the spike's batches twice (16 forward passes, 0.02 s): batches 75, 76, " \
        "77 are still above the threshold" in spike.text
    assert "the data is the cause" in spike.text
    rest = spike.text.split(": ", 1)[1]
    for f in sorted(spike.figures, key=lambda f: -len(f.text)):
        rest = rest.replace(f.text, "", 1)
    assert not re.search(r"\d", rest), rest


def only_figures_hold_digits(incident) -> bool:
    rest = incident.text.split(": ", 1)[1]
    for f in sorted(incident.figures, key=lambda f: -len(f.text)):
        rest = rest.replace(f.text, "", 1)
    return not re.search(r"\d", rest)


def test_a_spike_diagnosed_as_a_bad_document_says_it_skipped_the_document_not_the_window():
    (spike,) = incidents([
        ev("loss_spike", 9, 1.0, loss=4.4, baseline=3.5, spread=0.03, threshold=3.7,
           reason="outlier"),
        ev("spike_diagnosed", 10, 1.3, verdict="data", documents=[76], forward_passes=8,
           replay_s=0.05, onset=9, rank=0, replay_disagreement=0.0),
        ev("rollback", 10, 1.4, onset=9, to_step=6, lost_steps=4, skip=None,
           skipped="documents", documents=[76], window=[7, 11], kept_batches=4,
           kept_sequences=16, outlier_steps=[9, 10]),
    ])
    assert "rolled back at step 10 to step 6. Replayed on" in spike.text
    assert "documents 76 stand out" in spike.text
    assert ("Decided: skip document 76 wherever it occurs (no training target on its tokens)"
            ", not data batches 7–11: 4 micro-batches (16 sequences) that window held still "
            "train.") in spike.text
    assert spike.text.index("Replayed on") < spike.text.index("Decided: skip document")
    assert "skipping data batches" not in spike.text
    assert only_figures_hold_digits(spike)


def test_a_spike_diagnosed_as_a_bad_update_says_it_skipped_no_data():
    (spike,) = incidents([
        ev("loss_spike", 9, 1.0, loss=4.4, baseline=3.5, spread=0.03, threshold=3.7,
           reason="outlier"),
        ev("spike_diagnosed", 10, 1.3, verdict="optimisation", documents=[], forward_passes=8,
           replay_s=0.05, onset=9, rank=0, replay_disagreement=0.0),
        ev("rollback", 10, 1.4, onset=9, to_step=6, lost_steps=4, skip=None, skipped="nothing",
           documents=[], window=[7, 11], kept_batches=4, kept_sequences=16),
    ])
    assert "the update, not the data, was the cause" in spike.text
    assert "Decided: skip no data, not data batches 7–11: 4 micro-batches (16 sequences) " \
        "train again." in spike.text
    assert only_figures_hold_digits(spike)


def test_a_spike_from_disagreeing_weight_copies_names_the_rank_and_node_and_skips_no_data():
    (spike,) = incidents([
        ev("loss_spike", 8, 1.0, loss=None, threshold=None, reason="replicas_disagree"),
        ev("spike_diagnosed", 8, 1.2, verdict="numerics", documents=[], forward_passes=0,
           replay_s=0.0, onset=8, rank=0, source="replicas", ranks=[1], node_ranks=[0],
           fingerprints=["7", "9"], nonfinite=[0, 3], agree_after_restore=True),
        ev("rollback", 8, 1.3, onset=8, to_step=4, lost_steps=4, skip=None, skipped="nothing",
           documents=[], window=[7, 11], kept_batches=4, kept_sequences=16,
           verdict="numerics"),
    ])
    assert "Replayed" not in spike.text
    assert "rank 1 (node 0) differ from the others and hold 3 non-finite values — suspected " \
        "silent data corruption" in spike.text
    assert "Every copy agreed again after the restore." in spike.text
    assert "Decided: skip no data" in spike.text
    assert only_figures_hold_digits(spike)


def test_copies_that_disagree_before_a_commit_are_an_incident_with_no_loss_spike():
    (incident,) = incidents([
        ev("spike_diagnosed", 8, 1.2, verdict="numerics", documents=[], forward_passes=0,
           replay_s=0.0, onset=8, rank=0, source="replicas", ranks=[1], node_ranks=[0],
           fingerprints=["7", "9", "7"], nonfinite=[0, 0, 0], agree_after_restore=True),
        ev("rollback", 8, 1.3, onset=8, to_step=4, lost_steps=4, skip=None, skipped="nothing",
           documents=[], window=[7, 11], kept_batches=4, kept_sequences=16,
           verdict="numerics", reason="replicas_disagree_at_commit"),
    ])
    assert incident.kind == "spike" and incident.step == 8
    assert incident.text.startswith("Incident 1: before the checkpoint of step 8 (")
    assert "rank 1 (node 0) differ from the others — suspected silent data corruption" \
        in incident.text
    assert "No loss had shown it. Decided: not to commit it; rolled back to step 4, the last " \
        "commit, skipping no data. Cost: 4 steps trained again" in incident.text
    assert "loss spike" not in incident.text
    assert only_figures_hold_digits(incident)


def test_cli_explain_prints_one_incident_or_names_the_range(capsys):
    assert cli(["explain", RUN, "--durable", STORE, "--incident", "2", "--json"]) == 0
    (only,) = json.loads(capsys.readouterr().out)
    assert only["number"] == 2 and only["kind"] == "spike"
    assert cli(["explain", RUN, "--durable", STORE, "--incident", "3"]) == 2
    err = capsys.readouterr().err
    assert "has 2 incidents, not 3" in err and "choose 1 to 2" in err
    assert cli(["explain", "no-such-run", "--durable", STORE]) != 0
