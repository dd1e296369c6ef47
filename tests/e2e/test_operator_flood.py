"""An operator command flood through the real TrainingRun workflow on the real Temporal dev
server: a burst stops a running segment once; a paused run flooded with
hundreds of updates continues as new while it stays paused, loses no accepted command,
keeps its LR windows bounded and correct, still takes `resume`, and reaches the end.

The orchestrator worker is the real one (ops/worker.py: TrainingRun with the real
record_event activity writing to a tmp file store). The data and trainer queues are served
by stand-ins: the claim under test is the workflow's behaviour, not the trainer's. The
stand-in train_segment heartbeats until it is cancelled, as the real supervisor does, and
records the input each segment got (its LR windows, its operator rollback).
"""

from __future__ import annotations

import asyncio
import math

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.common import SearchAttributeKey
from temporalio.worker import Replayer, Worker

from activities.contracts import (
    DATA_QUEUE,
    EVALUATE,
    PREPARE_DATA,
    PROMOTE,
    TRAIN_SEGMENT,
    TRAINER_QUEUE,
    EvalPoint,
    EvaluateInput,
    EvaluateResult,
    PrepareDataInput,
    PrepareDataResult,
    PromoteInput,
    PromoteResult,
    TrainSegmentInput,
    TrainSegmentResult,
)
from ops.client import start_run
from ops.worker import build_workers
from spec import preset
from storage.events import read_events
from workflows.lr_windows import MAX_LR_WINDOWS
from workflows.training_run import TrainingRun

pytestmark = pytest.mark.e2e

STOPPED_AT, OLDEST, TOTAL = 60, 20, 200  # the first segment stops at 60; retention left 20
SCALES, STEPS = (0.5, 2.0, 0.8, 1.25, 1.1), (0, 5, 15)
SEGMENTS: list[TrainSegmentInput] = []
CANCELS: list[int] = []


@activity.defn(name=TRAIN_SEGMENT)
async def stand_in_train(inp: TrainSegmentInput) -> TrainSegmentResult:
    SEGMENTS.append(inp)
    stop = inp.to_step
    if inp.from_step == 0:  # the first segment trains until an operator command stops it
        try:
            while True:
                activity.heartbeat()
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            CANCELS.append(inp.from_step)
            stop = STOPPED_AT
    return TrainSegmentResult(final_step=stop, last_committed_step=stop, last_committed_uri="",
                              train_loss=1.0, resumed_from=inp.from_step,
                              attempt=activity.info().attempt, oldest_committed_step=OLDEST,
                              stopped="interrupted" if stop < inp.to_step else "")


@activity.defn(name=PREPARE_DATA)
async def stand_in_prepare(inp: PrepareDataInput) -> PrepareDataResult:
    return PrepareDataResult("file:///unused/MANIFEST.json", True, 1, 1, 1, 512)


@activity.defn(name=EVALUATE)
async def stand_in_evaluate(inp: EvaluateInput) -> EvaluateResult:
    return EvaluateResult([EvalPoint(s, 5.0 - s / 100, 0.0) for s in inp.steps])


@activity.defn(name=PROMOTE)
async def stand_in_promote(inp: PromoteInput) -> PromoteResult:
    return PromoteResult(inp.step, "file:///unused/promoted", 0)


def factor_at(windows: list[list[float]], step: int) -> float:
    """The LR factor at `step` (trainer/segment.py:lr_scale)."""
    return math.prod(f for start, end, f in windows if start < step <= end)


def test_a_flooded_paused_run_continues_as_new_stays_bounded_and_still_resumes(
        temporal_server, tmp_path):
    spec = preset("demo", **{
        "run_id": "operator-flood", "storage.durable": str(tmp_path / "store"),
        "storage.fast": str(tmp_path / "fast"), "train.total_steps": TOTAL,
        "storage.scrub_every": 0,  # its stub data worker serves no scrub
        "train.segment_steps": 100, "train.segments_per_run": 10, "train.warmup_steps": 5,
        "train.checkpoint_every": 10, "sweep.enabled": False, "faults": [],
        "ops.heartbeat_timeout_s": 1.0})
    SEGMENTS.clear()
    CANCELS.clear()
    expected: list[list[float]] = []  # every accepted set_lr_scale as [start, end, factor]

    def lr_args(i: int) -> dict:
        return {"scale": SCALES[i % len(SCALES)], "steps": STEPS[i % len(STEPS)],
                "who": "flood"}

    def expect(i: int, step: int) -> None:
        steps = STEPS[i % len(STEPS)]
        expected.append([step, min(step + steps, TOTAL) if steps else TOTAL,
                         SCALES[i % len(SCALES)]])

    async def scenario() -> tuple:
        client = await Client.connect(temporal_server.address)
        (orchestrator,) = build_workers(client, {"orchestrator"})
        data = Worker(client, task_queue=DATA_QUEUE,
                      activities=[stand_in_prepare, stand_in_promote])
        trainer = Worker(client, task_queue=TRAINER_QUEUE,
                         activities=[stand_in_train, stand_in_evaluate])
        async with orchestrator, data, trainer:
            first = await start_run(client, spec)
            handle = client.get_workflow_handle(spec.run_id)  # follows continue-as-new

            async def update(name: str, args) -> dict | BaseException:
                try:
                    return await handle.execute_update(name, args)
                except WorkflowUpdateFailedError as exc:
                    return exc

            while not (await handle.query("status"))["segment_running"]:
                await asyncio.sleep(0.1)
            # a burst while the segment runs: one cancel, all apply at the step it stops at
            burst = await asyncio.gather(*(update("set_lr_scale", lr_args(i)) for i in range(6)),
                                         update("pause", {"reason": "flood test"}))
            assert all(isinstance(r, dict) for r in burst), burst
            while (await handle.query("status"))["stage"] != "paused":
                await asyncio.sleep(0.1)
            assert CANCELS == [0] and len(SEGMENTS) == 1
            for i in range(6):
                expect(i, STOPPED_AT)

            # the flood while paused: 7 set_lr_scale + a refused pause per batch (Temporal
            # takes 10 updates in flight), a rollback every 10 batches
            step, accepted, i = STOPPED_AT, 7, 6
            for batch in range(75):
                if batch % 10 == 9:
                    step -= 5
                    assert isinstance(await update("rollback", {"to_step": step}), dict)
                    accepted += 1
                answers = await asyncio.gather(
                    *(update("set_lr_scale", lr_args(i + k)) for k in range(7)),
                    update("pause", None))
                assert all(isinstance(r, dict) for r in answers[:7]), answers
                assert "already paused" in str(answers[7].cause)
                for k in range(7):
                    expect(i + k, step)
                i, accepted = i + 7, accepted + 7
            refused = await update("rollback", {"to_step": OLDEST - 10})
            held = await handle.query("status")
            desc = await handle.describe()
            resumed = await handle.execute_update("resume", {"note": "flood over"})
            result = await asyncio.wait_for(handle.result(), 60)
            histories = [await client.get_workflow_handle(spec.run_id, run_id=run).fetch_history()
                         for run in (first.run_id, None)]
        for history in histories:  # raises if the workflow code does not replay its histories
            await Replayer(workflows=[TrainingRun]).replay_workflow(history)
        return step, accepted, refused, held, desc, resumed, result

    step, accepted, refused, held, desc, resumed, result = asyncio.run(
        asyncio.wait_for(scenario(), 180))

    assert "the oldest step you can roll back to is 20" in str(refused.cause)
    # it continued as new while paused, and the continued run is paused everywhere
    assert held["stage"] == "paused" and held["needs_attention"] == "flood test"
    assert held["workflow_runs"] >= 3, held["workflow_runs"]  # ~540 updates, 200 per run
    assert desc.typed_search_attributes.get(SearchAttributeKey.for_keyword("MainspringStage")) \
        == "paused"
    assert resumed["reason_was"] == "flood test"
    assert result["status"] == "completed" and result["final_step"] == TOTAL
    assert result["workflow_runs"] >= held["workflow_runs"]
    # no accepted command was lost across continue-as-new: each has its operator event
    ops = [e["payload"] for e in read_events(spec.storage.durable, spec.run_id, ("operator",))]
    assert len(ops) == accepted == len({o["id"] for o in ops}) and all(o["applied"] for o in ops)
    # after resume: one segment from the earliest rollback target, skipping through step 60,
    # its LR windows few (bounded) and giving every step the product of the commands' factors
    resumed_segment = SEGMENTS[1]
    assert (resumed_segment.from_step, resumed_segment.rollback.to_step,
            resumed_segment.rollback.through_step) == (step, step, STOPPED_AT)
    windows = resumed_segment.lr_windows
    assert 0 < len(windows) <= 24 <= MAX_LR_WINDOWS, windows
    assert len(expected) == 6 + 75 * 7
    for t in (step + 1, 27, 33, 41, 44, 52, 58, 61, 63, 66, 70, 74, 76, 120, TOTAL):
        assert factor_at(windows, t) == pytest.approx(factor_at(expected, t), rel=1e-9), t
