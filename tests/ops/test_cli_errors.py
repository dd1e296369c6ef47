"""What a person can fix is one line on stderr, exit 1, no traceback:
an unknown run or namespace, a Temporal server nothing answers at, a run that has ended.
Against the real dev server (tests/conftest.py's temporal_server); no worker is needed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import pytest

from ops.cli import main
from ops.services import free_port

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# every `mainspring run` command that takes a run id, as a person types it
RUN_COMMANDS = {
    "status": ["run", "status", "{run}"],
    "watch": ["run", "watch", "{run}"],
    "pause": ["run", "pause", "{run}"],
    "resume": ["run", "resume", "{run}", "--note", "checked"],
    "rollback": ["run", "rollback", "{run}", "--to-step", "5"],
    "set-lr": ["run", "set-lr", "{run}", "--scale", "0.5"],
    "abort": ["run", "abort", "{run}", "--reason", "budget"],
}


def argv(name: str, run_id: str, *more: str) -> list[str]:
    return [a.format(run=run_id) for a in RUN_COMMANDS[name]] + list(more)


def the_one_line(capfd) -> str:
    """stderr (read at the file descriptor: the SDK's Rust core writes there too) is one
    line, and nothing anywhere is a traceback."""
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_run_status_of_an_unknown_run_is_one_line_naming_the_fix(temporal_server):
    # as a person runs it: the console entry in its own process, stderr as the terminal sees it
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "run", "status", "foo",
                           "--address", temporal_server.address],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"mainspring: no run 'foo' on namespace default at {temporal_server.address} — list "
        "runs with 'mainspring run list' (or pass the --address and --namespace it runs on)"]


@pytest.mark.parametrize("name", RUN_COMMANDS)
def test_every_run_command_on_an_unknown_run_is_one_line_naming_the_fix(name, temporal_server,
                                                                        capfd):
    run_id = f"no-such-run-{uuid.uuid4().hex[:6]}"
    assert main(argv(name, run_id, "--address", temporal_server.address)) == 1
    line = the_one_line(capfd)
    assert line.startswith(f"mainspring: no run '{run_id}' on namespace default at "
                           f"{temporal_server.address} — ")
    assert "'mainspring run list'" in line


UNREACHABLE = ("mainspring: cannot reach the Temporal server at {address} (Connection refused) "
               "— start one with 'mainspring dev' or pass --address (or set TEMPORAL_ADDRESS)")


@pytest.mark.parametrize("name", [*RUN_COMMANDS, "list"])
def test_every_run_command_without_a_server_is_one_line_naming_the_fix(name, capfd):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    args = ["run", "list"] if name == "list" else argv(name, "any-run")
    assert main([*args, "--address", address]) == 1
    assert the_one_line(capfd) == UNREACHABLE.format(address=address)


def test_run_start_without_a_server_is_one_line_naming_the_fix(tmp_path):
    # in its own process: `run start` sets up the process's tracing and logging first
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "run", "start", "--preset", "demo",
                           "--set", "run_id=unreachable-1",  # the spec is fine
                           "--set", f"storage.durable={tmp_path / 'store'}",
                           "--set", f"storage.fast={tmp_path / 'fast'}", "--address", address],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")})
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [UNREACHABLE.format(address=address)]


def test_an_unknown_namespace_is_told_apart_from_an_unknown_run(temporal_server, capfd):
    address = temporal_server.address
    for args in (["run", "list"], ["run", "status", "some-run"], ["run", "pause", "some-run"]):
        assert main([*args, "--address", address, "--namespace", "no-such-ns"]) == 1
        line = the_one_line(capfd)
        assert line.startswith(f"mainspring: no namespace 'no-such-ns' at {address} — pass "
                               "--namespace"), line
        assert "temporal operator namespace create --namespace no-such-ns" in line


def test_a_workflow_that_is_not_a_run_is_no_run(temporal_server, capfd):
    wf_id = f"not-a-run-{uuid.uuid4().hex[:6]}"
    asyncio.run(_start_and_terminate(temporal_server.address, wf_id, "SomethingElse"))
    assert main(["run", "status", wf_id, "--address", temporal_server.address]) == 1
    assert f"no run '{wf_id}'" in (line := the_one_line(capfd))
    assert "(it is a SomethingElse workflow, not a run)" in line


def test_operator_commands_and_watch_on_an_ended_run_say_it_ended_and_how_to_continue(
        temporal_server, capfd):
    run_id = f"ended-{uuid.uuid4().hex[:6]}"
    asyncio.run(_start_and_terminate(temporal_server.address, run_id, "TrainingRun"))
    for name in ("pause", "set-lr", "abort"):
        assert main(argv(name, run_id, "--address", temporal_server.address)) == 1
        line = the_one_line(capfd)
        assert line.startswith(f"mainspring: cannot {name} {run_id}: the run is terminated — ")
        assert "started again with the same spec ('mainspring run start')" in line
    assert main(argv("watch", run_id, "--address", temporal_server.address)) == 1
    line = the_one_line(capfd)
    assert line.startswith(f"mainspring: run '{run_id}' ended without completing: ")
    assert f"'mainspring events {run_id} --kind fault'" in line


async def _start_and_terminate(address: str, workflow_id: str, workflow_type: str) -> None:
    """A closed workflow of that type (no worker polls the queue: it never ran a task)."""
    from ops.client import connect

    client = await connect(address)
    handle = await client.start_workflow(workflow_type, {}, id=workflow_id,
                                         task_queue="test-cli-errors-nobody")
    await handle.terminate("test: an ended run")
