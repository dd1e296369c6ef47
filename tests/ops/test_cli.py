import asyncio
import json
import os
import socket
import subprocess
import sys
import uuid

import pytest

from ops.cli import main
from ops.services import _ephemeral_low, free_port
from spec import PRESETS
from tests.common.otlp import Collector

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_run_start_with_malformed_spec_exits_2_naming_the_field(tmp_path, capsys):
    spec = tmp_path / "bad.json"
    spec.write_text(json.dumps({"run_id": "x", "train": {"total_steps": -1}}))
    # The address is unreachable on purpose: validation must fail before any connection.
    assert main(["run", "start", "--spec", str(spec), "--address", "127.0.0.1:1"]) == 2
    assert "train.total_steps" in capsys.readouterr().err


def test_run_start_rejects_unknown_fields_and_bad_overrides(tmp_path, capsys):
    spec = tmp_path / "bad.json"
    spec.write_text(json.dumps({"run_id": "x", "modle": {}}))
    assert main(["run", "start", "--spec", str(spec), "--address", "127.0.0.1:1"]) == 2
    assert "modle" in capsys.readouterr().err
    assert main(["run", "start", "--preset", "demo", "--set", "train.lr=-1",
                 "--address", "127.0.0.1:1"]) == 2
    assert "train.lr" in capsys.readouterr().err


def test_unreadable_spec_file_is_named(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    assert main(["run", "start", "--spec", str(missing), "--address", "127.0.0.1:1"]) == 2
    assert str(missing) in capsys.readouterr().err


def test_dev_refuses_a_port_already_in_use(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["dev", "--port", str(port), "--headless",
                     "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"port {port} is already in use" in err and "--port" in err


def test_free_ports_stay_below_the_ephemeral_range():
    low = _ephemeral_low()
    assert all(free_port() < low for _ in range(20))
    assert all(free_port(10000) + 10000 < low for _ in range(20))


@pytest.mark.process
def test_bench_lists_the_scoreboard_scripts_and_runs_one_by_name(capsys):
    assert main(["bench"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert {"resume_exact", "packing", "gpu_check", "spikes"} <= listed
    assert "harness" not in listed  # a helper module has no __main__
    assert main(["bench", "no_such_figure"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'no_such_figure'" in err and "resume_exact" in err
    assert main(["bench", "dataprep", "--help"]) == 0  # arguments reach the script


def test_bench_json_lists_one_object_per_benchmark_with_its_path_and_first_line(capsys):
    assert main(["bench", "--json"]) == 0
    rows = {r["name"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert {"resume_exact", "packing", "gpu_check", "spikes"} <= set(rows)
    assert rows["packing"]["path"] == os.path.join(ROOT, "benchmarks", "packing.py")
    assert rows["packing"]["doc"] and not rows["packing"]["doc"].startswith(('"', "#"))


def test_run_list_queries_mainspring_runs_by_stage_and_status():
    from ops.cli_runs import list_query

    assert list_query(None, False) == "WorkflowType = 'TrainingRun'"
    assert list_query("needs_attention", True) == ("WorkflowType = 'TrainingRun' AND "
                                                   "MainspringStage = 'needs_attention' AND "
                                                   "ExecutionStatus = 'Running'")


@pytest.mark.e2e
def test_run_start_sends_the_client_span_to_the_spec_s_otlp_endpoint(temporal_server, tmp_path):
    # The StartWorkflow span is the root of the run's trace; no worker is needed to start.
    collector = Collector()
    run_id = f"otlp-{uuid.uuid4().hex[:8]}"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({**PRESETS["demo"], "run_id": run_id, "storage": {
        "durable": str(tmp_path / "store"), "fast": str(tmp_path / "fast")},
        "ops": {"otlp_endpoint": collector.address}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "ops.cli", "run", "start", "--spec", str(spec), "--address",
             temporal_server.address], capture_output=True, text=True, timeout=120, cwd=ROOT,
            env={**env, "MAINSPRING_SPANS_DIR": str(tmp_path / "spans")})
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.splitlines()[-1])["run_id"] == run_id
        assert [(svc, s.name) for svc, s in collector.spans()] == [
            ("mainspring-cli", "StartWorkflow:TrainingRun")]
        assert list((tmp_path / "spans").glob("cli-*.jsonl"))  # the local span file too
    finally:
        collector.close()
        asyncio.run(_terminate(temporal_server.address, run_id))


async def _terminate(address: str, run_id: str) -> None:
    from ops.client import connect

    await (await connect(address)).get_workflow_handle(run_id).terminate("test done")


def write_span_batches(store, run_id: str, spans: list[dict]) -> None:
    """Span records as the durable exporters store them: batch objects per writer, one
    span repeated in a second batch (a workflow task that ran twice)."""
    directory = store / "runs" / run_id / "spans"
    directory.mkdir(parents=True)
    half = len(spans) // 2
    for name, batch in (("worker-orchestrator-1-aa-000000", spans[:half + 1]),
                        ("trainer-2-bb-000000", spans[half:])):
        (directory / f"{name}.jsonl").write_text(
            "".join(json.dumps(s, sort_keys=True) + "\n" for s in batch))


def test_trace_prints_the_span_tree_with_fault_kinds_and_lost_parents(tmp_path, capsys,
                                                                      monkeypatch):
    from tests.ops.test_trace_view import TRACE, run_spans

    monkeypatch.setenv("COLUMNS", "200")
    write_span_batches(tmp_path / "store", "r1", run_spans())
    assert main(["trace", "r1", "--durable", str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out
    assert f"trace {TRACE} · {len(run_spans())} spans" in out
    assert "⚡ fault rank_lost step 25" in out and "⚡ fault hang step 30" in out
    assert out.count("(parent span lost)") == 4 and "\x1b[" not in out  # no colour in a pipe


def test_trace_json_and_perfetto_outputs(tmp_path, capsys):
    from tests.ops.test_trace_view import run_spans

    store = tmp_path / "store"
    write_span_batches(store, "r1", run_spans())
    assert main(["trace", "r1", "--durable", str(store), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["span_count"] == len(run_spans())  # the repeated span counted once
    assert [r["name"] for r in doc["roots"]] == ["run r1", "online_eval"]
    target = tmp_path / "r1.trace.json"
    assert main(["trace", "r1", "--durable", str(store), "--perfetto", str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    events = json.loads(target.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == len(run_spans())


def test_trace_of_a_run_without_spans_names_the_store_and_exits_1(tmp_path, capsys):
    from storage.events import EventLog
    from tests.ops.test_trace_view import run_spans

    store = tmp_path / "store"
    write_span_batches(store, "r1", run_spans())
    assert main(["trace", "nope", "--durable", str(store)]) == 1
    err = capsys.readouterr().err
    assert f"file://{store}/runs/nope/spans" in err and "runs with spans there: r1" in err
    assert "--durable" in err
    log = EventLog(str(store), "r2", "workflow")  # events but no spans: say which is missing
    log.emit("stage_started", {"stage": "train"}, step=0)
    log.flush()
    assert main(["trace", "r2", "--durable", str(store)]) == 1
    assert "though its event log is there" in capsys.readouterr().err


def write_goodput_record(store) -> None:
    """A run of 120 s: start-up 10 s, steps 1-40, a rank_lost fault, a 4 s restore, steps
    31-80 (31-40 replayed): 80 s productive (goodput 2/3), MTTR 14 s, 10 steps lost."""
    from tests.ops.test_trace_view import RANK1, T0, S, span

    def ev(event_kind: str, t: float, step: int | None = None, /, **payload) -> dict:
        return {"event_id": f"{event_kind}/{t}", "run_id": "r1", "kind": event_kind,
                "ts": T0 / S + t,
                "step": step, "attempt": 1, "trace_id": "", "writer": "w", "payload": payload}

    def steps(sid: str, first: int, last: int, t0: float) -> dict:
        n = last - first + 1
        return span(sid, f"steps {first}-{last}", None, t0, t0 + n, RANK1, 301, rank=0,
                    goodput=True, first_step=first, last_step=last, step_times_s=[1.0] * n,
                    skipped_steps=[])

    events = [ev("run_started", 0), ev("stage_started", 0, stage="train"),
              ev("fault", 50, 40, kind="rank_lost", evidence="rank 1 exited"),
              ev("recovered", 64, 30, mttr_s=14.0, lost_steps=10),
              ev("stage_finished", 115, stage="train"), ev("run_finished", 120)]
    (store / "runs" / "r1" / "events").mkdir(parents=True)
    (store / "runs" / "r1" / "events" / "workflow-1-aa-000000.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in events))
    write_span_batches(store, "r1", [
        span("g1", "startup", None, 0, 10, RANK1, 301, rank=0, badput="startup"),
        steps("g2", 1, 40, 10),
        span("g3", "restore", None, 60, 64, RANK1, 302, rank=0, badput="restore"),
        steps("g4", 31, 80, 64)])


def test_goodput_prints_productive_time_badput_by_cause_and_mttr_per_fault_kind(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    write_goodput_record(tmp_path / "store")
    assert main(["goodput", "r1", "--durable", str(tmp_path / "store")]) == 0
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]]
            for ln in capsys.readouterr().out.splitlines() if ln.count("│") >= 3}
    assert rows["productive"] == ["1m 20s", "66.7%"]
    assert rows["badput: replayed"] == ["10.00 s", "8.3%"]
    assert rows["badput: startup"] == ["10.00 s", "8.3%"]
    assert rows["badput: restore"] == ["4.00 s", "3.3%"]
    assert rows["wall"] == ["2m 00s", ""]
    assert rows["rank_lost"] == ["1", "1", "14.00 s", "14.00 s", "10"]


def test_goodput_json_is_one_object_and_a_missing_run_exits_1_naming_the_store(tmp_path,
                                                                              capsys):
    store = tmp_path / "store"
    write_goodput_record(store)
    assert main(["goodput", "r1", "--durable", str(store), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert round(out["goodput"], 6) == round(80 / 120, 6)
    assert round(out["badput_s"]["replayed"], 6) == 10.0
    assert out["faults"]["rank_lost"] == {"count": 1, "recovered": 1, "mttr_s_median": 14.0,
                                          "mttr_s_max": 14.0, "lost_steps": 10}
    assert main(["goodput", "nope", "--durable", str(store)]) == 1
    err = capsys.readouterr().err
    assert f"file://{store}/runs/nope/events" in err and "r1" in err
