"""Tiered async checkpointing: the loop only waits for the fast tier, progress hears of a
checkpoint only once it is durable, a slow uploader applies bounded backpressure, and the
hashing/upload run in a separate low-priority process that dies with the trainer."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from common.errors import BadConfig
from storage.checkpoints import MANIFEST, CheckpointStore
from storage.events import EventLog, read_events
from storage.tiered import CheckpointWriterFailed
from storage.tiered_writer import WRITER_NICE
from tests.storage.ckpt_helpers import save, tiered


@pytest.fixture
def stall():
    """Freeze a checkpointer's writer process (SIGSTOP: a stalled uploader); thawed after."""
    frozen: list[int] = []

    def freeze(ckpt) -> None:
        os.kill(ckpt.writer_pid, signal.SIGSTOP)
        frozen.append(ckpt.writer_pid)
    yield freeze
    for pid in frozen:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGCONT)


@pytest.mark.process
def test_save_returns_before_the_upload_and_commit_is_reported_only_once_durable(
        tmp_path, stall):
    ckpt = tiered(str(tmp_path / "durable"), tmp_path / "fast", max_in_flight=4)
    seen = []
    ckpt.on_commit = lambda man, uri: seen.append(
        (man.step, ckpt.durable.fs.exists(ckpt.durable.path(man.step, MANIFEST))))
    stall(ckpt)
    t0 = time.perf_counter()
    save(ckpt, 1)
    pause = time.perf_counter() - t0
    time.sleep(0.5)
    assert pause < 0.3 and seen == [] and ckpt.in_flight() == [1]
    assert ckpt.durable.list_committed() == []
    os.kill(ckpt.writer_pid, signal.SIGCONT)
    ckpt.drain()
    ckpt.close()
    assert seen == [(1, True)]  # reported after, never before, the durable manifest


@pytest.mark.process
def test_a_slow_uploader_makes_the_loop_wait_and_says_so(tmp_path, stall):
    url = str(tmp_path / "durable")
    ckpt = tiered(url, tmp_path / "fast", max_in_flight=1, events=EventLog(url, "r", "t"))
    stall(ckpt)
    save(ckpt, 1)
    threading.Timer(0.5, os.kill, (ckpt.writer_pid, signal.SIGCONT)).start()
    waited = save(ckpt, 2)  # one snapshot in flight at most: wait for step 1's upload
    assert waited > 0.4 and ckpt.in_flight() == [2]
    ckpt.drain()
    ckpt.close()
    ckpt.events.flush()
    back = read_events(url, "r", kinds=("checkpoint_backpressure",))
    assert [(e["step"], e["payload"]["max_in_flight"]) for e in back] == [(2, 1)]
    assert back[0]["payload"]["waited_s"] >= 0.4


@pytest.mark.process
def test_parent_chain_follows_the_saves(tmp_path):
    ckpt = tiered(str(tmp_path / "durable"), tmp_path / "fast")
    for step in (0, 4, 8):
        save(ckpt, step)
    ckpt.drain()
    ckpt.close()
    assert [ckpt.durable.manifest(s).parent for s in (0, 4, 8)] == [None, 0, 4]
    assert ckpt.durable.manifest(8).tokens_seen == 80 and ckpt.committed == [0, 4, 8]


class StallingProxy:
    """A TCP relay in front of the real S3 gateway whose traffic can be held (a stuck link)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.flowing = target, threading.Event()
        self.flowing.set()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.server.close()


def test_snapshots_queued_behind_a_stuck_upload_are_resumable_from_the_fast_tier_at_once(
        tmp_path, s3_env, monkeypatch):
    host, port = s3_env["AWS_ENDPOINT_URL"].split("://")[1].split(":")
    proxy = StallingProxy((host, int(port)))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    url = f"s3://mainspring/tests/stuck-{os.getpid()}-{time.time_ns()}"
    ckpt = tiered(url, tmp_path / "fast", max_in_flight=3)
    proxy.flowing.clear()  # step 1's upload hangs on the link
    for step in (1, 2, 3):
        save(ckpt, step)
    deadline = time.monotonic() + 20
    while ckpt.fast.list_committed() != [1, 2, 3]:
        assert time.monotonic() < deadline, ckpt.fast.list_committed()
        time.sleep(0.05)
    assert ckpt.in_flight() == [1, 2, 3] and ckpt.committed == []
    proxy.flowing.set()
    ckpt.drain(timeout_s=60)
    ckpt.close()
    proxy.close()
    assert CheckpointStore(url, "r").list_committed() == [1, 2, 3]


@pytest.mark.process
def test_an_upload_error_that_is_not_an_outage_stops_the_writer_and_the_loop_hears_of_it(
        tmp_path):
    blocked = tmp_path / "durable"
    blocked.write_text("a file where the durable directory should be")
    ckpt = tiered(str(blocked), tmp_path / "fast")
    save(ckpt, 1)
    with pytest.raises(CheckpointWriterFailed) as failed:
        ckpt.drain(timeout_s=30)
    ckpt.close()
    assert failed.value.step == 1 and "NotADirectory" in failed.value.error
    assert ckpt.fast.list_committed() == [1]  # still resumable locally


@pytest.mark.process
def test_a_dead_writer_process_fails_the_next_submit_instead_of_losing_saves(tmp_path):
    ckpt = tiered(str(tmp_path / "durable"), tmp_path / "fast")
    save(ckpt, 1)
    ckpt.drain()
    os.kill(ckpt.writer_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    with pytest.raises(CheckpointWriterFailed) as failed:
        while time.monotonic() < deadline:
            save(ckpt, 2)
            time.sleep(0.1)
    ckpt.close()
    assert failed.value.exit_code == -signal.SIGKILL
    assert ckpt.durable.list_committed() == [1] and ckpt.durable.verify(1) == []


OWNER = """
import sys, time
from tests.storage.ckpt_helpers import tiered
ckpt = tiered(sys.argv[1], sys.argv[2])
print(ckpt.writer_pid, flush=True)
time.sleep(60)
"""


@pytest.mark.process
def test_the_writer_is_a_low_priority_process_that_dies_with_the_training_process(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "d"),
                              str(tmp_path / "f")], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    pid = next(line for line in owner.stdout if line.strip().isdigit())  # structlog shares stdout
    writer = psutil.Process(int(pid))
    deadline = time.monotonic() + 10
    while writer.nice() != WRITER_NICE:  # it lowers its own priority as it starts
        assert time.monotonic() < deadline, writer.nice()
        time.sleep(0.05)
    assert writer.ppid() == owner.pid
    owner.kill()  # SIGKILL: no cleanup code runs in the owner
    owner.wait()
    writer.wait(timeout=10)  # gone (PR_SET_PDEATHSIG), not orphaned
    assert not psutil.pid_exists(writer.pid) or writer.status() == psutil.STATUS_ZOMBIE


def test_a_memory_durable_tier_is_refused_naming_the_field(tmp_path):
    with pytest.raises(BadConfig) as bad:  # the writer process could never see it
        tiered("memory://in-one-process", tmp_path / "fast")
    assert bad.value.field == "storage.durable"
