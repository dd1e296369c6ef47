"""benchmarks/scale_record.py's writer in miniature: the record it writes reads back with the
kinds and counts it claims, and its ground truth adds up."""

from __future__ import annotations

from benchmarks.scale_record import DATA_S, Shape, fault_times, write_record
from ops.explain import explain
from ops.goodput import from_record
from storage.events import list_batches, read_events
from storage.spans import read_spans


def test_the_record_reads_back_as_written_and_goodput_matches_the_truth(tmp_path):
    # a 256-node day at a fast step: a few segments, checkpoints and faults in well under 1 s
    shape = Shape(nodes=256, days=2.0, scale=1.0, step_s=60.0, metrics_every=10,
                  checkpoint_every=60, segment_steps=600, seed=3)
    url = f"file://{tmp_path}/store"
    truth = write_record(shape, url, "r")
    events = read_events(url, "r")
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    assert kinds == truth.counts
    assert truth.faults == kinds.get("fault", 0) == kinds.get("recovered", 0) > 0
    assert kinds["checkpoint_saved"] == kinds["checkpoint_committed"]
    assert kinds["train_metrics"] >= truth.steps // shape.metrics_every
    assert [e["kind"] for e in (events[0], events[-1])] == ["run_started", "run_finished"]

    # the truth adds up: steps kept are the productive time; the rest is data prep, each
    # segment's start-up and what the faults cost
    assert truth.productive_s == truth.steps * shape.step_s
    launches = kinds["segment_started"]
    assert truth.wall_s >= truth.productive_s + DATA_S + sum(truth.lost_s)
    assert all(lost > 0 for lost in truth.lost_s)
    assert launches == kinds["segment_finished"] + truth.faults

    measured = from_record(events, read_spans(url, "r"))
    assert abs(measured["goodput"] - truth.goodput) / truth.goodput < 0.01
    assert sum(f["count"] for f in measured["faults"].values()) == truth.faults

    # the stored spec and the windows' throughput agree on the step time, as a real run's
    # do: explain prices a fault's replayed steps at the simulated step
    (first,) = explain(url, "r", 1)
    assert {f.name: f.value for f in first.figures}["step_s"] == shape.step_s
    # each batch named with its span (storage/event_batches.py): the faults' and milestones' marked
    batches = list_batches(url, "r")
    assert all(b.first is not None for b in batches)
    assert sum(1 for b in batches if b.marked) >= 2 * truth.faults


def test_the_fault_rate_is_llama3s_scaled_to_the_node_count():
    per_day = Shape(nodes=2048).faults_per_day
    assert abs(per_day - 419 / 54) < 1e-9 and Shape(nodes=1024).faults_per_day == per_day / 2
    times = fault_times(Shape(nodes=2048, seed=1), 0.0, 200 * 86400.0)
    assert 0.8 < len(times) / (200 * per_day) < 1.2 and times == sorted(times)
