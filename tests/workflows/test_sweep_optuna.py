"""The Sweep child on the real dev server with the real suggest activity (optuna) and stub
trainers: trial 0 is the scaling-law prior, the same seed gives the same trials, and the
recorded history replays on today's code (the Replayer reuses the recorded suggestions).

With MAINSPRING_RECORD_HISTORIES=<label> the first sweep's history is written to
tests/workflows/histories/<label>/optuna.sweep.json, which test_replay.py replays too.
"""

from __future__ import annotations

import asyncio
import uuid

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Replayer

from activities.contracts import (
    SOURCE_PRIOR,
    SUGGEST_TRIALS,
    SWEEP_WORKFLOW_TYPE,
    SuggestInput,
    SuggestResult,
    SweepInput,
)
from activities.suggest import suggest_trials
from sweep.prior import prior_lr
from tests.workflows.stub_run import HISTORIES, RECORD, Harness, Stubs, spec_for
from workflows.sweep import Sweep
from workflows.training_run import TrainingRun

SPACE = {"lr": {"low": 1e-3, "high": 3e-2, "log": True},
         "weight_decay": {"low": 0.0, "high": 0.2, "log": False}}


class OptunaStubs(Stubs):
    """The stubs, but the sweep's suggestions come from the real activity."""

    @activity.defn(name=SUGGEST_TRIALS)
    async def suggest_trials(self, inp: SuggestInput) -> SuggestResult:
        return suggest_trials(inp)


async def one_sweep(h: Harness, spec) -> tuple[dict, object]:
    wf_id = f"{spec.run_id}-sweep-{uuid.uuid4().hex[:4]}"
    handle = await h.client.start_workflow(
        SWEEP_WORKFLOW_TYPE, SweepInput(spec.to_dict(), "file:///stub/data"), id=wf_id,
        task_queue=h.queue)
    result = await handle.result()
    return result, await handle.fetch_history()


def test_a_sweep_starts_at_the_prior_repeats_under_its_seed_and_replays(temporal_server):
    spec = spec_for(f"stub-optuna-{uuid.uuid4().hex[:6]}", **{
        "sweep.enabled": True, "sweep.trials": 5, "sweep.parallel": 2, "sweep.trial_steps": 4,
        "sweep.space": SPACE})

    async def go():
        client = await Client.connect(temporal_server.address)
        async with Harness(client, OptunaStubs()) as h:
            first, history = await one_sweep(h, spec)
            second, _ = await one_sweep(h, spec)
        replayed = await Replayer(workflows=[TrainingRun, Sweep]).replay_workflow(history)
        return first, second, history, replayed

    first, second, history, replayed = asyncio.run(asyncio.wait_for(go(), 60))
    trials = first["trials"]
    assert len(trials) == 5 and trials[0]["source"] == SOURCE_PRIOR
    assert trials[0]["params"]["lr"] == prior_lr(spec)  # inside [1e-3, 3e-2]
    assert all(t["source"] == "tpe" for t in trials[1:])
    assert all(1e-3 <= t["params"]["lr"] <= 3e-2 and 0 <= t["params"]["weight_decay"] <= 0.2
               for t in trials)
    assert len({t["params"]["lr"] for t in trials}) == 5  # no point asked twice
    assert [t["params"] for t in second["trials"]] == [t["params"] for t in trials]
    assert replayed.replay_failure is None
    if RECORD:
        out = HISTORIES / RECORD
        out.mkdir(parents=True, exist_ok=True)
        (out / "optuna.sweep.json").write_text(history.to_json())
