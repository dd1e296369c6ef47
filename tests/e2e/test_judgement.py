"""Failures that need a decision, not a blind retry, through the real workflow, workers and
torchrun children: an out-of-memory under a real memory limit adapts the micro-batch and
completes with the same global batch; a crash at a fixed step stops after ops.repeat_failure_limit
attempts in needs_attention, and `mainspring run resume` after the fix completes the run."""

from __future__ import annotations

import asyncio

import pytest

from ops.cli import main
from ops.client import connect, start_run
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.e2e.runs import cli_status, tiny_spec, wait_for

pytestmark = pytest.mark.e2e

SHORT = {"train.total_steps": 30, "train.segment_steps": 30, "train.checkpoint_every": 10,
         "sweep.enabled": False}
# 256 sequences of 64 tokens per micro-batch: the step needs ~400-600 MiB more than the rank
# holds when training starts, half of it ~200-300 MiB (measured on CPU); 360 MiB sits between.
# Ten of these long steps: the adapted micro-batch trains to the run's one commit after 0.
MEMORY = {"train.micro_batch_tokens": 256 * 64, "train.total_steps": 10,
          "train.segment_steps": 10,
          "faults": [{"kind": "memory_limit", "at_step": 1, "mb": 360}]}


async def _result(address: str, run_id: str, timeout_s: float) -> dict:
    client = await connect(address)
    res = await asyncio.wait_for(client.get_workflow_handle(run_id).result(), timeout_s)
    return res if isinstance(res, dict) else res.__dict__


async def _start(address: str, spec) -> None:
    await start_run(await connect(address), spec)


def answered(events: list[dict], fault: dict) -> dict:
    """The `recovered` event naming `fault`."""
    return next(e["payload"] for e in events if e["kind"] == "recovered"
                and e["payload"]["fault_event_id"] == fault["event_id"])


def test_oom_under_a_real_memory_limit_halves_the_micro_batch_and_completes_with_the_same_global_batch(
        temporal_server, fleet_factory, tmp_path):
    spec = tiny_spec("e2e-oom", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **{**SHORT, **MEMORY})
    fleet_factory()
    asyncio.run(_start(temporal_server.address, spec))
    result = asyncio.run(_result(temporal_server.address, spec.run_id, 600))
    assert result["status"] == "completed" and result["final_step"] == 10

    events = read_events(spec.storage.durable, spec.run_id)
    ooms = [e for e in events if e["kind"] == "fault" and e["payload"]["kind"] == "oom"]
    assert ooms, [e["payload"] for e in events if e["kind"] == "fault"]
    assert "allocate memory" in ooms[0]["payload"]["evidence"]
    adapted = [e["payload"] for e in events if e["kind"] == "oom_adapted"]
    assert adapted and adapted[0]["micro_batch"] == {"from": 256, "to": 128}
    assert adapted[0]["grad_accum"] == {"from": 1, "to": 2}
    # the same global batch throughout: sequences per optimizer step never changed
    assert {a["global_batch_sequences"] for a in adapted} == {256}
    assert all(a["micro_batch"]["to"] * a["grad_accum"]["to"] == 256 for a in adapted)
    last = ooms[-1]
    recovered = answered(events, last)
    # nothing was committed before the first step ran: it resumed from the step-0 commit
    assert recovered["resumed_step"] == 0 and recovered["mttr_s"] > 0
    committed = CheckpointStore(spec.storage.durable, spec.run_id).list_committed()
    assert committed == [0, 10]
    tokens = [e["payload"] for e in events if e["kind"] == "train_metrics"]
    assert tokens  # it trained, at the adapted micro-batch, to the end


# Soak: the default suite covers its parts faster — the fingerprint and repeat budget of real
# crash records (tests/activities/test_repeat_budget.py) and the workflow's hold and resume
# (tests/workflows/test_training_run_stubs.py, a repeated failure pauses in needs_attention).
@pytest.mark.soak
def test_a_repeated_crash_at_a_fixed_step_pauses_in_needs_attention_and_resume_after_the_fix_completes(
        temporal_server, fleet_factory, tmp_path, capsys):
    bug = tmp_path / "bug"
    bug.write_text("present until fixed")
    spec = tiny_spec("e2e-repeat", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **{**SHORT, "ops.repeat_failure_limit": 3,
                        "faults": [{"kind": "crash", "at_step": 15, "path": str(bug)}]})
    fleet_factory()
    address = temporal_server.address

    def status() -> dict:
        return cli_status(capsys, spec.run_id, address)

    asyncio.run(_start(address, spec))
    held = wait_for(lambda: (s := status())["stage"] == "needs_attention" and s, 420,
                    "the run to pause in needs_attention", every_s=2.0)
    assert "3 times in a row" in held["needs_attention"]
    events = read_events(spec.storage.durable, spec.run_id)
    crashes = [e for e in events if e["kind"] == "fault" and not e["payload"].get("injected")]
    # exactly the limit: three attempts, each the same fingerprint, then no fourth
    assert [c["payload"]["repeats"] for c in crashes] == [1, 2, 3]
    assert len({c["payload"]["fingerprint"] for c in crashes}) == 1
    assert "RuntimeError" in crashes[0]["payload"]["fingerprint"]
    attention = wait_for(lambda: read_events(spec.storage.durable, spec.run_id,
                                             kinds=("needs_attention",)), 30,
                         "the needs_attention event")[0]["payload"]
    assert "mainspring run resume" in attention["fix"] and attention["evidence"]
    committed_when_held = CheckpointStore(spec.storage.durable, spec.run_id).list_committed()
    assert committed_when_held == [0, 10]

    bug.unlink()  # the fix
    capsys.readouterr()
    assert main(["run", "resume", spec.run_id, "--note", "bug fixed", "--address", address]) == 0
    result = asyncio.run(_result(address, spec.run_id, 420))
    assert result["status"] == "completed" and result["final_step"] == 30
    events = read_events(spec.storage.durable, spec.run_id)
    recovered = answered(events, crashes[-1])
    assert recovered["resumed_step"] == 10
    committed = CheckpointStore(spec.storage.durable, spec.run_id).list_committed()
    assert set(committed_when_held) <= set(committed) and committed == [0, 10, 20, 30]
