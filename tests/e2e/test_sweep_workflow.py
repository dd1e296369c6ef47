"""The Sweep workflow's optuna rounds on the real Temporal server.

The orchestrator worker is the real one (ops/worker.py: Sweep with its suggest_trials and
record_event local activities); the trainer queue is served by a stand-in whose trials
score a known function, so the test can afford seven of them and tell which won. Whether
TPE learns from the trials is tests/sweep/test_suggest.py's (fourteen trials of a bowl). Real training through a sweep: test_training_run.py.
"""

from __future__ import annotations

import asyncio
import math
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
    TrainSegmentInput,
    TrainSegmentResult,
)
from ops.worker import build_workers
from spec import preset
from storage.events import read_events
from sweep.prior import prior_lr
from workflows.sweep import Sweep
from workflows.sweep_plan import trial_run_id

pytestmark = pytest.mark.e2e


def bowl(train: dict) -> float:
    """Held-out loss of a stand-in trial: a bowl lowest at lr 1e-2, weight decay 0.15,
    diverging (inf) above lr 1.5e-2 as a too-high learning rate does."""
    if train["lr"] > 1.5e-2:
        return math.inf
    return (math.log10(train["lr"]) + 2.0) ** 2 + 10.0 * (train["weight_decay"] - 0.15) ** 2


@activity.defn(name=TRAIN_SEGMENT)
async def stand_in_train(inp: TrainSegmentInput) -> TrainSegmentResult:
    return TrainSegmentResult(final_step=inp.to_step, last_committed_step=inp.to_step,
                              last_committed_uri="", train_loss=0.0, resumed_from=None,
                              attempt=activity.info().attempt)


@activity.defn(name=EVALUATE)
async def stand_in_evaluate(inp: EvaluateInput) -> EvaluateResult:
    return EvaluateResult([EvalPoint(inp.steps[0], bowl(inp.spec["train"]), 0.0)])


def test_sweep_rounds_start_at_the_prior_record_their_source_and_replay(temporal_server,
                                                                      tmp_path):
    spec = preset("demo", **{
        "run_id": "sweep-optuna", "storage.durable": str(tmp_path / "store"), "train.min_lr": 1e-5,
        "sweep.trials": 7, "sweep.parallel": 2, "sweep.space": {
            "lr": {"low": 1e-4, "high": 1e-1, "log": True},
            "weight_decay": {"low": 0.0, "high": 0.3, "log": False}}})

    async def scenario():
        # A plain client: ops.client.connect adds the OpenTelemetry plugin, whose workflow
        # side needs this process's tracer provider set up as a worker process does.
        client = await Client.connect(temporal_server.address)
        (orchestrator,) = build_workers(client, {"orchestrator"})
        trainer = Worker(client, task_queue=TRAINER_QUEUE,
                         activities=[stand_in_train, stand_in_evaluate])
        async with orchestrator, trainer:
            result = await client.execute_workflow(
                Sweep.run, SweepInput(spec.to_dict(), "file:///unused"), id=spec.run_id,
                task_queue=ORCHESTRATOR_QUEUE, execution_timeout=timedelta(minutes=3))
        history = await client.get_workflow_handle(spec.run_id).fetch_history()
        await Replayer(workflows=[Sweep]).replay_workflow(history)  # raises if not replay-safe
        return result

    result = asyncio.run(scenario())
    assert [t.run_id for t in result.trials] == [trial_run_id(spec.run_id, i) for i in range(7)]
    events = sorted(read_events(spec.storage.durable, spec.run_id, ("sweep_trial",)),
                    key=lambda e: int(e["event_id"].split("/")[1]))
    assert [e["payload"]["round"] for e in events] == [0, 0, 0, 1, 1, 2, 2]
    # trial 0 is the scaling-law prior, the rest optuna's TPE
    assert [e["payload"]["source"] for e in events] == ["prior"] + ["tpe"] * 6
    params = [e["payload"]["params"] for e in events]
    assert params[0]["lr"] == prior_lr(spec)
    assert len({tuple(sorted(p.items())) for p in params}) == 7
    losses = [e["payload"]["result"] for e in events]
    # Step Law's lr for the demo (6.9e-3) sits near the bowl's bottom: nothing the sampler
    # tried in six more trials beat it, and the lowest finite loss won.
    # a diverged trial's loss (inf) reads back from the record as null
    finite = [x for x in losses if x is not None]
    assert None in losses and losses[0] == min(finite)
    assert result.best_params == params[losses.index(min(finite))]
