"""Operator commands through the real workflow, workers and trainer (DESIGN §6): a command
stops the running segment at a committed step with no lost work; pause holds the run;
rollback and set-lr sent while paused take effect on resume; a rollback the run had not
reached is recorded as not applied; refusals are clear; abort ends the run at a checkpoint."""

from __future__ import annotations

import asyncio
import json

import pytest
from temporalio.client import WorkflowFailureError

from ops.cli import main
from ops.client import connect, start_run
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from storage.rollback import pinned_steps
from tests.e2e.runs import tiny_spec, wait_for
from trainer.engine import lr_at

pytestmark = pytest.mark.e2e

OPERATED = {
    # long segments: a command reaches the trainer within a heartbeat interval (the SDK
    # throttles heartbeats to 0.8 x timeout), and an unloaded machine runs ~20 steps/s
    "train.total_steps": 2000, "train.segment_steps": 1000, "train.segments_per_run": 4,
    "train.checkpoint_every": 10, "sweep.enabled": False, "faults": [],
    "ops.stop_grace_s": 60.0,
}


def test_pause_rollback_set_lr_resume_and_abort_lose_no_committed_work(
        temporal_server, fleet_factory, tmp_path, capsys):
    spec = tiny_spec("e2e-operator", str(tmp_path / "store"), str(tmp_path / "fast"), **OPERATED)
    fleet_factory()
    address = temporal_server.address
    store = CheckpointStore(spec.storage.durable, spec.run_id)

    def cli(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([*argv, "--address", address])
        out = capsys.readouterr()
        return code, out.out, out.err

    def status() -> dict:
        code, out, err = cli("run", "status", spec.run_id)
        assert code == 0, err
        return json.loads(out)

    def events(kind: str) -> list[dict]:
        return [e["payload"] for e in read_events(spec.storage.durable, spec.run_id, (kind,))]

    asyncio.run(_start(address, spec))
    wait_for(lambda: any(s >= 20 for s in store.list_committed()), 300, "step 20 committed")

    # a rollback admitted against the running segment's end (step 1000) that the run has
    # not reached when the segment stops: recorded as not applied, training goes on
    code, out, err = cli("run", "rollback", spec.run_id, "--to-step", "999")
    assert code == 0, err
    [moot] = wait_for(lambda: events("operator"), 120, "the rollback to be applied")
    first_stop = int(moot["why_not"].split("at step ")[1].split(",")[0])
    assert moot["applied"] is False and 20 <= first_stop < 999
    assert first_stop in store.list_committed() and not events("rollback")
    wait_for(lambda: max(store.list_committed()) > first_stop, 180, "training to go on")

    # pause: the segment stops at its next step, commits it, and the run waits
    code, out, err = cli("run", "pause", spec.run_id, "--reason", "inspect shard 3",
                         "--who", "alice")
    assert code == 0, err
    assert json.loads(out)["applies"] == "at the running segment's next step"
    paused = wait_for(lambda: (s := status())["stage"] == "paused" and s, 120, "the pause")
    stopped_at = paused["step"]
    assert first_stop < stopped_at < first_stop + 1000 and stopped_at in store.list_committed()
    assert paused["needs_attention"] == "inspect shard 3"
    assert not events("recovered") and not events("fault")  # a graceful stop, not a crash
    def listed_paused() -> list[dict]:
        code, out, _ = cli("run", "list", "--stage", "paused", "--running")
        return [json.loads(line) for line in out.splitlines()] if code == 0 else []
    [row] = wait_for(listed_paused, 30, "the paused run in `mainspring run list`")
    assert (row["run_id"], row["stage"], row["status"]) == (spec.run_id, "paused", "RUNNING")
    [pause_event] = events("paused")
    assert pause_event["reason"] == "inspect shard 3" and pause_event["who"] == "alice"
    assert max(store.list_committed()) == stopped_at  # nothing trains while paused

    # refusals name what is wrong; a refused update leaves the run as it was
    code, _, err = cli("run", "rollback", spec.run_id, "--to-step", str(stopped_at + 50))
    assert code == 1 and f"not before the run's step {stopped_at}" in err
    code, _, err = cli("run", "pause", spec.run_id)
    assert code == 1 and "already paused" in err
    code, _, err = cli("run", "set-lr", spec.run_id, "--scale", "0")
    assert code == 1 and "scale must be a number in (0, 10]" in err

    # while paused: roll back to step 10 skipping the abandoned data, halve the LR; resume
    assert cli("run", "rollback", spec.run_id, "--to-step", "10", "--note", "bad shard")[0] == 0
    assert cli("run", "set-lr", spec.run_id, "--scale", "0.5")[0] == 0
    held = status()
    assert held["stage"] == "paused" and held["step"] == 10
    assert held["pending_rollback"]["through_step"] == stopped_at
    assert held["lr_windows"] == [[10, 2000, 0.5]]
    # the admitted rollback's target is pinned against retention until a segment applied
    # it; the moot one's pin was released when it turned out moot
    assert pinned_steps(store) == {10}
    assert cli("run", "resume", spec.run_id, "--note", "shard 3 dropped")[0] == 0

    # the trainer applied the rollback: checkpoints after 10 uncommitted, data skipped
    [rolled] = wait_for(lambda: events("rollback"), 180, "the operator rollback event")
    assert (rolled["by"], rolled["to_step"], rolled["at_step"]) == ("operator", 10, stopped_at)
    assert rolled["discarded"][-1] == stopped_at and rolled["note"] == "bad shard"
    per_step = spec.train.grad_accum
    assert rolled["skip"] == [10 * per_step, stopped_at * per_step]
    wait_for(lambda: any(s >= 120 for s in store.list_committed()), 300, "step 120 committed")
    assert [10 * per_step, stopped_at * per_step] in \
        [list(r) for r in store.manifest(max(store.list_committed())).skip_ranges]

    # abort: the segment stops at a committed step and the run fails as RunAborted
    assert cli("run", "abort", spec.run_id, "--reason", "budget cut")[0] == 0
    with pytest.raises(WorkflowFailureError) as failure:
        asyncio.run(_result(address, spec.run_id))
    assert failure.value.cause.type == "RunAborted" and "budget cut" in str(failure.value.cause)
    [finished] = events("run_finished")
    assert pinned_steps(store) == frozenset()  # released once the segment that applied it ended
    assert finished["status"] == "aborted" and finished["reason"] == "budget cut"
    assert finished["step"] in store.list_committed() and finished["step"] >= 120
    commands = [e["command"] for e in events("operator")]
    assert commands == ["rollback", "pause", "rollback", "set_lr_scale", "abort"]
    resumed = events("run_resumed")
    assert resumed[0]["note"] == "shard 3 dropped"

    # the halved LR reached the trainer: every step after the rollback ran at half the LR
    ran = [json.loads(line) for f in (tmp_path / "fast").glob("*/segments/*/progress.jsonl")
           for line in f.read_text().splitlines()]
    after = [p for p in ran if p["type"] == "step" and p["lr"] < lr_at(p["step"] - 1, spec.train)]
    assert after and all(p["lr"] == pytest.approx(lr_at(p["step"] - 1, spec.train) * 0.5)
                         for p in after)
    assert min(p["step"] for p in after) == 11

    # nothing left to operate on
    code, _, err = cli("run", "pause", spec.run_id)
    assert code == 1 and "cannot pause" in err


async def _start(address: str, spec) -> None:
    await start_run(await connect(address), spec)


async def _result(address: str, run_id: str):
    client = await connect(address)
    return await asyncio.wait_for(client.get_workflow_handle(run_id).result(), 300)
