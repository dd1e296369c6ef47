"""Full five-stage runs on a real Temporal dev server with real worker processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import psutil
import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError

from ops.cli import main
from ops.client import connect
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.e2e.runs import assert_completed_five_stages, run_to_end, tiny_spec, wait_for

pytestmark = pytest.mark.e2e


# Soak: a shorter version of the demo's run (tests/e2e/test_demo.py: five stages, a sweep
# of two trials, the trainer worker SIGKILLed by an injected kill_worker and resumed from
# the last commit, continue-as-new between two segments, `mainspring trace` naming the
# fault, no checkpoint left on the fast tier), whose test checks these claims on the demo's
# record; `run status` of a finished run is checked by tests/e2e/test_spike_escalation.py.
@pytest.mark.soak
def test_five_stage_run_survives_injected_kill_and_continues_as_new(temporal_server,
                                                                     fleet_factory, tmp_path,
                                                                     capsys):
    spec = tiny_spec("e2e-file", str(tmp_path / "store"), str(tmp_path / "fast"),
                     faults=[{"kind": "kill_worker", "at_step": 25}])
    fleet = fleet_factory(restart=True)
    result = asyncio.run(run_to_end(temporal_server.address, spec))
    events = assert_completed_five_stages(result, spec)
    # Two segments with segments_per_run=1: the train stage continued-as-new once.
    assert result["workflow_runs"] == 2
    # The injected SIGKILL really killed the trainer worker; its replacement recovered.
    assert fleet.restarts == {"trainer": 1}
    injected = [e for e in events if e["kind"] == "fault" and e["payload"].get("injected")]
    seen = [e for e in events if e["kind"] == "fault" and not e["payload"].get("injected")]
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert len(injected) == 1 and injected[0]["payload"]["kind"] == "kill_worker"
    # what it caused, recorded by the next attempt: a lost worker, and its recovery
    assert [e["payload"]["kind"] for e in seen] == ["worker_lost"]
    assert len(recovered) == 1 and recovered[0]["payload"]["resumed_step"] == 20
    assert recovered[0]["payload"]["fault_event_id"] == seen[0]["event_id"]
    assert 0 < recovered[0]["payload"]["lost_steps"] <= spec.train.checkpoint_every

    async def first_run_status():
        client = await connect(temporal_server.address)
        runs = [r async for r in client.list_workflows(f"WorkflowId = '{spec.run_id}'")]
        return sorted(r.status for r in runs)

    statuses = asyncio.run(first_run_status())
    assert statuses == sorted([WorkflowExecutionStatus.CONTINUED_AS_NEW,
                               WorkflowExecutionStatus.COMPLETED])
    # `mainspring run status` reports the finished run through the workflow's query.
    capsys.readouterr()
    assert main(["run", "status", spec.run_id, "--address", temporal_server.address]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["workflow_status"] == "COMPLETED" and status["stage"] == "completed"
    assert status["step"] == spec.train.total_steps
    # the run's record, from the store alone: `mainspring trace` names the fault
    assert main(["trace", spec.run_id, "--durable", spec.storage.durable]) == 0
    assert "worker_lost" in capsys.readouterr().out
    trials = [e for e in events if e["kind"] == "sweep_trial"]
    assert len(trials) == 2 and trials[0]["payload"]["params"] != trials[1]["payload"]["params"]
    best = min(trials, key=lambda e: e["payload"]["result"])["payload"]["params"]
    assert result["best_params"] == best
    # The fast tier is a cache: no checkpoint of a finished run (or its trials) is left on
    # the trainer's local disk (every segment's checkpoints once stayed there forever);
    # the segments' small records stay until the machine's next collection.
    left = [d for d, _, _ in os.walk(tmp_path / "fast") if os.path.basename(d).startswith("step-")]
    assert left == [] and not (tmp_path / "fast" / spec.run_id / "ckpt").exists()
    assert list((tmp_path / "fast" / spec.run_id / "segments").glob("*/progress.jsonl"))


def _trainer_child_pids(worker_pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(worker_pid).children(recursive=True)]


# Soak: the same fault as test_five_stage_run_survives_injected_kill_and_continues_as_new
# (its injected kill_worker is a SIGKILL of the trainer worker, trainer/faults.py), which
# asserts the resume from the last commit, the lost steps within one interval and no commit
# lost; on S3 (SeaweedFS) the worker kill of test_trace.py's faulted run covers it.
@pytest.mark.soak
def test_sigkilled_trainer_worker_is_replaced_and_resumes_from_last_commit(
        temporal_server, fleet_factory, tmp_path, s3_env):
    # On S3 (SeaweedFS) too: checkpoints and events live on the real S3 gateway.
    spec = tiny_spec("e2e-kill-s3", "s3://mainspring/e2e", str(tmp_path / "fast"),
                     **{"train.total_steps": 120, "train.segment_steps": 60})
    fleet = fleet_factory(env=s3_env)
    store = CheckpointStore(spec.storage.durable, spec.run_id)

    async def scenario() -> dict:
        client = await connect(temporal_server.address)
        from ops.client import start_run

        await start_run(client, spec)
        # Wait until the first train segment has committed past step 0 and is still running.
        wait_for(lambda: (store.latest_committed() or 0) >= 20, 300, "a mid-segment commit")
        committed_before = store.list_committed()
        worker_pid = fleet.procs["trainer"].pid
        children = _trainer_child_pids(worker_pid)
        assert children, "the trainer worker should be supervising a child"
        os.kill(worker_pid, signal.SIGKILL)
        wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                 for p in children), 30, "trainer children to die with the worker")
        fleet.spawn("trainer")  # the replacement, as a process manager would start it
        result = await asyncio.wait_for(client.get_workflow_handle(spec.run_id).result(), 600)
        return {"result": result, "committed_before": committed_before}

    out = asyncio.run(scenario())
    assert_completed_five_stages(out["result"], spec)
    after = store.list_committed()
    assert set(out["committed_before"]) <= set(after), "a committed checkpoint was lost"
    recovered = [e for e in read_events(spec.storage.durable, spec.run_id)
                 if e["kind"] == "recovered"]
    assert recovered, "the retry must record its recovery"
    # It resumed from the newest checkpoint committed before (or just at) the kill.
    resumed = recovered[0]["payload"]["resumed_step"]
    assert resumed >= max(out["committed_before"])
    # Lost work is about one checkpoint interval: the writer process commits every snapshot
    # on the fast tier a moment after submit, even while earlier ones still upload. Half an
    # interval of slack covers a kill between a submit and that fast commit.
    bound = spec.train.checkpoint_every + spec.train.checkpoint_every // 2
    assert recovered[0]["payload"]["lost_steps"] <= bound, recovered[0]["payload"]


def test_malformed_spec_fails_at_once_naming_the_field(temporal_server, fleet_factory, tmp_path):
    fleet_factory(roles=("orchestrator",))  # the workflow refuses it: no activity runs
    spec = tiny_spec("e2e-bad", str(tmp_path / "store"), str(tmp_path / "fast"))

    async def start_raw(raw: dict) -> Exception:
        client = await connect(temporal_server.address)
        handle = await client.start_workflow("TrainingRun", raw, id=raw["run_id"],
                                             task_queue="mainspring-orchestrator")
        with pytest.raises(WorkflowFailureError) as info:
            await asyncio.wait_for(handle.result(), 60)
        return info.value.cause

    bad = spec.to_dict()
    bad["train"]["total_steps"] = -3
    cause = asyncio.run(start_raw(bad))
    assert cause.type == "BadConfig" and "train.total_steps" in cause.message

    unknown = spec.to_dict() | {"run_id": "e2e-bad-2", "colour": "blue"}
    assert "colour" in asyncio.run(start_raw(unknown)).message


def test_unreadable_corpus_fails_the_run_without_retrying(temporal_server, fleet_factory,
                                                         tmp_path):
    fleet_factory(roles=("orchestrator", "data"))  # the run ends in data prep
    missing = str(tmp_path / "no-such-corpus" / "*.txt")
    spec = tiny_spec("e2e-nocorpus", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **{"data.corpus": missing})

    async def scenario():
        client = await connect(temporal_server.address)
        from ops.client import start_run

        handle = await start_run(client, spec)
        with pytest.raises(WorkflowFailureError) as info:
            await asyncio.wait_for(handle.result(), 120)
        history = await handle.fetch_history()
        started = [e for e in history.events if e.HasField("activity_task_started_event_attributes")]
        return info.value.cause, started

    cause, started = asyncio.run(scenario())
    activity_error = cause.cause  # ActivityError -> ApplicationError
    assert activity_error.type == "BadData" and "no-such-corpus" in activity_error.message
    assert len(started) == 1 and started[0].activity_task_started_event_attributes.attempt == 1
