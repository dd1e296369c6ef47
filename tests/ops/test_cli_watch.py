"""`run watch`, `run status`, `run list` for people and scripts: the progress snapshot and
its three views (rich bar on a terminal, plain lines elsewhere, JSON lines), and the
commands against a real run (the dev server, an orchestrator worker, the demo spec: the run
waits in prepare_data, as no data worker is up)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from rich.console import Console

from common.procs import WorkerFleet
from ops.cli import main
from ops.cli_output import PlainView, RichView, print_status, print_table, progress_view, snapshot
from ops.client import connect, localize, start_run
from spec import preset
from storage.events import EventLog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ev(event_kind: str, step: int | None = None, /, **payload) -> dict:
    return {"event_id": f"{event_kind}/{step}/{len(payload)}", "run_id": "r1", "kind": event_kind,
            "ts": 0.0, "step": step, "payload": payload}


STATUS = {"run_id": "r1", "stage": "train", "step": 100, "total_steps": 160,
          "train_loss": 3.5, "needs_attention": None}
EVENTS = [ev("fault", 40, kind="kill_worker", injected=True),
          ev("fault", 40, kind="worker_lost", injected=False), ev("recovered", 20),
          ev("checkpoint_committed", 120), ev("train_metrics", 120, loss_mean=2.3456,
                                              tokens_per_s=12345.0)]


def test_the_snapshot_takes_the_newest_metrics_window_and_counts_faults_apart_from_injections():
    p = snapshot(STATUS, EVENTS)
    # the query's step moves at segment ends; the window at each commit, so it is later
    assert (p["stage"], p["step"], p["total_steps"], p["committed"]) == ("train", 120, 160, 120)
    assert (p["loss"], p["tokens_per_s"]) == (2.3456, 12345.0)
    assert (p["faults"], p["injected"], p["recovered"], p["events"]) == (1, 1, 1, 5)
    # a window older than the query's step does not speak for it; a NaN loss is null
    p = snapshot({**STATUS, "step": 140, "train_loss": float("nan")}, EVENTS)
    assert (p["step"], p["loss"]) == (140, None)


def test_the_rich_view_draws_stage_step_bar_eta_loss_tokens_per_s_and_faults():
    now = [0.0]
    view = RichView(Console(file=io.StringIO()), get_time=lambda: now[0])
    view.show(snapshot({**STATUS, "step": 100}, EVENTS[:3]))
    now[0] = 10.0
    view.show(snapshot(STATUS, EVENTS))  # 20 steps in 10 s: 40 to go, 20 s
    screen = Console(file=io.StringIO(), width=140, force_terminal=True, color_system=None)
    screen.print(view.progress.get_renderable())
    text = screen.file.getvalue()
    assert "train" in text and "120/160" in text and "eta 00:20" in text
    assert "━" in text  # the bar
    assert "loss 2.346 · 12.3k tok/s · faults 1 (1 injected) · recovered 1" in text


def test_off_a_terminal_progress_is_a_plain_line_when_it_changes_and_json_with_json():
    out = io.StringIO()
    view = progress_view(out)
    assert isinstance(view, PlainView)  # a StringIO, a pipe, a CI log: not a terminal
    for _ in range(3):
        view.show(snapshot(STATUS, EVENTS))
    view.waiting("RPCError")
    assert out.getvalue().splitlines() == [
        "stage=train         step=120/160 committed=120 loss=2.346 tok/s=12345 faults=1 "
        "injected=1 recovered=1 events=5", "(waiting: RPCError)"]
    out = io.StringIO()
    view = progress_view(out, as_json=True)
    view.show(snapshot(STATUS, EVENTS))
    view.show(snapshot(STATUS, EVENTS))  # no change: no update
    view.waiting("RPCError")  # a failed query is no update either
    [line] = out.getvalue().splitlines()
    row = json.loads(line)
    assert row["kind"] == "progress" and row["step"] == 120 and row["tokens_per_s"] == 12345.0


def test_the_terminal_tables_of_run_list_and_status_show_only_what_says_something():
    out = io.StringIO()
    print_table([{"run_id": "r1", "status": "RUNNING", "stage": "train", "step": 120,
                  "loss": 2.34567, "started": "2026-01-01T00:00:00+00:00"}], out)
    header, row = out.getvalue().splitlines()
    assert header.split() == ["run_id", "status", "stage", "step", "loss", "started"]
    assert row.split() == ["r1", "RUNNING", "train", "120", "2.346", "2026-01-01T00:00:00+00:00"]
    out = io.StringIO()
    print_table([], out)
    assert out.getvalue() == "no runs\n"
    out = io.StringIO()
    print_status({"run_id": "r1", "stage": "paused", "needs_attention": None,
                  "evals": {"40": 3.2}, "lr_windows": [], "step": 40}, out)
    assert [line.strip().split(maxsplit=1) for line in out.getvalue().splitlines()] == [
        ["run_id", "r1"], ["stage", "paused"], ["evals", '{"40": 3.2}'], ["step", "40"]]


# ---- against a real run -----------------------------------------------------------------

@pytest.fixture(scope="module")
def orchestrator(temporal_server, tmp_path_factory):
    fleet = WorkerFleet(temporal_server.address, roles=("orchestrator",),
                        log_dir=str(tmp_path_factory.mktemp("watch-logs")), restart=False).start()
    yield temporal_server.address
    fleet.stop()


@pytest.fixture
def run(orchestrator, tmp_path):
    """A started run (in prepare_data: no data worker), terminated after the test."""
    spec = localize(preset("demo", run_id=f"watch-{uuid.uuid4().hex[:6]}", **{
        "storage.durable": str(tmp_path / "store"), "storage.fast": str(tmp_path / "fast")}))
    asyncio.run(_start(orchestrator, spec))
    yield spec
    asyncio.run(_terminate(orchestrator, spec.run_id))


async def _start(address: str, spec) -> None:
    await start_run(await connect(address), spec)


async def _terminate(address: str, run_id: str) -> None:
    from temporalio.service import RPCError

    try:
        await (await connect(address)).get_workflow_handle(run_id).terminate("test done")
    except RPCError:  # it has ended already
        pass


class Cli:
    """A `mainspring` command in its own process, its output read as it comes."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "ops.cli", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=ROOT)
        self.out: queue.Queue[str] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        self.readers = [threading.Thread(target=self._read, args=(s, q)) for s, q in
                        ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, into: queue.Queue) -> None:
        for line in stream:
            into.put(line.rstrip("\n"))

    def until(self, lines: queue.Queue, claim, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if claim(line):
                return line

    def end(self, timeout: float = 60.0) -> tuple[int, list[str], list[str]]:
        code = self.proc.wait(timeout)
        for reader in self.readers:
            reader.join(timeout)
        return code, list(self.out.queue), list(self.err.queue)


def wait_for_stage(address: str, run_id: str, capsys) -> dict:
    deadline = time.monotonic() + 60
    while True:
        capsys.readouterr()
        assert main(["run", "status", run_id, "--address", address, "--json"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 1  # --json: one object, one line
        status = json.loads(lines[0])
        if status.get("stage") == "prepare_data" or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


@pytest.mark.e2e
def test_run_status_and_list_json_are_one_object_per_line(orchestrator, run, capsys):
    status = wait_for_stage(orchestrator, run.run_id, capsys)
    assert (status["run_id"], status["workflow_status"], status["stage"]) == (
        run.run_id, "RUNNING", "prepare_data")
    assert status["total_steps"] == run.train.total_steps
    assert main(["run", "list", "--running", "--address", orchestrator, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {"run_id": run.run_id, "status": "RUNNING", "stage": "prepare_data"}.items() <= \
        next(r for r in rows if r["run_id"] == run.run_id).items()


@pytest.mark.e2e
def test_run_watch_json_is_a_line_per_update_then_one_line_when_the_run_ends(orchestrator,
                                                                              run, capsys):
    wait_for_stage(orchestrator, run.run_id, capsys)
    watch = Cli("run", "watch", run.run_id, "--address", orchestrator, "--json")
    try:
        first = json.loads(watch.until(watch.out, lambda line: True))
        assert (first["kind"], first["run_id"], first["stage"], first["step"]) == (
            "progress", run.run_id, "prepare_data", 0)
        # what the trainer's metrics forwarder and a fault would append meanwhile
        with EventLog(run.storage.durable, run.run_id, "test") as log:
            log.emit("fault", {"kind": "worker_lost", "injected": False}, step=7)
            log.emit("train_metrics", {"loss_mean": 4.25, "tokens_per_s": 900.0}, step=10)
        update = json.loads(watch.until(watch.out, lambda line: '"step": 10' in line))
        assert (update["loss"], update["tokens_per_s"], update["faults"]) == (4.25, 900.0, 1)
        asyncio.run(_terminate(orchestrator, run.run_id))
        code, out, err = watch.end()
    finally:
        watch.proc.kill()
    assert code == 1 and all(json.loads(line)["kind"] == "progress" for line in out)
    assert len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith(f"mainspring: run '{run.run_id}' ended without completing: ")


@pytest.mark.e2e
def test_run_watch_off_a_terminal_prints_plain_lines_and_ctrl_c_stops_only_the_watching(
        orchestrator, run, capsys):
    wait_for_stage(orchestrator, run.run_id, capsys)
    watch = Cli("run", "watch", run.run_id, "--address", orchestrator)
    try:
        line = watch.until(watch.err, lambda line: True)
        assert line.startswith("stage=prepare_data  step=0/240 committed=None loss=None")
        watch.proc.send_signal(signal.SIGINT)
        code, out, err = watch.end()
    finally:
        watch.proc.kill()
    assert code == 0 and out == []
    assert err[-1] == "mainspring: stopped watching; the run goes on"
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in err)
    assert main(["run", "status", run.run_id, "--address", orchestrator, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workflow_status"] == "RUNNING"


@pytest.mark.e2e
def test_run_watch_on_a_terminal_draws_the_rich_step_bar(orchestrator, run, capsys):
    import pty
    import select

    wait_for_stage(orchestrator, run.run_id, capsys)
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "run", "watch", run.run_id,
                             "--address", orchestrator], stdout=subprocess.PIPE,
                            stderr=follower, cwd=ROOT, env={**os.environ, "COLUMNS": "140"})
    os.close(follower)
    screen, deadline = b"", time.monotonic() + 60
    try:
        while b"recovered 0" not in screen and time.monotonic() < deadline:
            if select.select([leader], [], [], 1.0)[0]:
                screen += os.read(leader, 4096)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        os.close(leader)
    text = screen.decode(errors="replace")
    assert "\x1b[" in text  # drawn with a terminal's control sequences, not plain lines
    assert "prepare_data" in text and "0/240" in text and "eta" in text
    assert "loss – · – tok/s · faults 0 · recovered 0" in text
    assert "stage=" not in text
