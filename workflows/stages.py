"""What TrainingRun's stages schedule, and how it waits for it: each activity (name, queue,
input, timeouts and retry policy), the Sweep child and the event local activity, one
function each, so that workflows/training_run.py reads as the run's decisions. Workflow
code: these schedule work through Temporal and do no I/O of their own.

Each carries a summary (`data prep: …`, `segment 80–160 of 160, …`, `evaluate …`), the
line the Temporal UI's timeline shows for it; a summary is metadata, not part of what a
replay compares, so adding one keeps old histories replaying (tests/workflows/test_replay.py).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import is_cancelled_exception
from temporalio.workflow import ActivityCancellationType, ActivityHandle, ChildWorkflowHandle

with workflow.unsafe.imports_passed_through():
    from activities.contracts import (
        DATA_QUEUE,
        EVALUATE,
        PREPARE_DATA,
        PROMOTE,
        RECORD_EVENT,
        SCRUB_CHECKPOINTS,
        TRAIN_SEGMENT,
        TRAINER_QUEUE,
        EvaluateInput,
        EvaluateResult,
        GangMember,
        PrepareDataInput,
        PrepareDataResult,
        PromoteInput,
        PromoteResult,
        RecordEventInput,
        ScrubInput,
        ScrubResult,
        SweepInput,
        SweepResult,
        TrainSegmentInput,
        TrainSegmentResult,
    )
    from spec import RunSpec
    from workflows.activity_options import segment_options, short_options
    from workflows.carry import RunCarry
    from workflows.escalation import rollback_allowance
    from workflows.gang import gang_options
    from workflows.sweep import Sweep


def start_prepare_data(spec: dict[str, Any], s: RunSpec) -> ActivityHandle[PrepareDataResult]:
    d = s.data
    dedup = "+".join(k for k, on in (("exact", d.dedup.exact), ("near", d.dedup.near)) if on)
    tokenizer = d.tokenizer.path or f"BPE {d.tokenizer.vocab_size}"
    return workflow.start_activity(
        PREPARE_DATA, PrepareDataInput(spec), task_queue=DATA_QUEUE,
        result_type=PrepareDataResult, **short_options(s),
        summary=f"data prep: {d.corpus} → clean, {dedup or 'no'} dedup, tokenize "
                f"({tokenizer}), shards")


async def start_sweep(spec: dict[str, Any],
                      dataset_uri: str) -> ChildWorkflowHandle[Any, SweepResult]:
    """The Sweep child, on the run's own queue, named after the run."""
    s = RunSpec.from_dict(spec)
    return await workflow.start_child_workflow(
        Sweep.run, SweepInput(spec, dataset_uri), id=f"{workflow.info().workflow_id}-sweep",
        task_queue=workflow.info().task_queue,
        static_summary=f"warm-up sweep of {s.run_id}: {s.sweep.trials} trials × "
                       f"{s.sweep.trial_steps} steps over {', '.join(sorted(s.sweep.space))}")


def start_train_segment(train_spec: RunSpec, c: RunCarry, lo: int, hi: int,
                        gang: GangMember | None = None,
                        queue: str = TRAINER_QUEUE) -> ActivityHandle[TrainSegmentResult]:
    """Steps (lo, hi] with the carry's LR windows, what is left of the rollback budget and
    the pending operator rollback (and the checkpoint interval chosen for "auto",
    workflows/interval.py). A cancel waits for the trainer's graceful stop. With
    `gang`: one node's share of a multi-node segment, on that node's queue, tried once
    (workflows/gang.py); its node 0 records the recovery from the last fault."""
    lead = gang is None or gang.node_rank == 0
    return workflow.start_activity(
        TRAIN_SEGMENT, TrainSegmentInput(
            train_spec.to_dict(), c.dataset_uri, lo, hi, lr_windows=c.escalation.lr_windows,
            max_rollbacks=rollback_allowance(c.escalation.rollback_steps,
                                             c.escalation.budget_from, lo,
                                             train_spec.spikes),
            rollback=c.operator.pending_rollback, micro_split=c.micro_split,
            after_fault=c.after_fault.to_json() if lead and c.after_fault else None, gang=gang,
            checkpoint_every=c.interval.checkpoint_every),
        task_queue=queue, result_type=TrainSegmentResult,
        cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        summary=segment_summary(train_spec, c, lo, hi, gang),
        **(gang_options(train_spec) if gang else segment_options(train_spec)))


def segment_summary(s: RunSpec, c: RunCarry, lo: int, hi: int,
                    gang: GangMember | None = None) -> str:
    """`segment 80–160 of 160` and what is special about this launch: a gang member's node,
    the operator rollback it applies, the fault it answers, an OOM's micro-batch split."""
    out = [f"segment {lo}–{hi} of {s.train.total_steps}"]
    if gang:
        out.append(f"node {gang.node_rank} of {gang.nnodes}: {gang.node}")
    if c.operator.pending_rollback:
        out.append(f"operator rollback to step {c.operator.pending_rollback.to_step}")
    if c.after_fault:
        out.append("after a fault")
    if c.micro_split > 1:
        out.append(f"micro-batch in {c.micro_split} chunks")
    return ", ".join(out)


def start_evaluate(train_spec: RunSpec, dataset_uri: str,
                   steps: list[int]) -> ActivityHandle[EvaluateResult]:
    return workflow.start_activity(
        EVALUATE, EvaluateInput(train_spec.to_dict(), dataset_uri, steps),
        task_queue=TRAINER_QUEUE, result_type=EvaluateResult, **short_options(train_spec),
        summary="evaluate: held-out loss at steps " + ", ".join(map(str, steps)))


def start_promote(train_spec: RunSpec, step: int) -> ActivityHandle[PromoteResult]:
    return workflow.start_activity(
        PROMOTE, PromoteInput(train_spec.to_dict(), step), task_queue=DATA_QUEUE,
        result_type=PromoteResult, **short_options(train_spec),
        summary=f"promote step {step}: copy and verify to promoted/")


def start_scrub(spec: dict[str, Any], s: RunSpec) -> ActivityHandle[ScrubResult]:
    """The checkpoint scrub on the data queue (it does not train), beside a segment."""
    st = s.storage
    return workflow.start_activity(
        SCRUB_CHECKPOINTS, ScrubInput(spec), task_queue=DATA_QUEUE, result_type=ScrubResult,
        **short_options(s), summary=f"scrub: verify the newest {st.scrub_newest} checkpoints, "
                                    f"the rollback horizon, pins and promoted (≤ "
                                    f"{st.scrub_mb_per_s:g} MB/s)")


async def record_event(s: RunSpec, kind: str, event_id: str, step: int,
                       payload: dict[str, Any]) -> None:
    """A workflow decision into the run's event log (activities/events.py)."""
    await workflow.execute_local_activity(
        RECORD_EVENT, RecordEventInput(durable=s.storage.durable, run_id=s.run_id, kind=kind,
                                       event_id=event_id, step=step, payload=payload),
        start_to_close_timeout=timedelta(seconds=60), summary=f"event {event_id}")


async def until(handle: Any, interrupted: Callable[[], bool]) -> Any:
    """Wait for `handle`; cancel it when `interrupted()` turns true first. The handle's
    result (a graceful stop still returns one), or None when it ended cancelled."""
    await workflow.wait_condition(lambda: handle.done() or interrupted())
    if not handle.done():
        handle.cancel()
    try:
        return await handle
    except BaseException as exc:  # ActivityError / ChildWorkflowError / CancelledError
        if interrupted() and is_cancelled_exception(exc):
            return None
        raise
