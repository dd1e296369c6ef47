"""TrainingRun on the real Temporal dev server with stub activities under the real names:
the stage order, continue-as-new, and pause / resume / rollback / abort interleavings through
the workflow's own update and signal handlers, in seconds.

The workflow code and the server are real (the session's `temporal_server`); the activities
are the stubs of tests/workflows/stub_run.py. Commands go in as their wire format: dicts,
bare strings and None through the client, JSON through the `temporal` CLI and the
`mainspring` CLI. The `completed`, `paused_resumed`, `rollback` and `aborted` runs can be
recorded as replay fixtures (stub_run.py, test_replay.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import uuid

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from activities.contracts import STAGES, OperatorRollback
from tests.workflows.stub_run import (
    STOP_AFTER,
    Harness,
    mainspring_cli,
    scenario,
    spec_for,
    temporal_cli,
)


# ---- a run from start to end ------------------------------------------------------------
@scenario
async def test_a_run_passes_the_five_stages_in_order_sweeps_and_continues_as_new(h: Harness):
    spec = spec_for(f"stub-completed-{uuid.uuid4().hex[:6]}", **{
        "train.total_steps": 40, "train.segments_per_run": 2, "sweep.enabled": True,
        "sweep.trials": 2, "sweep.trial_steps": 4,
        "sweep.space": {"lr": {"low": 3e-3, "high": 1e-2, "log": True}}})
    handle = await h.start(spec)
    result = await handle.result()

    assert result["status"] == "completed" and result["stages"] == list(STAGES)
    assert result["final_step"] == 40 and result["workflow_runs"] == 2  # 4 segments, 2 per run
    assert result["best_params"] == {"lr": 1e-2}  # the sweep's better trial
    assert result["initial_val_loss"] == 5.0 and result["final_val_loss"] == 3.6
    assert result["promoted_checkpoint"] == "file:///stub/promoted/step-000000040"
    assert [(s.from_step, s.to_step) for s in h.stubs.segments] == \
        [(0, 10), (10, 20), (20, 30), (30, 40)]
    assert all(s.spec["train"]["lr"] == 1e-2 for s in h.stubs.segments)  # trained with it
    started = [p["stage"] for p in h.stubs.payloads("stage_started")]
    finished = [p["stage"] for p in h.stubs.payloads("stage_finished")]
    assert started == finished == list(STAGES)
    assert h.stubs.kinds()[0] == "run_started" and h.stubs.kinds()[-1] == "run_finished"
    status = await h.status(handle)
    assert (status["stage"], status["step"], status["workflow_runs"]) == ("completed", 40, 2)
    assert status["evals"] == {"0": 5.0, "40": 3.6}
    await h.record("completed", spec.run_id, f"{spec.run_id}-sweep")


# ---- pause / resume ---------------------------------------------------------------------
def test_pause_holds_at_the_step_reached_until_resume_and_refusals_leave_no_trace(
        temporal_server, capsys):
    """Pause through the Temporal CLI (JSON input), set-lr through `mainspring run`, resume
    with no input; refused commands are answered by the validator and leave no history."""
    address = temporal_server.address

    async def body(h: Harness) -> None:
        h.stubs.block = True
        spec = spec_for(f"stub-paused-{uuid.uuid4().hex[:6]}")
        handle = await h.start(spec)
        await h.until(handle, "the first segment", lambda s: s["segment_running"])
        assert "not paused" in await h.refused(handle, "resume", None)
        assert "unknown field(s) ['resaon']" in await h.refused(handle, "pause",
                                                                 {"resaon": "typo"})

        cli = await asyncio.to_thread(
            temporal_cli, address, "workflow", "update", "execute", "--workflow-id",
            spec.run_id, "--name", "pause", "--input",
            json.dumps({"reason": "inspect shard 3", "who": "alice"}))
        assert cli.returncode == 0, cli.stderr
        assert "at the running segment's next step" in cli.stdout
        paused = await h.until(handle, "the pause", lambda s: s["stage"] == "paused")
        assert paused["step"] == STOP_AFTER and paused["needs_attention"] == "inspect shard 3"
        assert paused["segment_running"] is None and paused["operator_queue"] == []
        h.stubs.block = False

        assert "already paused" in await h.refused(handle, "pause", "again")
        assert "scale must be a number in (0, 10]" in await h.refused(
            handle, "set_lr_scale", {"scale": 0})
        assert f"not before the run's step {STOP_AFTER}" in await h.refused(
            handle, "rollback", {"to_step": STOP_AFTER})
        code, _, err = await asyncio.to_thread(  # refused before it is sent
            mainspring_cli, capsys, "run", "set-lr", spec.run_id, "--scale", "0",
            "--address", address)
        assert code == 1 and "set_lr_scale: scale must be a number in (0, 10], got 0.0" in err
        code, out, err = await asyncio.to_thread(
            mainspring_cli, capsys, "run", "set-lr", spec.run_id, "--scale", "0.5",
            "--steps", "5", "--who", "bob", "--address", address)
        assert code == 0, err
        assert json.loads(out)["applies"] == "now"
        held = await h.status(handle)
        assert held["stage"] == "paused" and held["lr_windows"] == [[STOP_AFTER, 12, 0.5]]

        cli = await asyncio.to_thread(temporal_cli, address, "workflow", "update", "execute",
                                      "--workflow-id", spec.run_id, "--name", "resume")
        assert cli.returncode == 0, cli.stderr
        assert "inspect shard 3" in cli.stdout  # reason_was
        result = await handle.result()

        assert result["status"] == "completed" and result["final_step"] == 20
        assert [(s.from_step, s.to_step) for s in h.stubs.segments] == \
            [(0, 10), (STOP_AFTER, 17), (17, 20)]
        assert h.stubs.segments[1].lr_windows == [[STOP_AFTER, 12, 0.5]]
        ops = h.stubs.payloads("operator")
        assert [(o["command"], o["who"], o["applied"]) for o in ops] == \
            [("pause", "alice", True), ("set_lr_scale", "bob", True)]
        # each command is a span of the run's trace, whatever client sent it; its event
        # names the span (a raw `temporal` update carries no trace context of its own)
        spans = [o.get("span_id", "") for o in ops]
        assert all(re.fullmatch(r"[0-9a-f]{16}", s) for s in spans) and len(set(spans)) == 2
        [pause] = h.stubs.payloads("paused")
        assert (pause["reason"], pause["who"]) == ("inspect shard 3", "alice")
        [resumed] = h.stubs.payloads("run_resumed")
        assert (resumed["note"], resumed["paused_for"]) == ("resumed by operator",
                                                             "inspect shard 3")
        # the five refusals are not in the history: only the three accepted updates are
        events = [e for history in await h.histories(spec.run_id) for e in history.events]
        accepted = [e for e in events
                    if e.HasField("workflow_execution_update_accepted_event_attributes")]
        assert len(accepted) == 3
        await h.record("paused_resumed", spec.run_id)

    scenario(body)(temporal_server)


@scenario
async def test_a_bare_string_or_nothing_is_a_commands_note(h: Harness):
    h.stubs.block = True
    spec = spec_for(f"stub-strings-{uuid.uuid4().hex[:6]}")
    handle = await h.start(spec)
    await h.until(handle, "the first segment", lambda s: s["segment_running"])
    assert (await handle.execute_update("pause", "disk swap"))["accepted"] == "pause"
    paused = await h.until(handle, "the pause", lambda s: s["stage"] == "paused")
    assert paused["needs_attention"] == "disk swap"
    assert (await handle.execute_update("resume"))["reason_was"] == "disk swap"
    await h.until(handle, "training again", lambda s: s["segment_running"])
    await handle.signal("abort", "over")
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()
    assert failure.value.cause.type == "RunAborted" and "over" in failure.value.cause.message


# ---- rollback -----------------------------------------------------------------------------
@scenario
async def test_rollbacks_at_one_boundary_go_to_the_earliest_target_across_continue_as_new(
        h: Harness):
    """Two rollbacks admitted while a segment runs (against its end, step 10) apply when it
    stops at step 7: the first goes back to 5 skipping through 7; the second, aimed at 9, is
    moot. The run continues as new at that boundary (segments_per_run 1) with the rollback
    pending: the next run's first segment gets it; pins are released once it has applied."""
    h.stubs.block = True
    h.stubs.stop_gate.clear()
    spec = spec_for(f"stub-rollback-{uuid.uuid4().hex[:6]}")
    handle = await h.start(spec)
    await h.until(handle, "the first segment", lambda s: s["segment_running"])
    first = await handle.execute_update("rollback", {"to_step": 5, "note": "bad shard",
                                                     "who": "carol"})
    second = await handle.execute_update("rollback", {"to_step": 9, "skip_data": False})
    assert (first["id"], second["id"]) == ("op1", "op2")
    assert len(h.stubs.pins) == 2 and sorted(h.stubs.pins.values()) == [5, 9]  # before queued
    assert (await h.status(handle))["operator_queue"] == ["rollback", "rollback"]
    h.stubs.block = False
    h.stubs.stop_gate.set()
    result = await handle.result()

    assert result["status"] == "completed" and result["final_step"] == 20
    assert result["workflow_runs"] == 3
    first_seg, applied, last = h.stubs.segments
    assert (first_seg.from_step, applied.from_step, last.from_step) == (0, 5, 15)
    assert first_seg.rollback is None and last.rollback is None
    assert applied.rollback == OperatorRollback(id=f"{spec.run_id}/op1", to_step=5,
                                                through_step=STOP_AFTER, skip_data=True,
                                                note="bad shard", who="carol")
    ops = h.stubs.payloads("operator")
    assert [(o["id"], o["applied"]) for o in ops] == [("op1", True), ("op2", False)]
    assert ops[1]["why_not"] == "the run stopped at step 5, not after step 9"
    assert h.stubs.pins == {}  # the moot pin at once, the applied one after its segment
    assert sorted(h.stubs.pinned_ever.values()) == [5, 9]
    await h.record("rollback", spec.run_id)


@scenario
async def test_a_rollback_while_paused_is_pending_until_resume_and_shown_in_status(h: Harness):
    h.stubs.block = True
    spec = spec_for(f"stub-held-rollback-{uuid.uuid4().hex[:6]}")
    handle = await h.start(spec)
    await h.until(handle, "the first segment", lambda s: s["segment_running"])
    await handle.execute_update("pause", {"reason": "look"})
    await h.until(handle, "the pause", lambda s: s["stage"] == "paused")
    h.stubs.block = False
    await handle.execute_update("rollback", {"to_step": 2})
    held = await h.status(handle)
    assert held["step"] == 2 and held["stage"] == "paused"
    assert held["pending_rollback"]["to_step"] == 2
    assert held["pending_rollback"]["through_step"] == STOP_AFTER
    await handle.execute_update("resume", {"note": "go"})
    result = await handle.result()
    assert result["final_step"] == 20
    assert [s.from_step for s in h.stubs.segments] == [0, 2, 12]
    assert h.stubs.segments[1].rollback.to_step == 2
    assert (await h.status(handle))["pending_rollback"] is None


# ---- abort --------------------------------------------------------------------------------
@scenario
async def test_an_abort_goes_before_a_pause_queued_at_the_same_boundary(h: Harness):
    h.stubs.block = True
    h.stubs.stop_gate.clear()
    spec = spec_for(f"stub-aborted-{uuid.uuid4().hex[:6]}")
    handle = await h.start(spec)
    await h.until(handle, "the first segment", lambda s: s["segment_running"])
    await handle.execute_update("pause", {"reason": "first"})
    await handle.signal("abort", {"reason": "budget cut", "who": "dave"})
    await h.until(handle, "the abort queued", lambda s: s["operator_queue"] == ["pause", "abort"])
    assert "being aborted" in await h.refused(handle, "set_lr_scale", {"scale": 2})
    h.stubs.stop_gate.set()
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()

    cause = failure.value.cause
    assert cause.type == "RunAborted"
    assert cause.message == f"run {spec.run_id} aborted by dave at step {STOP_AFTER}: budget cut"
    status = await h.status(handle)
    assert status["stage"] == "aborted" and status["step"] == STOP_AFTER
    assert [o["command"] for o in h.stubs.payloads("operator")] == ["abort"]
    [finished] = h.stubs.payloads("run_finished")
    assert (finished["status"], finished["who"], finished["step"]) == ("aborted", "dave",
                                                                     STOP_AFTER)
    assert "paused" not in h.stubs.kinds()
    await h.record("aborted", spec.run_id)


@scenario
async def test_commands_before_training_wait_for_it_and_abort_ends_a_held_run(h: Harness):
    h.stubs.prepare_gate.clear()
    spec = spec_for(f"stub-early-{uuid.uuid4().hex[:6]}")
    handle = await h.start(spec)
    await h.until(handle, "prepare_data", lambda s: s["stage"] == "prepare_data")
    answer = await handle.execute_update("pause", {"reason": "before it starts"})
    assert answer["applies"] == "when training starts"
    await handle.execute_update("set_lr_scale", {"scale": 2.0})
    h.stubs.prepare_gate.set()
    held = await h.until(handle, "the pause", lambda s: s["stage"] == "paused")
    assert held["step"] == 0 and held["lr_windows"] == [[0, 20, 2.0]]
    assert held["stages_done"] == ["prepare_data", "warmup_sweep"] and not h.stubs.segments
    assert "nothing has been trained yet" in await h.refused(handle, "rollback", {"to_step": 0})
    await handle.signal("abort", None)
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()
    assert failure.value.cause.type == "RunAborted"
    assert failure.value.cause.message.endswith("at step 0: aborted by operator")
    assert not h.stubs.segments


@scenario
async def test_abort_cancels_a_stage_activity_at_once(h: Harness):
    h.stubs.prepare_gate.clear()  # prepare_data never finishes by itself
    spec = spec_for(f"stub-abort-early-{uuid.uuid4().hex[:6]}")
    handle = await h.start(spec)
    await h.until(handle, "prepare_data", lambda s: s["stage"] == "prepare_data")
    await handle.signal("abort", {"reason": "wrong corpus"})
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()
    assert failure.value.cause.type == "RunAborted"
    assert "wrong corpus" in failure.value.cause.message
    assert [p["stage"] for p in h.stubs.payloads("stage_finished")] == []
    status = await h.status(handle)
    assert status["stage"] == "aborted" and status["stages_done"] == []


@scenario
async def test_a_segment_that_asks_for_a_larger_batch_gets_it_from_the_next_on_within_bounds(
        h: Harness):
    """The trainer stops a segment to ask for more gradient accumulation (a loss that shook
    while the gradient noise scale stood above the batch); the next segments run with it,
    never above spikes.oscillation.max_batch_factor times the spec's."""
    spec = spec_for(f"stub-batch-{uuid.uuid4().hex[:6]}", **{
        "spikes.oscillation.max_batch_factor": 4})
    h.stubs.ask_batch = {0: (3, 2), 3: (4, 100)}  # the second asks far past the bound
    result = await (await h.start(spec)).result()
    assert result["status"] == "completed" and result["final_step"] == 20
    assert [(s.from_step, s.spec["train"]["grad_accum"]) for s in h.stubs.segments] == [
        (0, 1), (3, 2), (7, 4), (17, 4)]
    assert [(p["from_grad_accum"], p["to_grad_accum"], p["at_step"])
            for p in h.stubs.payloads("batch_raised")] == [(1, 2, 3), (2, 4, 7)]


# ---- failures that need a decision --------------------------------------------------------
def oom(fault: str) -> ApplicationError:
    return ApplicationError("out of memory: DefaultCPUAllocator: can't allocate memory",
                            {"evidence": "rank 0: can't allocate memory", "micro_split": 1,
                             "fault_event_id": fault, "fault_ts": 1.0, "last_step": None},
                            type="OutOfMemory", non_retryable=True)


@scenario
async def test_each_oom_halves_the_micro_batch_until_one_sequence_then_pauses_for_a_human(
        h: Harness):
    # the demo preset: 1024 tokens of seq_len 128 = 8 sequences per micro-batch
    spec = spec_for(f"stub-oom-{uuid.uuid4().hex[:6]}")
    h.stubs.fail_with = [oom(f"fault/{i}") for i in range(4)]
    handle = await h.start(spec)
    held = await h.until(handle, "needs_attention", lambda s: s["stage"] == "needs_attention")
    assert "1 sequence(s) per micro-batch" in held["needs_attention"]
    assert held["micro_split"] == 8
    adapted = h.stubs.payloads("oom_adapted")
    assert [a["micro_batch"] for a in adapted] == [{"from": 8, "to": 4}, {"from": 4, "to": 2},
                                                    {"from": 2, "to": 1}]
    assert {a["global_batch_sequences"] for a in adapted} == {8}
    # each retry ran with the smaller micro-batch, and named the fault it answers
    assert [s.micro_split for s in h.stubs.segments] == [1, 2, 4, 8]
    assert [(s.after_fault or {}).get("event_id") for s in h.stubs.segments] == \
        [None, "fault/0", "fault/1", "fault/2"]
    [attention] = h.stubs.payloads("needs_attention")
    assert "mainspring run resume" in attention["fix"] and attention["failure"] == "OutOfMemory"

    await handle.execute_update("resume", {"note": "bigger machine"})
    result = await handle.result()
    assert result["status"] == "completed" and result["final_step"] == 20
    # the smaller micro-batch is kept for the rest of the run
    assert [s.micro_split for s in h.stubs.segments[4:]] == [8, 8]
    assert h.stubs.segments[4].after_fault["event_id"] == "fault/3"
    assert h.stubs.segments[5].after_fault is None


@scenario
async def test_a_repeated_failure_pauses_in_needs_attention_with_its_evidence_and_fix(
        h: Harness):
    spec = spec_for(f"stub-repeat-{uuid.uuid4().hex[:6]}")
    h.stubs.fail_with = [ApplicationError(
        "the same failure 3 times in a row (crash at step 4 RuntimeError x.py:1 in f)",
        {"fingerprint": "crash at step 4 RuntimeError x.py:1 in f", "repeats": 3,
         "evidence": "rank 0 exit code 1", "fix": "fix the code, then `mainspring run resume`",
         "fault_event_id": "fault/9", "fault_ts": 1.0, "last_step": 4},
        type="RepeatedFailure", non_retryable=True)]
    handle = await h.start(spec)
    held = await h.until(handle, "needs_attention", lambda s: s["stage"] == "needs_attention")
    assert "3 times in a row" in held["needs_attention"]
    [attention] = h.stubs.payloads("needs_attention")
    assert attention["fingerprint"].startswith("crash at step 4") and attention["repeats"] == 3
    assert attention["fix"].startswith("fix the code") and attention["evidence"]
    assert h.stubs.payloads("oom_adapted") == []
    await handle.execute_update("resume", None)
    result = await handle.result()
    assert result["status"] == "completed"
    assert [s.micro_split for s in h.stubs.segments] == [1, 1, 1]
    assert h.stubs.segments[1].after_fault["event_id"] == "fault/9"


@scenario
async def test_a_full_disk_pauses_in_needs_attention_instead_of_failing_the_run(h: Harness):
    # DiskFull (non-retryable) used to fail the whole run; a human frees the disk
    spec = spec_for(f"stub-disk-{uuid.uuid4().hex[:6]}")
    h.stubs.fail_with = [ApplicationError(
        "storage.fast: /fast has 10 bytes free; a segment keeps up to 900 bytes of checkpoints "
        "there. Fix: free space on that disk", {"path": "/fast", "free": 10, "need": 900},
        type="DiskFull", non_retryable=True)]
    handle = await h.start(spec)
    held = await h.until(handle, "needs_attention", lambda s: s["stage"] == "needs_attention")
    assert "10 bytes free" in held["needs_attention"]
    [attention] = h.stubs.payloads("needs_attention")
    assert attention["failure"] == "DiskFull" and "resume" in attention["fix"]
    await handle.execute_update("resume", {"note": "disk freed"})
    assert (await handle.result())["status"] == "completed"


# ---- train.checkpoint_every "auto" ------------------------------------------------------
@scenario
async def test_auto_checkpoints_choose_each_segments_interval_and_shrink_it_after_a_fault(
        h: Harness):
    spec = spec_for(f"stub-interval-{uuid.uuid4().hex[:6]}", **{
        "train.total_steps": 30, "train.segments_per_run": 2, "train.checkpoint_every": "auto",
        "train.checkpoint_every_min": 2, "ops.mtbf_s": 3600.0, "ops.mtbf_prior_faults": 1})
    # every segment: 2 checkpoints stalling 0.25 s together (C = 0.125 s), 5 s steps
    h.stubs.measured = {"checkpoint_stall_s": 0.25, "checkpoints": 2, "step_time_s": 5.0}
    h.stubs.retry_first = {10}  # the second segment's first attempt crashes
    handle = await h.start(spec)
    result = await handle.result()
    assert result["status"] == "completed" and result["workflow_runs"] == 2

    chosen = h.stubs.payloads("checkpoint_interval")
    # nothing measured: the lower bound; then sqrt(2 x 0.125 s x 3600 s) = 30 s = 6 steps
    # (the prior MTBF, raised by the first segment's fault-free wall time: a fraction of a
    # second here, more on a loaded machine); after the retried attempt the run's own MTBF
    # (seconds) takes the prior's place
    assert [c["steps"] for c in chosen] == [2, 6, 2]
    assert [c["faults"] for c in chosen] == [0, 0, 1]
    assert [c["mtbf_source"] for c in chosen] == ["prior", "prior", "observed"]
    second = chosen[1]
    assert second["mtbf_s"] == pytest.approx(3600.0 + second["train_wall_s"], abs=1e-3)
    assert second["young_daly_s"] == pytest.approx(math.sqrt(2 * 0.125 * second["mtbf_s"]),
                                                   abs=1e-3)
    assert second["young_daly_s"] == pytest.approx(30.0, abs=0.1)
    assert chosen[2]["steps_at_prior"] == 6
    assert chosen[2]["mtbf_s"] < 10.0 and chosen[2]["previous_steps"] == 6
    # each segment's trainer got the interval chosen for it, every attempt alike
    assert [(s.from_step, s.checkpoint_every) for s in h.stubs.segments] == \
        [(0, 2), (10, 6), (10, 6), (20, 2)]
    status = await h.status(handle)
    assert (status["checkpoint_every"], status["faults_seen"]) == (2, 1)
