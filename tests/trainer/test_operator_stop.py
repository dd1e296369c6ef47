"""Graceful stop and operator rollback in `python -m trainer.segment` (real DeepSpeed, CPU).

A stop (the supervisor's stop file, or SIGTERM as a preemption notice) ends the segment
after its current step with a checkpoint at that step and exit code 0, so a pause, an
operator rollback or a preemption loses no work. An operator rollback (`--rollback`)
uncommits the abandoned trajectory, restores the newest checkpoint at or before its step,
skips the data the abandoned steps read, and is applied once per id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.procs import request_stop
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.trainer.helpers import REPO, run_segment, tiny_spec, write_spec

pytestmark = pytest.mark.e2e


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def steps_seen(workdir: Path) -> list[int]:
    path = workdir / "progress.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [p["step"] for p in lines if p["type"] == "step"]


def start_line(workdir: Path) -> dict:
    lines = [json.loads(x) for x in (workdir / "progress.jsonl").read_text().splitlines()]
    return next(p for p in lines if p["type"] == "start")


def wait_until_step(proc: subprocess.Popen, workdir: Path, step: int, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"trainer exited early with {proc.returncode}"
        if steps_seen(workdir) and steps_seen(workdir)[-1] >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"trainer did not reach step {step} in {timeout}s")


def start(cmd: list[str], world_env: bool) -> subprocess.Popen:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    if not world_env:  # the rank process itself, no torchrun: it sets up world size 1
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def segment_args(spec: str, dataset: str, to_step: int, workdir: Path) -> list[str]:
    return ["-m", "trainer.segment", "--spec", spec, "--dataset", dataset,
            "--to-step", str(to_step), "--workdir", str(workdir)]


def assert_stopped_at_committed_step(proc: subprocess.Popen, workdir: Path, store: Path,
                                     every: int) -> int:
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-6000:]
    result = json.loads((workdir / "result.json").read_text())
    stopped = result["final_step"]
    assert result["outcome"]["stopped"] == "interrupted"
    assert 0 < stopped < 400 and steps_seen(workdir)[-1] == stopped
    committed = CheckpointStore(str(store), "t").list_committed()
    assert committed[-1] == stopped and result["last_committed_step"] == stopped
    # the stop step is not on the checkpoint schedule: the stop itself committed it
    assert stopped % every or stopped in committed
    return stopped


def test_stop_file_stops_both_ranks_at_one_committed_step_and_the_next_segment_resumes_there(
        tmp_path, dataset_uri):
    store, workdir = tmp_path / "store", tmp_path / "w"
    spec = write_spec(tiny_spec(store, **{"train.procs_per_node": 2, "train.zero_stage": 2,
                                          "train.total_steps": 400, "train.segment_steps": 400,
                                          "train.checkpoint_every": 200}), tmp_path / "s.json")
    workdir.mkdir()
    proc = start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node", "2", *segment_args(spec, dataset_uri, 400, workdir)],
                 world_env=True)
    wait_until_step(proc, workdir, 7)
    request_stop(str(workdir), "operator pause")
    stopped = assert_stopped_at_committed_step(proc, workdir, store, every=200)
    assert stopped % 200, "stopped on a scheduled checkpoint: the test would prove nothing"
    # the next segment (a new workdir, as after a pause) resumes at the stop step
    ok(run_segment(spec, dataset_uri, stopped + 2, tmp_path / "w2", world=2, attempt=2))
    assert start_line(tmp_path / "w2")["resumed_from"] == stopped


def test_sigterm_is_a_preemption_notice_the_rank_commits_and_exits_zero(tmp_path, dataset_uri):
    store, workdir = tmp_path / "store", tmp_path / "w"
    spec = write_spec(tiny_spec(store, **{"train.total_steps": 400, "train.segment_steps": 400,
                                          "train.checkpoint_every": 200}), tmp_path / "s.json")
    workdir.mkdir()
    proc = start([sys.executable, *segment_args(spec, dataset_uri, 400, workdir)],
                 world_env=False)
    wait_until_step(proc, workdir, 7)
    proc.send_signal(signal.SIGTERM)
    stopped = assert_stopped_at_committed_step(proc, workdir, store, every=200)
    assert stopped % 200


def test_operator_rollback_uncommits_later_steps_skips_their_data_and_applies_once(
        tmp_path, dataset_uri):
    store = tmp_path / "store"
    spec = write_spec(tiny_spec(store, **{"train.checkpoint_every": 4}), tmp_path / "s.json")
    ok(run_segment(spec, dataset_uri, 24, tmp_path / "w1"))
    ckpts = CheckpointStore(str(store), "t")
    assert ckpts.manifest(24).data_cursor == 24  # one batch per step, nothing skipped
    rollback = json.dumps({"id": "op-1", "to_step": 8, "through_step": 24, "skip_data": True,
                         "note": "bad shard", "who": "tester"})
    ok(run_segment(spec, dataset_uri, 24, tmp_path / "w2", attempt=1,
                   extra=("--rollback", rollback)))
    assert start_line(tmp_path / "w2")["resumed_from"] == 8
    assert steps_seen(tmp_path / "w2") == list(range(9, 25))  # steps 9..24 trained again
    # the abandoned steps' data (cursors 8..23) is skipped: step 24 now ends at cursor 40
    assert ckpts.manifest(24).data_cursor == 40
    assert [8, 24] in [list(r) for r in ckpts.manifest(24).skip_ranges]
    [event] = [e for e in read_events(str(store), "t", kinds=("rollback",))]
    p = event["payload"]
    assert (p["by"], p["to_step"], p["at_step"], p["skip"]) == ("operator", 8, 24, [8, 24])
    assert p["discarded"] == [12, 16, 20, 24] and p["note"] == "bad shard"
    # A retry of that segment (same rollback id) does not roll back again.
    ok(run_segment(spec, dataset_uri, 24, tmp_path / "w3", attempt=2,
                   extra=("--rollback", rollback)))
    assert steps_seen(tmp_path / "w3") == []
    assert ckpts.manifest(24).data_cursor == 40
    assert len(read_events(str(store), "t", kinds=("rollback",))) == 1
