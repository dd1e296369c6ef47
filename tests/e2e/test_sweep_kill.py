"""A trainer worker SIGKILLed with two sweep trials in flight: only those two rerun, each
with the same parameters, and the sweep's result equals an uninterrupted sweep's.

Real Temporal dev server, the real orchestrator worker (ops/worker.py: Sweep, suggest_trials,
record_event); the trainer queue is served by a separate worker process whose stand-in
trials score the known bowl of test_sweep_workflow.py. Every attempt of a trial's
train_segment and evaluate writes a marker (its input, its attempt, its worker's pid) when
it starts. The first trainer process holds trials 3 and 4 (round 1, both of its
`sweep.parallel` = 2 slots) heartbeating; once both markers exist it is SIGKILLed and a fresh
process takes the queue. Temporal retries the two lost attempts after their heartbeat
timeout: the spec's `ops.heartbeat_timeout_s`, 3 s here, so the test takes seconds.

What makes it hold (workflows/sweep.py): a trial's points come from the suggest_trials
local activity's recorded result, and a retried activity is the same scheduled activity
with the same input; the sampler's study is rebuilt from the workflow's records on every
round, so a lost attempt leaves no half-told trial in it.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Replayer, Worker

from activities.contracts import (
    EVALUATE,
    ORCHESTRATOR_QUEUE,
    TRAIN_SEGMENT,
    TRAINER_QUEUE,
    EvalPoint,
    EvaluateInput,
    EvaluateResult,
    SweepInput,
    SweepResult,
    TrainSegmentInput,
    TrainSegmentResult,
)
from common.procs import set_parent_death_signal
from ops.worker import build_workers
from spec import RunSpec, preset
from storage.events import read_events
from tests.e2e.test_sweep_workflow import bowl
from workflows.sweep import Sweep

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRIALS, HELD = 7, (3, 4)  # rounds of 3, 2, 2 trials: the kill lands in round 1


def trial_index(spec: dict) -> int:
    return int(spec["run_id"].rsplit("-", 1)[1])


def mark(markers: str, kind: str, spec: dict, inp: object) -> int:
    """Record this attempt (written before any work): what the kill test counts."""
    info = activity.info()
    index = trial_index(spec)
    path = os.path.join(markers, f"{kind}-{index}-{info.attempt}.json")
    with open(path + ".part", "w") as f:
        json.dump({"input": inp.__dict__, "attempt": info.attempt, "pid": os.getpid()}, f)
    os.replace(path + ".part", path)  # whole, for the test polling this directory
    return index


def stand_in_activities(markers: str, hold: tuple[int, ...]) -> list:
    @activity.defn(name=TRAIN_SEGMENT)
    async def train(inp: TrainSegmentInput) -> TrainSegmentResult:
        if mark(markers, "train", inp.spec, inp) in hold:
            # in flight until this process is killed; the deadline only ends a test gone wrong
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                activity.heartbeat()
                await asyncio.sleep(0.1)
            raise RuntimeError("the held trial was never killed")
        return TrainSegmentResult(final_step=inp.to_step, last_committed_step=inp.to_step,
                                  last_committed_uri="", train_loss=0.0, resumed_from=None,
                                  attempt=activity.info().attempt)

    @activity.defn(name=EVALUATE)
    async def evaluate(inp: EvaluateInput) -> EvaluateResult:
        mark(markers, "evaluate", inp.spec, inp)
        return EvaluateResult([EvalPoint(inp.steps[0], bowl(inp.spec["train"]), 0.0)])

    return [train, evaluate]


async def serve(address: str, markers: str, hold: tuple[int, ...]) -> None:
    """The trainer-queue worker process (run by `trainer_process`)."""
    client = await Client.connect(address)
    await Worker(client, task_queue=TRAINER_QUEUE,
                 activities=stand_in_activities(markers, hold)).run()


def trainer_process(address: str, markers: str, hold: tuple[int, ...] = ()) -> subprocess.Popen:
    code = ("import asyncio, sys\n"
            "from tests.e2e.test_sweep_kill import serve\n"
            "asyncio.run(serve(sys.argv[1], sys.argv[2], "
            "tuple(int(i) for i in sys.argv[3:])))\n")
    return subprocess.Popen([sys.executable, "-c", code, address, markers, *map(str, hold)],
                            cwd=REPO, preexec_fn=set_parent_death_signal)


def attempts(markers: str, kind: str) -> dict[int, list[dict]]:
    """Each trial's recorded attempts of `kind`, in attempt order."""
    found: dict[int, list[dict]] = {}
    for path in glob.glob(os.path.join(markers, f"{kind}-*.json")):
        with open(path) as f:
            seen = json.load(f)
        found.setdefault(trial_index(seen["input"]["spec"]), []).append(seen)
    return {i: sorted(found[i], key=lambda a: a["attempt"]) for i in sorted(found)}


async def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


def sweep_spec(run_id: str, store: str) -> RunSpec:
    return preset("demo", **{
        "run_id": run_id, "storage.durable": store, "train.min_lr": 1e-5,
        "ops.heartbeat_timeout_s": 3.0,  # how soon Temporal retries a lost trial's segment
        "sweep.trials": TRIALS, "sweep.parallel": 2, "sweep.space": {
            "lr": {"low": 1e-4, "high": 1e-1, "log": True},
            "weight_decay": {"low": 0.0, "high": 0.3, "log": False}}})


def outcome(result: SweepResult) -> list[tuple]:
    """A sweep's result without its trials' run ids (each sweep has its own)."""
    return [(t.params, t.val_loss, t.status, t.source, t.steps, t.distributions)
            for t in result.trials]


def test_sigkilled_trainer_reruns_only_its_two_trials_with_their_params_and_same_winner(
        temporal_server, tmp_path):
    killed_spec = sweep_spec("sweep-kill", str(tmp_path / "store-killed"))
    clean_spec = sweep_spec("sweep-kill-clean", str(tmp_path / "store-clean"))
    killed_marks, clean_marks = str(tmp_path / "killed"), str(tmp_path / "clean")
    os.makedirs(killed_marks)
    os.makedirs(clean_marks)
    procs: list[subprocess.Popen] = []

    async def sweep(client: Client, spec: RunSpec):
        return await client.execute_workflow(
            Sweep.run, SweepInput(spec.to_dict(), "file:///unused"), id=spec.run_id,
            task_queue=ORCHESTRATOR_QUEUE, execution_timeout=timedelta(minutes=3))

    async def scenario():
        client = await Client.connect(temporal_server.address)
        (orchestrator,) = build_workers(client, {"orchestrator"})
        async with orchestrator:
            procs.append(trainer_process(temporal_server.address, clean_marks))
            clean = await sweep(client, clean_spec)
            procs[-1].send_signal(signal.SIGTERM)
            procs[-1].wait(10)  # gone before the other sweep's trials are scheduled

            victim = trainer_process(temporal_server.address, killed_marks, HELD)
            procs.append(victim)
            run = asyncio.create_task(sweep(client, killed_spec))
            await wait_until(lambda: set(attempts(killed_marks, "train")) >= set(HELD) or
                             run.done(), 60, "both held trials in flight")
            in_flight = attempts(killed_marks, "train"), attempts(killed_marks, "evaluate")
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            procs.append(trainer_process(temporal_server.address, killed_marks))
            killed = await run
        history = await client.get_workflow_handle(killed_spec.run_id).fetch_history()
        await Replayer(workflows=[Sweep]).replay_workflow(history)  # raises if not replay-safe
        return clean, killed, in_flight, victim.pid

    try:
        clean, killed, in_flight, victim_pid = asyncio.run(scenario())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)

    # The kill landed with the two held trials started, once each, and neither scored.
    started, scored_then = in_flight
    assert sorted(started) == [0, 1, 2, *HELD] and sorted(scored_then) == [0, 1, 2]
    assert all(len(started[i]) == 1 for i in HELD)
    trained, scored = attempts(killed_marks, "train"), attempts(killed_marks, "evaluate")
    assert sorted(trained) == sorted(scored) == list(range(TRIALS))
    # Only the two in-flight trials ran again: once on the killed worker, once on the new.
    assert {i: [a["attempt"] for a in trained[i]] for i in trained} == {
        i: [1, 2] if i in HELD else [1] for i in range(TRIALS)}
    for i in HELD:
        first, rerun = trained[i]
        assert first["pid"] == victim_pid != rerun["pid"]
        # the very same input: the trial's point, its steps, its spec
        assert rerun["input"] == first["input"]
    assert all(len(scored[i]) == 1 for i in scored)  # each trial scored once

    # The sweep's outcome is the uninterrupted sweep's: every point, loss and the winner.
    assert outcome(killed) == outcome(clean)
    assert killed.best_params == clean.best_params
    clean_trained = attempts(clean_marks, "train")
    assert [trained[i][0]["input"]["spec"]["train"] for i in range(TRIALS)] == \
        [clean_trained[i][0]["input"]["spec"]["train"] for i in range(TRIALS)]
    # and its record: one sweep_trial event per trial, as the uninterrupted sweep's
    events = {e["event_id"]: e["payload"] for e in read_events(
        killed_spec.storage.durable, killed_spec.run_id, ("sweep_trial",))}
    assert sorted(events) == sorted(f"sweep_trial/{i}" for i in range(TRIALS))
    assert [events[f"sweep_trial/{i}"]["params"] for i in range(TRIALS)] == \
        [t.params for t in clean.trials]
