"""What the Temporal UI shows of a run and where a relative path points, on the
real dev server with the stub activities of stub_run.py: the memo and current details
(workflows/headline.py), each activity's summary, and relative spec paths anchored at the
orchestrator's root once, in the history (workflows/start.py:anchor_paths)."""

from __future__ import annotations

import asyncio
import json
import math
import uuid

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.converter import PayloadConverter

from spec import preset
from tests.workflows.stub_run import SPEC_ROOT_DIR, Harness, scenario, spec_for, temporal_cli
from workflows.carry import RunCarry
from workflows.headline import details, line, memo


# ---- pure --------------------------------------------------------------------------------
def test_the_headline_says_stage_step_loss_and_faults_and_hides_a_nonfinite_loss():
    assert line("train", 80, 160, 3.21, 1) == \
        "train · step 80/160 · loss 3.2100 · 1 fault recovered"
    assert line("prepare_data", 0, 160, None, 0) == \
        "prepare_data · step 0/160 · 0 faults recovered"
    spec = preset("demo", run_id="r")
    m = memo(spec, RunCarry.from_json(
        dict(next_step=40, train_loss=math.nan, faults_seen=2)), "train")
    assert m["loss"] is None and m["faults_recovered"] == 2 and m["step"] == 40
    assert json.loads(json.dumps(m, allow_nan=False)) == m  # the UI's JSON has no NaN


def test_the_details_of_a_held_run_say_why_and_how_to_go_on():
    spec = preset("demo", run_id="r")
    c = RunCarry.from_json(dict(
        next_step=12, train_loss=4.0, stages_done=["prepare_data"],
        held={"stage": "paused", "reason": "inspect shard 3", "who": "ann"}))
    text = details(spec, c, "paused", None)
    assert text.startswith("**r** · paused · step 12/240 · loss 4.0000")
    assert "held (paused): inspect shard 3" in text
    assert "temporal workflow update execute --workflow-id r --name resume" in text
    assert "stages done: prepare_data" in text
    assert "training steps 12–92" in details(spec, RunCarry(next_step=12), "train", (12, 92))


# ---- on the server -----------------------------------------------------------------------
def summaries(histories) -> list[str]:
    """Every scheduled activity's and local activity's summary, in history order."""
    conv = PayloadConverter.default
    return [conv.from_payload(e.user_metadata.summary) for h in histories for e in h.events
            if e.HasField("user_metadata") and e.user_metadata.HasField("summary")]


def test_relative_paths_are_anchored_once_at_the_orchestrators_root_for_every_activity(
        temporal_server):
    """A spec with relative paths, as `temporal workflow start` would send it: every activity
    (prepare_data, the sweep's trials, each segment, the claim, each event) gets them
    absolute under the orchestrator's root, asked once in the chain; the memo and the
    current details show the run's headline and where its store is; the timeline's
    activities say what each one is."""
    address = temporal_server.address

    async def body(h: Harness) -> None:
        spec = spec_for(f"stub-relative-{uuid.uuid4().hex[:6]}", **{
            "storage.durable": "runs/store", "storage.fast": "fast", "sweep.enabled": True,
            "sweep.trials": 2, "sweep.trial_steps": 4,
            "sweep.space": {"lr": {"low": 3e-3, "high": 1e-2, "log": True}}})
        handle = await h.start(spec)
        result = await handle.result()
        assert result["status"] == "completed"

        store = f"file://{SPEC_ROOT_DIR}/runs/store"
        assert h.stubs.roots_asked == 1  # the next run of the chain gets the anchored spec
        [claim] = h.stubs.claims
        assert claim.durable == store and claim.spec["storage"]["fast"] == f"{SPEC_ROOT_DIR}/fast"
        assert [p.spec["storage"]["durable"] for p in h.stubs.prepared] == [store]
        assert {s.spec["storage"]["durable"] for s in h.stubs.segments} == {store}
        assert {e.durable for e in h.stubs.events} == {store}
        assert (await h.status(handle))["durable"] == store

        desc = await handle.describe()
        shown = {k: await desc.memo_value(k) for k in ("stage", "step", "total_steps",
                                                        "faults_recovered", "durable")}
        assert shown == {"stage": "completed", "step": 20, "total_steps": 20,
                         "faults_recovered": 0, "durable": store}
        assert await desc.memo_value("headline") == \
            "completed · step 20/20 · loss 2.8000 · 0 faults recovered"
        meta = await asyncio.to_thread(temporal_cli, address, "workflow", "metadata",
                                       "--workflow-id", spec.run_id, "--output", "json")
        assert meta.returncode == 0, meta.stderr
        current = json.loads(meta.stdout)["queryResult"][0]["currentDetails"]
        assert current.startswith(f"**{spec.run_id}** · completed · step 20/20")
        assert f"--durable {store}" in current

        told = summaries(await h.histories(spec.run_id))
        assert told[0] == "anchor the spec's relative paths at the orchestrator's --spec-root"
        assert f"claim run id {spec.run_id} in {store}" in told
        assert "data prep: stdlib:*.py → clean, exact+near dedup, tokenize (BPE 1024), shards" \
            in told
        assert [t for t in told if t.startswith("segment ")] == \
            ["segment 0–10 of 20", "segment 10–20 of 20"]
        assert "evaluate: held-out loss at steps 0, 20" in told
        assert "promote step 20: copy and verify to promoted/" in told
        sweep = summaries([await h.client.get_workflow_handle(
            f"{spec.run_id}-sweep").fetch_history()])
        assert [t for t in sweep if t.startswith("sweep trial")] == [
            "sweep trial 0 (round 0, lr 0.003): train 4 steps",
            "sweep trial 0: held-out loss at step 4",
            "sweep trial 1 (round 0, lr 0.01): train 4 steps",
            "sweep trial 1: held-out loss at step 4"]
        child = await h.client.get_workflow_handle(f"{spec.run_id}-sweep").describe()
        assert await child.static_summary() == \
            f"warm-up sweep of {spec.run_id}: 2 trials × 4 steps over lr"
        await h.record("relative_paths", spec.run_id, f"{spec.run_id}-sweep")

    scenario(body)(temporal_server)


@scenario
async def test_a_home_relative_path_fails_the_run_at_once_naming_the_fix(h: Harness):
    spec = spec_for(f"stub-home-{uuid.uuid4().hex[:6]}", **{"storage.durable": "~/store"})
    handle = await h.start(spec)
    with pytest.raises(WorkflowFailureError) as failure:
        await handle.result()
    cause = failure.value.cause
    assert cause.type == "BadConfig" and cause.non_retryable
    assert "storage.durable: '~/store' starts with '~'" in cause.message
    assert "give an absolute path" in cause.message
    assert not h.stubs.claims and not h.stubs.prepared and h.stubs.roots_asked == 0
    assert await (await handle.describe()).memo_value("stage") == "failed"


@scenario
async def test_an_anchored_spec_asks_no_root_and_the_memo_follows_holds(h: Harness):
    h.stubs.block = True
    spec = spec_for(f"stub-memo-{uuid.uuid4().hex[:6]}")
    handle = await h.start(spec)
    await h.until(handle, "the first segment", lambda s: s["segment_running"])
    await handle.execute_update("pause", {"reason": "look at it"})
    await h.until(handle, "the pause", lambda s: s["stage"] == "paused")
    desc = await handle.describe()
    assert await desc.memo_value("stage") == "paused"
    assert await desc.memo_value("step") == 7  # stub_run.STOP_AFTER
    h.stubs.block = False
    await handle.execute_update("resume", None)
    assert (await handle.result())["status"] == "completed"
    assert h.stubs.roots_asked == 0
    upserts = [e for hist in await h.histories(spec.run_id) for e in hist.events
               if e.HasField("workflow_properties_modified_event_attributes")]
    memos = [{k: PayloadConverter.default.from_payload(v) for k, v in
              e.workflow_properties_modified_event_attributes.upserted_memo.fields.items()}
             for e in upserts]
    # one upsert per change, never a repeat: each stage as it begins, each boundary, the end
    assert [(m["stage"], m["step"]) for m in memos] == [
        ("starting", 0), ("prepare_data", 0), ("warmup_sweep", 0), ("train", 0),
        ("train", 7), ("paused", 7), ("train", 7), ("train", 17), ("train", 20),
        ("evaluate", 20), ("promote", 20), ("completed", 20)]
    assert all(a != b for a, b in zip(memos, memos[1:]))
