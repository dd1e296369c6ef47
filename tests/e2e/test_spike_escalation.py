"""Spike escalation through the real workflow: repeated spikes spend
the rollback budget -> the LR is lowered -> the run pauses in needs_attention ->
`mainspring run resume` continues it to the end."""

from __future__ import annotations

import asyncio
import json

import pytest

from ops.cli import main
from ops.client import connect, start_run
from tests.e2e.runs import assert_completed_five_stages, cli_status, tiny_spec, wait_for
from trainer.schedule import lr_at

pytestmark = pytest.mark.e2e

# Three separate regions of corrupted data; one rollback allowed per 1000 steps.
ESCALATING = {
    "train.total_steps": 120, "train.segment_steps": 60, "train.segments_per_run": 4,
    "train.checkpoint_every": 5, "train.lr": 1e-2, "sweep.enabled": False,
    "spikes.window": 20, "spikes.warmup": 10, "spikes.skip_window": 6, "spikes.skip_threshold": 4.0,
    "spikes.budget": {"rollbacks": 1, "per_steps": 1000}, "spikes.lr_backoff_steps": 500,
    "faults": [{"kind": "corrupt_batches", "at_step": s, "steps": 4} for s in (40, 52, 70)],
}


def test_repeated_spikes_lower_the_lr_then_pause_until_resumed(temporal_server, fleet_factory,
                                                               tmp_path, capsys):
    spec = tiny_spec("e2e-spikes", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **ESCALATING)
    fleet_factory()
    address = temporal_server.address

    def status() -> dict:
        return cli_status(capsys, spec.run_id, address)

    async def paused_runs() -> list[str]:
        client = await connect(address)
        return [r.id async for r in client.list_workflows(
            "MainspringStage = 'needs_attention'")]

    asyncio.run(_start(address, spec))
    paused = wait_for(lambda: (s := status())["stage"] == "needs_attention" and s, 480,
                      "the run to pause in needs_attention")
    assert "even after lowering the LR" in paused["needs_attention"]
    assert len(paused["rollback_steps"]) == 3
    assert len(paused["lr_windows"]) == 1 and paused["lr_windows"][0][2] == spec.spikes.lr_backoff
    assert wait_for(lambda: spec.run_id in asyncio.run(paused_runs()), 30,
                    "the needs_attention search attribute")
    step_when_paused = paused["step"]

    capsys.readouterr()
    assert main(["run", "resume", spec.run_id, "--note", "bad shards removed",
                 "--address", address]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == step_when_paused

    async def result() -> dict:
        client = await connect(address)
        res = await asyncio.wait_for(client.get_workflow_handle(spec.run_id).result(), 480)
        return res if isinstance(res, dict) else res.__dict__

    events = assert_completed_five_stages(asyncio.run(result()), spec)
    kinds = [e["kind"] for e in events]
    rollbacks = [e["payload"] for e in events if e["kind"] == "rollback"]
    assert len(rollbacks) == 3 and all(r["to_step"] < r["onset"] for r in rollbacks)
    order = [kinds.index(k) for k in ("lr_adjusted", "needs_attention", "run_resumed")]
    assert order == sorted(order)
    resumed = next(e["payload"] for e in events if e["kind"] == "run_resumed")
    assert resumed["note"] == "bad shards removed"
    # The lowered LR really reached the trainer: steps inside the window ran at half the LR.
    lowered = next(e for e in events if e["kind"] == "lr_adjusted")["payload"]
    assert lowered["scale"] == spec.spikes.lr_backoff
    # (From the durable record: a finished run leaves nothing on the trainer's local disk.)
    inside = [e["payload"] for e in events if e["kind"] == "train_metrics"
              and int(e["payload"]["segment"].split("-")[0]) >= lowered["from_step"]
              and lowered["from_step"] < e["payload"]["first_step"]
              and e["payload"]["last_step"] <= lowered["until_step"]]
    assert inside and all(m["lr"] == pytest.approx(lr_at(m["last_step"], spec.train) * 0.5)
                          for m in inside)

    # `mainspring run status` of the finished run, answered through the workflow's query
    done = status()
    assert (done["workflow_status"], done["stage"]) == ("COMPLETED", "completed")
    assert done["step"] == spec.train.total_steps

    # Nothing to resume any more: a clear refusal, not a hang.
    capsys.readouterr()
    assert main(["run", "resume", spec.run_id, "--address", address]) == 1
    assert "cannot resume" in capsys.readouterr().err


async def _start(address: str, spec) -> None:
    await start_run(await connect(address), spec)
