"""ops/trace_view.py: a run's span records (the layout storage/spans.py stores) as a tree,
JSON and Chrome trace-event JSON. The records are literal: a run whose first segment
attempt lost a rank, and whose second attempt's trainer was SIGKILLed, so its root span
was never stored and its finished spans are orphans pointing at it."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from ops.trace_view import (
    TRACE_EVENT_SCHEMA,
    build_tree,
    event_line,
    human_duration,
    to_json,
    to_perfetto,
    track_label,
    tree_text,
    walk,
)

TRACE = "0af7651916cd43dd8448eb211c80319c"
S = 1_000_000_000  # ns per second
T0 = 1_800_000_000 * S
ORCH, ACT, RANK1, RANK2, WRITER = ("mainspring-worker-orchestrator", "mainspring-worker-trainer",
                                   "mainspring-trainer", "mainspring-trainer",
                                   "mainspring-checkpoint-writer")


def span(sid: str, name: str, parent: str | None, start: float, end: float, service: str,
         pid: int, *, hint: str | None = None, events: tuple = (), links: tuple = (),
         status: str = "unset", message: str = "", trace: str = TRACE, **attrs) -> dict:
    return {"trace_id": trace, "span_id": sid.ljust(16, "0"),
            "parent_id": parent.ljust(16, "0") if parent else None, "name": name,
            "start_ns": T0 + int(start * S), "end_ns": T0 + int(end * S), "status": status,
            "status_message": message, "service": service, "pid": pid,
            "parent_hint": hint.ljust(16, "0") if hint else None, "attributes": attrs,
            "events": [{"name": n, "ts_ns": T0 + int(t * S), "attributes": a}
                       for n, t, a in events],
            "links": [{"trace_id": TRACE, "span_id": s.ljust(16, "0")} for s in links]}


def fault(t: float, kind: str, step: int, evidence: str) -> tuple:
    return ("fault", t, {"event_id": f"f-{kind}", "kind": kind, "step": step,
                         "evidence": evidence})


def run_spans() -> list[dict]:
    """run -> stage train -> RunActivity -> segment 0-40 (attempt 1, a rank_lost fault) ->
    trainer rank 0 -> startup, steps, checkpoint stage 10 (+ the writer's upload, linked);
    attempt 2: a hang fault, its trainer root lost (SIGKILL), its spans hinting at segment
    2; an online_eval of a process whose hint is lost too; and the rank's steps error."""
    return [
        span("a1", "run r1", None, 0, 100, ORCH, 100, run_id="r1"),
        span("a2", "stage train", "a1", 1, 99, ORCH, 100, stage="train"),
        span("b1", "RunActivity:train_segment", "a2", 2, 40, ACT, 200, attempt=1),
        span("b2", "segment 0-40", "b1", 2, 40, ACT, 200, attempt=1, from_step=0, to_step=40,
             events=(fault(30, "rank_lost", 25, "rank 1 exited with -9"),)),
        span("c1", "trainer rank 0", "b2", 3, 35, RANK1, 301, hint="b2", rank=0, attempt=1),
        span("c2", "startup", "c1", 3, 5, RANK1, 301, hint="b2"),
        span("c3", "steps 1-10", "c1", 5, 15, RANK1, 301, hint="b2", first_step=1,
             last_step=10, step_times_s=[1.0] * 10, skipped_steps=[], goodput=True),
        span("c4", "checkpoint stage 10", "c1", 15, 15.5, RANK1, 301, hint="b2", step=10),
        span("w1", "upload 10", "c1", 15.5, 18, WRITER, 401, hint="c1", step=10,
             links=("c4",)),
        span("b3", "RunActivity:train_segment", "a2", 41, 98, ACT, 200, attempt=2),
        span("b4", "segment 0-40", "b3", 41, 98, ACT, 200, attempt=2, from_step=10,
             to_step=40, events=(fault(80, "hang", 30, "no heartbeat for 30 s"),
                                 ("recovered", 95, {"event_id": "rec", "step": 30,
                                                    "mttr_s": 15.0}))),
        # the trainer root "d0" of attempt 2 was never stored: its process was SIGKILLed
        span("d1", "startup", "d0", 42, 44, RANK2, 302, hint="b4", rank=0, attempt=2),
        span("d2", "restore", "d0", 44, 45, RANK2, 302, hint="b4", rank=0, attempt=2,
             tier="fast", step=10, bytes=1 << 20, badput="restore"),
        span("d3", "steps 11-20", "d0", 45, 70, RANK2, 302, hint="b4", rank=0, attempt=2,
             status="error", message="RuntimeError: NCCL watchdog timeout"),
        span("e1", "online_eval", "e0", 50, 51, RANK2, 302, hint="ee", rank=0, attempt=2),
    ]


def names(nodes) -> list[str]:
    return [n.span["name"] for n in nodes]


def by_name(roots, name: str, nth: int = 0):
    return [n for _, n in walk(roots) if n.span["name"] == name][nth]


def test_tree_nests_run_stage_activity_segment_trainer_and_its_children():
    roots = build_tree(run_spans())
    assert names(roots) == ["run r1", "online_eval"]
    (stage,) = roots[0].children
    assert stage.span["name"] == "stage train"
    assert [n.span["attributes"]["attempt"] for n in stage.children] == [1, 2]
    (segment,) = stage.children[0].children
    (rank,) = segment.children
    assert names(rank.children) == ["startup", "steps 1-10", "checkpoint stage 10", "upload 10"]
    assert not any(n.parent_lost for _, n in walk([stage.children[0]]))


def test_orphans_of_a_lost_trainer_root_hang_under_their_hint_marked_in_start_order():
    roots = build_tree(list(reversed(run_spans())))  # the input order must not matter
    second = by_name(roots, "segment 0-40", 1)
    assert names(second.children) == ["startup", "restore", "steps 11-20"]
    assert all(n.parent_lost for n in second.children)
    orphan = roots[1]  # its hint names a span that was lost too: top level, still marked
    assert orphan.span["name"] == "online_eval" and orphan.parent_lost


def test_tree_text_names_every_fault_kind_errors_orphans_and_the_trace():
    spans = run_spans()
    text = tree_text(spans, width=200)
    kinds = {e["attributes"]["kind"] for s in spans for e in s["events"] if e["name"] == "fault"}
    assert kinds == {"rank_lost", "hang"}
    for kind in kinds:
        assert f"⚡ fault {kind} step" in text
    assert "⚡ fault rank_lost step 25: rank 1 exited with -9" in text
    assert f"trace {TRACE} · {len(spans)} spans" in text
    assert "trace ids" not in text  # one trace: no warning
    assert "✗ error: RuntimeError: NCCL watchdog timeout" in text
    assert text.count("(parent span lost)") == 4
    line = next(ln for ln in text.splitlines() if "restore" in ln)
    assert "1.00 s" in line and "rank 0 · trainer" in line  # its parent's attempt: not repeated
    assert "attempt 2" not in line and "attempt 2" in text
    assert "badput restore" in line
    assert "• recovered step 30: mttr_s=15.0" in text


def test_tree_text_nests_lines_so_an_orphan_is_indented_under_its_hint():
    lines = tree_text(run_spans(), width=200).splitlines()
    seg2 = [i for i, ln in enumerate(lines) if "segment 0-40" in ln][1]
    restore = next(i for i, ln in enumerate(lines) if "restore" in ln)
    indent = lambda ln: len(ln) - len(ln.lstrip("│ ├└─"))  # noqa: E731
    assert restore > seg2 and indent(lines[restore]) > indent(lines[seg2])


def test_more_than_one_trace_id_is_called_out():
    spans = run_spans()
    spans[-1]["trace_id"] = "f" * 32
    text = tree_text(spans, width=200)
    assert "2 trace ids in one run (a run should be one trace)" in text
    assert f"trace {'f' * 32}: 1 spans" in text and f"trace {TRACE}: {len(spans) - 1} spans" in text


def test_human_durations():
    assert [human_duration(ns) for ns in (850_000, 12_340_000, 4_204_000_000, 192 * S,
                                          3720 * S, None)] == [
        "850 µs", "12.3 ms", "4.20 s", "3m 12s", "1h 02m", "?"]


def test_event_line_leads_with_kind_and_step_then_the_evidence():
    ev = {"name": "fault", "ts_ns": 0, "attributes": {
        "event_id": "x", "kind": "oom", "step": 7, "evidence": "CUDA out of memory",
        "injected": True}}
    assert event_line(ev) == "⚡ fault oom step 7: CUDA out of memory injected=true"
    assert len(event_line({**ev, "attributes": {"evidence": "x" * 500}}, limit=50)) == 52


def test_track_labels():
    assert track_label(ORCH) == "orchestrator"
    assert track_label(ACT) == "trainer worker"
    assert track_label(RANK1, 1) == "trainer rank 1"
    assert track_label(WRITER) == "checkpoint writer"


def test_json_is_the_nested_tree_with_span_fields():
    doc = json.loads(json.dumps(to_json(run_spans())))
    assert doc["trace_ids"] == [TRACE] and doc["span_count"] == len(run_spans())
    run = doc["roots"][0]
    assert run["name"] == "run r1" and run["span_id"] == "a1".ljust(16, "0")
    segment = run["children"][0]["children"][1]["children"][0]
    assert [c["name"] for c in segment["children"]] == ["startup", "restore", "steps 11-20"]
    assert all(c["parent_lost"] for c in segment["children"])
    assert segment["events"][0]["attributes"]["kind"] == "hang"


def validate(doc: dict) -> None:
    jsonschema.Draft202012Validator.check_schema(TRACE_EVENT_SCHEMA)
    jsonschema.validate(doc, TRACE_EVENT_SCHEMA, cls=jsonschema.Draft202012Validator)


def test_perfetto_output_matches_the_trace_event_schema():
    doc = to_perfetto(run_spans())
    validate(json.loads(json.dumps(doc)))
    assert doc["displayTimeUnit"] == "ms"
    phases = [e["ph"] for e in doc["traceEvents"]]
    assert phases.count("X") == len(run_spans())
    assert phases.count("i") == 3 and phases.count("s") == phases.count("f") == 1
    restore = next(e for e in doc["traceEvents"] if e["name"] == "restore")
    assert restore["ts"] == (T0 + 44 * S) / 1000 and restore["dur"] == 1_000_000  # µs
    assert restore["args"]["tier"] == "fast" and restore["args"]["parent_lost"] is True


def test_perfetto_has_one_labelled_track_per_service_pid_and_rank():
    doc = to_perfetto(run_spans())
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["name"] == "process_name"}
    # orchestrator, trainer worker, two rank-0 trainer processes, the checkpoint writer
    assert len(procs) == len({(s["service"], s["pid"]) for s in run_spans()}) == 5
    assert sorted(procs.values()) == [
        "checkpoint writer · pid 401", "orchestrator · pid 100",
        "trainer rank 0 · attempt 1 · pid 301", "trainer rank 0 · attempt 2 · pid 302",
        "trainer worker · attempt 1 · attempt 2 · pid 200"]
    pids = {e["args"]["span_id"][:2]: e["pid"] for e in doc["traceEvents"] if e["ph"] == "X"}
    # c2 (startup) has no rank attribute: it takes that of its parent in its process (c1)
    assert pids["c2"] == pids["c1"] == 301 and pids["d1"] == pids["e1"] == 302
    fault_mark = next(e for e in doc["traceEvents"] if e["ph"] == "i" and "hang" in e["name"])
    assert fault_mark["pid"] == 200 and fault_mark["s"] == "t"
    start, end = (next(e for e in doc["traceEvents"] if e["ph"] == ph) for ph in "sf")
    assert (start["pid"], end["pid"], start["id"]) == (301, 401, end["id"])


def test_spans_that_overlap_without_nesting_go_on_separate_lanes_of_their_process():
    spans = [span("x1", "RunWorkflow:TrainingRun", None, 0, 10, ORCH, 100),
             span("x2", "RunWorkflow:TrainingRun", None, 5, 15, ORCH, 100),
             span("x3", "StartActivity:train_segment", "x1", 1, 2, ORCH, 100)]
    doc = to_perfetto(spans)
    validate(doc)
    tid = {e["args"]["span_id"][:2]: e["tid"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert tid["x1"] == tid["x3"] != tid["x2"]
    lanes = [e for e in doc["traceEvents"] if e["name"] == "thread_name"]
    assert len(lanes) == 2 and len({e["pid"] for e in lanes}) == 1


def test_every_lane_of_the_run_nests():
    lanes: dict[tuple, list[tuple[float, float]]] = {}
    for e in to_perfetto(run_spans())["traceEvents"]:
        if e["ph"] == "X":
            lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for slices in lanes.values():
        stack: list[float] = []
        for start, end in sorted(slices, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1]
            stack.append(end)


@pytest.mark.parametrize("drop, ph", [("ts", "X"), ("dur", "X"), ("s", "i"), ("args", "M")])
def test_schema_rejects_an_event_missing_a_required_key(drop, ph):
    doc = to_perfetto(run_spans())
    validate(doc)
    broken = copy.deepcopy(doc)
    next(e for e in broken["traceEvents"] if e["ph"] == ph).pop(drop)
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_a_cycle_of_parents_is_still_shown():
    spans = [span("y1", "a", "y2", 0, 1, ORCH, 1), span("y2", "b", "y1", 0.5, 1, ORCH, 1)]
    roots = build_tree(spans)
    assert sorted(n.span["name"] for _, n in walk(roots)) == ["a", "b"]


def test_records_of_real_sdk_spans_render_and_validate():
    # The OTel SDK's own spans, stored as common.telemetry.span_record stores them.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Link, Status, StatusCode

    from common.telemetry import span_record

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": RANK1}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("trainer rank 0", attributes={"rank": 0, "attempt": 1}):
        with tracer.start_as_current_span("checkpoint stage 10") as stage:
            pass
        with tracer.start_as_current_span("upload 10", links=[Link(stage.get_span_context())]):
            pass
        with tracer.start_as_current_span("steps 1-2", attributes={
                "step_times_s": (0.5, 0.5), "first_step": 1, "last_step": 2}) as steps:
            steps.add_event("fault", {"kind": "oom", "step": 2, "evidence": "CUDA OOM"})
            steps.set_status(Status(StatusCode.ERROR, "OutOfMemoryError"))
    records = [span_record(s) for s in exporter.get_finished_spans()]
    (root,) = build_tree(records)
    assert names(root.children) == ["checkpoint stage 10", "upload 10", "steps 1-2"]
    text = tree_text(records, width=200)
    assert "⚡ fault oom step 2: CUDA OOM" in text and "✗ error: OutOfMemoryError" in text
    doc = to_perfetto(records)
    validate(json.loads(json.dumps(doc)))
    assert [e["ph"] for e in doc["traceEvents"]].count("s") == 1
