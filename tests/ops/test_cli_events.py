"""`mainspring events RUN [--kind K]... [--json] [--follow]` on a real event log written
through storage/events.py's EventLog (no Temporal involved)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from ops.cli import main
from storage.events import EventLog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def append(store, run_id: str, *events: tuple[str, int | None, dict]) -> None:
    """Each call is one batch object, as a writer's flush puts it."""
    with EventLog(str(store), run_id, "test") as log:
        for kind, step, payload in events:
            log.emit(kind, payload, step=step)


def cli(*args: str) -> subprocess.CompletedProcess:
    """`mainspring ...` in a fresh process, as a person or a script runs it (`events` and
    `report` set up logging for the whole process: stderr, so stdout is only their output)."""
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def test_events_of_an_unknown_run_is_one_line_naming_the_store_and_exits_1(tmp_path):
    store = tmp_path / "store"
    append(store, "r1", ("run_started", None, {}))
    proc = cli("events", "nope", "--durable", str(store))
    assert proc.returncode == 1 and proc.stdout == "" and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith(
        f"mainspring events: run_id: no events for run 'nope' under file://{store}/runs/nope/"
        "events (runs with an event log there: r1). Fix: pass a run id from")
    assert "--durable" in proc.stderr


def test_trace_goodput_and_report_of_an_unknown_run_are_one_line_naming_the_store(tmp_path,
                                                                                 capsys):
    store = tmp_path / "store"
    append(store, "r1", ("run_started", None, {}))
    capsys.readouterr()
    results = []
    for command in ("trace", "goodput"):
        code = main([command, "nope", "--durable", str(store)])
        results.append((command, code, *capsys.readouterr()))
    proc = cli("report", "nope", "--durable", str(store), "--out", str(tmp_path / "out"))
    results.append(("report", proc.returncode, proc.stdout, proc.stderr))
    for command, code, out, err in results:
        assert code == 1 and out == "" and len(err.splitlines()) == 1, (command, err)
        assert err.startswith(f"mainspring {command}: run_id: no ") and "Traceback" not in err
        assert f"file://{store}/runs/nope/" in err and "Fix: " in err and "--durable" in err


def test_events_json_is_one_object_per_line_of_each_kind_asked_for(tmp_path):
    store = tmp_path / "store"
    append(store, "r1", ("run_started", None, {}), ("fault", 40, {"kind": "rank_lost"}),
           ("train_metrics", 40, {"loss_mean": float("nan")}),
           ("recovered", 30, {"lost_steps": 10}))
    proc = cli("events", "r1", "--durable", str(store), "--kind", "fault", "--kind",
               "recovered", "--json")
    assert proc.returncode == 0 and proc.stderr == ""
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["kind"], r["step"], r["payload"]) for r in rows] == [
        ("fault", 40, {"kind": "rank_lost"}), ("recovered", 30, {"lost_steps": 10})]
    assert {"event_id", "ts", "run_id", "writer", "attempt"} <= set(rows[0])
    # strict JSON for scripts: a non-finite number is null, never a bare NaN
    proc = cli("events", "r1", "--durable", str(store), "--kind", "train_metrics", "--json")
    assert json.loads(proc.stdout)["payload"] == {"loss_mean": None}
    # without --json: the person's line, time, step, kind and payload
    line = cli("events", "r1", "--durable", str(store), "--kind", "fault").stdout.strip()
    assert line.endswith('step=40 fault                {"kind": "rank_lost"}') and line[2] == ":"


def test_a_damaged_batch_is_warned_of_on_stderr_and_stdout_stays_json(tmp_path):
    store = tmp_path / "store"
    append(store, "r1", ("run_started", None, {}))
    (store / "runs" / "r1" / "events" / "torn-000000.jsonl").write_bytes(b'{"kind": "fau')
    proc = cli("events", "r1", "--durable", str(store), "--json")
    assert proc.returncode == 0
    kinds = [json.loads(line)["kind"] for line in proc.stdout.splitlines()]
    assert sorted(kinds) == ["event_log_damaged", "run_started"]
    assert "event_line_unreadable" in proc.stderr


def test_an_asked_kind_the_log_lacks_is_named_with_the_kinds_there(tmp_path):
    store = tmp_path / "store"
    append(store, "r1", ("run_started", None, {}), ("fault", 3, {}))
    proc = cli("events", "r1", "--durable", str(store), "--kind", "faults")
    assert proc.returncode == 0 and proc.stdout == ""
    assert proc.stderr == ("mainspring events: no faults events in run 'r1' (kinds there: "
                           "fault, run_started)\n")


class Follower:
    """`mainspring events --follow` in its own process, its output read as it comes."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "events", *args, "--follow", "--poll-s", "0.2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put)),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self.err.append))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, put) -> None:
        for line in stream:
            put(line)

    def next(self, timeout: float = 30.0) -> dict:
        return json.loads(self.lines.get(timeout=timeout))

    def quiet(self, for_s: float) -> bool:
        """Nothing more is printed for `for_s` seconds."""
        try:
            line = self.lines.get(timeout=for_s)
        except queue.Empty:
            return True
        raise AssertionError(f"unexpected line: {line}")

    def stderr_shows(self, text: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while text not in "".join(self.err):
            assert time.monotonic() < deadline and self.proc.poll() is None, self.err
            time.sleep(0.1)
        return "".join(self.err)

    def end(self, timeout: float = 30.0) -> tuple[int, str]:
        code = self.proc.wait(timeout)
        for reader in self.readers:
            reader.join(timeout)
        return code, "".join(self.err)

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.end()


def test_follow_prints_appended_events_of_the_kinds_asked_as_json_until_sigint(tmp_path):
    store = tmp_path / "store"
    append(store, "r1", ("run_started", None, {}), ("fault", 5, {"kind": "hang"}))
    with Follower("r1", "--durable", str(store), "--kind", "fault", "--kind", "recovered",
                  "--json") as tail:
        first = tail.next()  # what was there before it started
        assert (first["kind"], first["payload"]) == ("fault", {"kind": "hang"})
        append(store, "r1", ("train_metrics", 10, {"loss_mean": 2.5}))
        append(store, "r1", ("recovered", 4, {"lost_steps": 1}),
               ("fault", 12, {"kind": "rank_lost"}))
        assert [(e["kind"], e["step"]) for e in (tail.next(), tail.next())] == [
            ("recovered", 4), ("fault", 12)]
        assert tail.quiet(1.0)  # train_metrics was appended too, and filtered out
        tail.proc.send_signal(signal.SIGINT)
        code, err = tail.end()
    assert code == 0 and err == ""  # no traceback, no KeyboardInterrupt


def test_follow_stops_by_itself_when_the_run_finishes_whatever_kinds_it_shows(tmp_path):
    store = tmp_path / "store"
    with Follower("r1", "--durable", str(store), "--kind", "fault", "--json") as tail:
        err = tail.stderr_shows("waiting for them")  # a log not there yet: it says so, waits
        assert err.startswith("mainspring events: run 'r1' has no events under ")
        append(store, "r1", ("run_started", None, {}), ("fault", 3, {"kind": "crash"}))
        assert tail.next()["payload"] == {"kind": "crash"}
        assert tail.proc.poll() is None  # still following: the run goes on
        append(store, "r1", ("run_finished", None, {"status": "completed"}))
        code, _ = tail.end()
    assert code == 0 and tail.lines.empty()  # run_finished ended it, though not shown


def test_follow_of_a_finished_run_prints_its_log_and_exits(tmp_path):
    store = tmp_path / "store"
    append(store, "r1", ("run_started", None, {}), ("run_finished", None, {"status": "aborted"}))
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "events", "r1", "--durable",
                           str(store), "--follow", "--json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stderr == ""
    assert [json.loads(line)["kind"] for line in proc.stdout.splitlines()] == [
        "run_started", "run_finished"]
