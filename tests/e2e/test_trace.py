"""The post-incident record, readable after the cluster that made it is gone: every real
fault as a `fault` event of its kind with its `recovered`, and one trace per run across
every process, read back from the durable store alone; the same for a run started with the
raw `temporal` CLI, whose spans also reach a real OTLP/HTTP receiver."""

from __future__ import annotations

import asyncio
import http.server
import json
import subprocess
import threading

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from activities.contracts import ORCHESTRATOR_QUEUE, WORKFLOW_TYPE
from ops.chaos import Chaos
from ops.cli import main
from ops.client import connect
from ops.services import find_binary
from ops.trace_view import TRACE_EVENT_SCHEMA
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from storage.spans import read_spans
from tests.e2e.runs import run_to_end, strike, tiny_spec, wait_for

pytestmark = pytest.mark.e2e

FAULTY = {
    # 2048 tokens a micro-batch: ~0.1 s steps at W=2, so a strike finds the step it aims for
    "train.procs_per_node": 2, "train.total_steps": 120, "train.segment_steps": 40,
    "train.micro_batch_tokens": 2048,
    "train.segments_per_run": 2, "train.checkpoint_every": 10, "sweep.enabled": False,
    "ops.hang_floor_s": 5.0, "ops.heartbeat_timeout_s": 8.0, "train.lr": 1e-2,
    "spikes.window": 20, "spikes.warmup": 10, "spikes.skip_window": 6,
    "spikes.skip_threshold": 4.0, "spikes.budget": {"rollbacks": 3, "per_steps": 1000},
    "faults": [{"kind": "kill_worker", "at_step": 15},
               {"kind": "corrupt_batches", "at_step": 100, "steps": 4}],
}


def committed(spec) -> int:
    steps = CheckpointStore(spec.storage.durable, spec.run_id).list_committed()
    return max(steps, default=0)


def recoveries(spec) -> int:
    return len(read_events(spec.storage.durable, spec.run_id, kinds=("recovered",)))


def by_id(spans: list[dict]) -> dict[str, dict]:
    return {s["span_id"]: s for s in spans}


def ancestors(span: dict, spans: dict[str, dict]) -> list[str]:
    """Names from `span` up to its root (a lost parent ends the chain)."""
    names = []
    while span is not None:
        names.append(span["name"])
        span = spans.get(span.get("parent_id") or "")
    return names


def assert_one_trace(spec) -> tuple[list[dict], str]:
    """Every stored span of the run carries one trace id; returns them and it. The root span
    is exported last (the worker's batch export runs every MAINSPRING_SPAN_FLUSH_MS)."""
    spans = wait_for(lambda: (got := read_spans(spec.storage.durable, spec.run_id)) and any(
        s["name"] == f"run {spec.run_id}" for s in got) and got, 30, "the run's root span")
    traces = {s["trace_id"] for s in spans}
    assert len(traces) == 1, {t: sorted({s["name"] for s in spans if s["trace_id"] == t})[:8]
                              for t in traces}
    return spans, traces.pop()


def fault_span_events(spec, kind: str, timeout_s: float = 30) -> set[str]:
    """The kinds of the `fault` events on the run's stored spans, once `kind` is among them
    (a span is stored when it ends and its worker's next export runs)."""
    def kinds() -> set[str]:
        return {ev["attributes"].get("kind") for s in read_spans(spec.storage.durable,
                                                                 spec.run_id)
                for ev in s["events"] if ev["name"] == "fault"}
    return wait_for(lambda: kind in (got := kinds()) and got, timeout_s,
                    f"a {kind} fault span event")


def assert_nested(spans: list[dict], run_id: str) -> None:
    """run -> stage train -> activity attempt -> trainer -> checkpoint stage, somewhere."""
    index = by_id(spans)
    chains = [ancestors(s, index) for s in spans if s["name"].startswith("checkpoint stage")]
    want = [f"run {run_id}", "stage train", "RunActivity:train_segment", "segment ",
            "trainer rank 0"]

    def level(chain: list[str], prefix: str) -> int:
        return next((i for i, name in enumerate(chain) if name.startswith(prefix)), -1)

    full = [c for c in chains if all(level(c, w) >= 0 for w in want)]
    assert full, chains[:3]
    levels = [level(full[0], w) for w in want]  # root last: deeper levels come first
    assert levels == sorted(levels, reverse=True), full[0]


# Soak: its claims are split over faster tests of the default suite, each on a run it makes
# anyway - every fault recovered with no human action: test_demo.py (worker_lost),
# test_drain.py (preempted), test_rank_faults.py (rank_lost and hang); each of those faults
# a span event where it was seen: the same tests; one trace across every process of a
# world-size-2 run on S3, its nesting, `mainspring trace`, --perfetto and `goodput`:
# test_rank_faults.py; the train stage's span across continue-as-new: this file's
# test_a_run_started_with_the_temporal_cli_is_one_trace_and_reaches_an_otlp_receiver; the
# rollback span event: test_demo.py.
@pytest.mark.soak
def test_a_faulted_w2_run_leaves_every_fault_recovery_and_one_trace_in_the_store(
        temporal_server, fleet_factory, tmp_path, s3_env, capsys):
    spec = tiny_spec("e2e-trace", "s3://mainspring/e2e-trace", str(tmp_path / "fast"), **FAULTY)
    fleet = fleet_factory(restart=True, env=s3_env)
    chaos = Chaos(worker_pid=lambda: fleet.procs["trainer"].pid,
                  durable=CheckpointStore(spec.storage.durable, spec.run_id),
                  fast_root=str(tmp_path / "fast" / spec.run_id))
    box: dict = {}
    runner = threading.Thread(target=lambda: box.update(
        result=asyncio.run(run_to_end(temporal_server.address, spec, timeout_s=900))))
    runner.start()
    # the injected worker kill at step 15 is recovered; then the worker is drained (SIGTERM)
    # later in the first segment (0-40), a rank is killed in the middle of the second
    # (40-80), and one hangs in the third (80-120): four kinds, no human action
    wait_for(lambda: recoveries(spec) >= 1, 300, "the first recovery")
    strike(chaos, spec, "drain_worker", (0, 40), (13, 34))
    wait_for(lambda: recoveries(spec) >= 2, 300, "the second recovery")
    strike(chaos, spec, "kill_rank", (40, 80), (43, 72))
    wait_for(lambda: recoveries(spec) >= 3, 300, "the third recovery")
    strike(chaos, spec, "hang", (80, 120), (83, 99))
    runner.join(900)
    result = box["result"]
    assert result["status"] == "completed" and result["workflow_runs"] >= 2

    events = read_events(spec.storage.durable, spec.run_id)
    real = [e for e in events if e["kind"] == "fault" and not e["payload"].get("injected")]
    kinds = sorted(e["payload"]["kind"] for e in real)
    assert kinds == ["hang", "preempted", "rank_lost", "worker_lost"], [e["payload"] for e in real]
    lost = next(e for e in real if e["payload"]["kind"] == "rank_lost")["payload"]
    assert lost["rank"] == 1 and lost["log_tail"] and lost["last_step"] is not None
    recovered = [e for e in events if e["kind"] == "recovered"]
    answered = {e["payload"]["fault_event_id"] for e in recovered}
    assert {e["event_id"] for e in real} <= answered, (answered, [e["event_id"] for e in real])
    for e in recovered:
        p = e["payload"]
        if p["fault_event_id"] in {f["event_id"] for f in real}:
            assert p["resumed_step"] is not None and p["mttr_s"] > 0, p
            assert p["detection_s"] is not None and p["restore_s"] is not None, p
    assert any(e["kind"] == "rollback" for e in events)

    spans, trace_id = assert_one_trace(spec)
    services = {s["service"] for s in spans}
    assert {"mainspring-worker-orchestrator", "mainspring-worker-data",
            "mainspring-worker-trainer", "mainspring-trainer",
            "mainspring-checkpoint-writer"} <= services, services
    assert {s["attributes"].get("rank") for s in spans if s["name"].startswith("trainer rank")} \
        == {0, 1}
    assert any(s["name"].startswith("upload ") and s["links"] for s in spans)
    assert_nested(spans, spec.run_id)
    # the train stage span began in the first workflow run and ended after continue-as-new
    train = [s for s in spans if s["name"] == "stage train"]
    assert len(train) == 1
    links = {s["attributes"].get("temporalRunID") for s in spans
             if s["name"] == "RunWorkflow:TrainingRun"}
    assert len(links) >= 2 and train[0]["attributes"]["workflow_run"] in links
    first_link_end = min(s["end_ns"] for s in spans if s["name"] == "RunWorkflow:TrainingRun")
    assert train[0]["end_ns"] > first_link_end
    # the faults are span events on the spans where they were seen
    span_events = [(s["name"], ev) for s in spans for ev in s["events"] if ev["name"] == "fault"]
    seen = {ev["attributes"].get("kind") for _, ev in span_events}
    assert {"hang", "preempted", "rank_lost", "worker_lost"} <= seen, span_events
    assert any(ev["name"] == "rollback" for s in spans for ev in s["events"])

    # `mainspring trace`: the tree names every fault; --perfetto passes the schema
    capsys.readouterr()
    assert main(["trace", spec.run_id, "--durable", spec.storage.durable]) == 0
    tree = capsys.readouterr().out
    for kind in ("hang", "preempted", "rank_lost", "worker_lost"):
        assert kind in tree
    perfetto = tmp_path / "trace.json"
    assert main(["trace", spec.run_id, "--durable", spec.storage.durable,
                 "--perfetto", str(perfetto)]) == 0
    import jsonschema

    jsonschema.validate(json.loads(perfetto.read_text()), TRACE_EVENT_SCHEMA)
    assert main(["goodput", spec.run_id, "--durable", spec.storage.durable, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < figures["train"]["goodput"] < 1
    assert set(figures["faults"]) >= {"hang", "preempted", "rank_lost", "worker_lost"}
    assert all(f["recovered"] == f["count"] for f in figures["faults"].values()), figures
    # zero human actions: no operator command, no hold
    assert not [e for e in events if e["kind"] in ("operator", "needs_attention", "paused")]


class OtlpReceiver(http.server.ThreadingHTTPServer):
    """A real OTLP/HTTP receiver: decodes each POST to /v1/traces with the protobuf
    definitions of the `opentelemetry-proto` package."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/v1/traces":
                    req = ExportTraceServiceRequest()
                    req.ParseFromString(body)
                    receiver.requests.append(req)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def spans(self) -> list[tuple[str, str, str]]:
        """(trace id, span name, service) of every span received."""
        return [(span.trace_id.hex(), span.name, service(rs)) for req in self.requests
                for rs in req.resource_spans for ss in rs.scope_spans for span in ss.spans]

    def trace_ids(self) -> set[str]:
        return {trace for trace, _, _ in self.spans()}


def service(resource_spans) -> str:
    return next((a.value.string_value for a in resource_spans.resource.attributes
                 if a.key == "service.name"), "")


@pytest.fixture
def receiver():
    """An OtlpReceiver serving until the test's workers are gone: requested before
    fleet_factory, it is torn down after it. (Shut down while they ran, each worker's last
    span export on its way out waited ~10 s for an answer that never came.)"""
    receiver = OtlpReceiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    yield receiver
    receiver.shutdown()
    receiver.server_close()


def test_a_run_started_with_the_temporal_cli_is_one_trace_and_reaches_an_otlp_receiver(
        receiver, temporal_server, fleet_factory, tmp_path):
    spec = tiny_spec("e2e-cli-trace", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **{"train.total_steps": 40, "train.segment_steps": 20,
                        "train.segments_per_run": 1, "sweep.enabled": False})
    fleet_factory(env={"OTEL_EXPORTER_OTLP_ENDPOINT":
                       f"http://127.0.0.1:{receiver.server_address[1]}"})
    # the README's command, with the real binary
    subprocess.run([find_binary("temporal"), "workflow", "start", "--address",
                    temporal_server.address, "--type", WORKFLOW_TYPE, "--task-queue",
                    ORCHESTRATOR_QUEUE, "--workflow-id", spec.run_id, "--id-reuse-policy",
                    "AllowDuplicateFailedOnly", "--input", json.dumps(spec.to_dict())],
                   check=True, capture_output=True, timeout=60)
    # an operator command from the raw CLI, which sends no trace context: it still joins
    # the run's trace (applied when training starts; a scale of 1 changes nothing)
    update = subprocess.run(
        [find_binary("temporal"), "workflow", "update", "execute", "--address",
         temporal_server.address, "--workflow-id", spec.run_id, "--name", "set_lr_scale",
         "--input", json.dumps({"scale": 1.0, "steps": 1, "who": "cli"})],
        capture_output=True, text=True, timeout=60)
    assert update.returncode == 0, update.stderr

    async def result() -> None:
        client = await connect(temporal_server.address)
        await asyncio.wait_for(client.get_workflow_handle(spec.run_id).result(), 600)

    asyncio.run(result())
    spans, trace_id = assert_one_trace(spec)
    assert_nested(spans, spec.run_id)
    train = [s for s in spans if s["name"] == "stage train"]
    assert len(train) == 1 and train[0]["end_ns"] > min(
        s["end_ns"] for s in spans if s["name"] == "RunWorkflow:TrainingRun")
    [command] = [s for s in spans if s["name"] == "operator set_lr_scale"]
    assert command["attributes"]["who"] == "cli" and command["trace_id"] == trace_id
    [event] = [e for e in read_events(spec.storage.durable, spec.run_id) if e["kind"] == "operator"]
    assert event["payload"]["span_id"] == command["span_id"]
    wait_for(lambda: trace_id in receiver.trace_ids(), 30, "the run's spans over OTLP")
    # besides the run's, only the raw update's own one-span traces (the plugin's, for a
    # sender with no trace context); the command's span links to its handler's
    others = [s for s in receiver.spans() if s[0] != trace_id]
    assert sorted(name for _, name, _ in others) == ["HandleUpdate:set_lr_scale",
                                                     "ValidateUpdate:set_lr_scale"], others
    handler = next(t for t, name, _ in others if name.startswith("HandleUpdate"))
    assert [link["trace_id"] for link in command["links"]] == [handler]
