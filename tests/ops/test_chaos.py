"""External faults (ops/chaos.py): finding trainer ranks, and each fault on real processes
and real checkpoint stores (the soak in benchmarks/goodput.py runs them on a full run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ops.chaos import Chaos, ProcInfo, cmdline_arg, corrupt_newest, rank_pids
from storage.checkpoints import CheckpointStore
from tests.storage.ckpt_helpers import save, tiered

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)

PY = sys.executable
LAUNCHER = (PY, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "trainer.segment",
            "--workdir", "/w")


def test_ranks_are_the_trainer_processes_with_a_rank_not_the_launcher_or_the_writer():
    procs = [ProcInfo(10, LAUNCHER),
             ProcInfo(11, (PY, "-u", "-m", "trainer.segment", "--workdir", "/w"), 0),
             ProcInfo(12, (PY, "-u", "-m", "trainer.segment", "--workdir", "/w"), 1),
             ProcInfo(13, (PY, "-m", "storage.tiered_writer", "{}"), 0)]
    assert rank_pids(procs) == {0: 11, 1: 12}
    assert rank_pids(procs[:1]) == {}


def test_cmdline_arg_reads_separate_and_joined_values():
    assert cmdline_arg(LAUNCHER, "--workdir") == "/w"
    assert cmdline_arg(LAUNCHER, "--nproc_per_node") == "2"
    assert cmdline_arg(LAUNCHER, "--spec") is None


@pytest.fixture
def fake_trainer(tmp_path):
    """A 'worker' process with two 'rank' children that look like trainer.segment ranks
    (RANK set, the module name on their command line) and a launcher-like sibling."""
    rank = "import time; time.sleep(60)"
    script = (f"RANK=0 {PY} -c '{rank}' -m trainer.segment --workdir {tmp_path} & "
              f"RANK=1 {PY} -c '{rank}' -m trainer.segment --workdir {tmp_path} & "
              f"{PY} -c '{rank}' torch.distributed.run -m trainer.segment & wait")
    worker = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    chaos = Chaos(worker_pid=lambda: worker.pid, durable=None, fast_root=str(tmp_path))
    deadline = time.monotonic() + 10
    while len(chaos.ranks()[0]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield worker, chaos
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    worker.wait()


def test_hang_stops_the_highest_rank_and_kill_rank_kills_it(fake_trainer):
    _, chaos = fake_trainer
    ranks, _ = chaos.ranks()
    assert sorted(ranks) == [0, 1]
    hung = chaos.apply("hang")
    assert hung["rank"] == 1 and hung["stopped"]
    victim = psutil.Process(ranks[1])  # held before the kill: the shell may reap it at once
    assert victim.status() == psutil.STATUS_STOPPED
    assert psutil.Process(ranks[0]).status() != psutil.STATUS_STOPPED
    killed = chaos.apply("kill_rank")
    assert killed["pid"] == ranks[1]
    victim.wait(5)  # reaped by the shell: gone (a Process made after that raised NoSuchProcess)
    assert not psutil.pid_exists(ranks[1]) and psutil.pid_exists(ranks[0])
    assert [r["kind"] for r in chaos.log] == ["hang", "kill_rank"]


def test_kill_worker_sigkills_the_worker(fake_trainer):
    worker, chaos = fake_trainer
    chaos.apply("kill_worker")
    assert worker.wait(5) == -signal.SIGKILL


def test_process_faults_with_no_segment_running_inject_nothing(tmp_path):
    idle = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"])
    try:
        chaos = Chaos(worker_pid=lambda: idle.pid, durable=None, fast_root=str(tmp_path))
        assert "skipped" in chaos.apply("kill_rank") and "skipped" in chaos.apply("hang")
        assert idle.poll() is None
    finally:
        idle.kill()
        idle.wait()


def test_corrupting_the_newest_checkpoint_on_both_tiers_makes_resume_fall_back(tmp_path):
    durable, fast_dir = str(tmp_path / "durable"), tmp_path / "fast"
    ckpt = tiered(durable, fast_dir)
    save(ckpt, 1, size=4096)
    save(ckpt, 2, size=4096)
    ckpt.drain()
    ckpt.close()
    stores = [CheckpointStore(durable, "r"), CheckpointStore.local(str(fast_dir))]
    assert 2 in stores[1].list_committed()
    hit = corrupt_newest(stores)
    # the largest file of step 2, on each tier
    optim = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert [(h["step"], h["file"]) for h in hit] == [(2, optim)] * 2
    assert [p.file for p in stores[0].verify(2)] == [optim]
    corrupt = []
    again = tiered(durable, fast_dir)
    man, _, _ = again.resume(str(tmp_path / "restore"), None, on_corrupt=corrupt.append)
    again.close()
    assert man.step == 1
    assert [c.step for c in corrupt] == [2, 2]  # the fast copy, then the durable one


def test_corrupt_checkpoint_hits_the_ranks_fast_dir_and_the_durable_tier(tmp_path):
    durable, fast_dir = str(tmp_path / "durable"), tmp_path / "fast" / "r" / "ckpt"
    ckpt = tiered(durable, fast_dir)
    save(ckpt, 1, size=4096)
    ckpt.drain()
    ckpt.close()
    rank = "import time; time.sleep(60)"
    args = f"-m trainer.segment --workdir {tmp_path}/w --fast-dir {fast_dir}"
    worker = subprocess.Popen(["sh", "-c", f"RANK=0 {PY} -c '{rank}' {args} & wait"],
                              start_new_session=True)
    try:
        chaos = Chaos(worker_pid=lambda: worker.pid, durable=CheckpointStore(durable, "r"),
                      fast_root=str(tmp_path / "elsewhere"))
        deadline = time.monotonic() + 10
        while not chaos.ranks()[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        record = chaos.apply("corrupt_checkpoint")
        assert worker.wait(10) is not None  # the rank was killed: the shell's wait returned
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    assert record["ranks"] == [0]
    assert sorted(h["url"] for h in record["corrupted"]) == sorted(
        [CheckpointStore(durable, "r").url, CheckpointStore.local(str(fast_dir)).url])
    assert [p.step for p in CheckpointStore.local(str(fast_dir)).verify(1)] == [1]


def test_s3_outage_stops_then_starts_the_server_after_the_given_time():
    calls = []
    chaos = Chaos(worker_pid=lambda: 0, durable=None, fast_root="",
                  s3_down=lambda: calls.append(("down", time.monotonic())),
                  s3_up=lambda: calls.append(("up", time.monotonic())))
    record = chaos.apply("s3_outage", seconds=0.3)
    assert [c[0] for c in calls] == ["down", "up"]
    assert calls[1][1] - calls[0][1] >= 0.3 and record["seconds"] == 0.3


def test_server_restart_restarts_the_temporal_server_after_the_given_time():
    calls = []

    def restart(down_s: float) -> None:  # TemporalDevServer.restart: stop, wait, start
        calls.append(("stop", time.time()))
        time.sleep(down_s)
        calls.append(("started", time.time()))
    chaos = Chaos(worker_pid=lambda: 0, durable=None, fast_root="", temporal_restart=restart)
    record = chaos.apply("server_restart", seconds=0.3)
    assert [c[0] for c in calls] == ["stop", "started"]
    assert record["seconds"] == 0.3 and record["down_s"] >= 0.3
    # the outage is over when the record comes back: restarted_ts is after the start
    assert record["ts"] <= calls[0][1] and record["restarted_ts"] >= calls[1][1]
    assert chaos.log == [record]


def test_server_restart_without_a_server_to_restart_injects_nothing():
    chaos = Chaos(worker_pid=lambda: 0, durable=None, fast_root="")
    assert "skipped" in chaos.apply("server_restart")
