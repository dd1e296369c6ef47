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


def test_bench_lists_the_scoreboard_scripts_and_runs_one_by_name(capsys):
    assert main(["bench"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert {"resume_exact", "packing", "gpu_check", "spikes"} <= listed
    assert "harness" not in listed  # a helper module has no __main__
    assert main(["bench", "no_such_figure"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'no_such_figure'" in err and "resume_exact" in err
    assert main(["bench", "dataprep", "--help"]) == 0  # arguments reach the script


def test_run_list_queries_mainspring_runs_by_stage_and_status():
    from ops.cli import list_query

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
