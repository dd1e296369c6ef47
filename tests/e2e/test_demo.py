"""`mainspring demo --json` as a user runs it: embedded Temporal, fleet, injected kill.

The demo's run is also the default suite's full five-stage run with a SIGKILLed trainer
worker: the claims of test_training_run.py's longer test_five_stage_run_survives_injected_
kill_and_continues_as_new (a soak test now) are checked here on the demo's record, read
back from its durable store once the demo has ended."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from activities.contracts import STAGES
from ops.cli import main
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from storage.spans import read_spans

pytestmark = pytest.mark.e2e


def test_demo_json_completes_five_stages_and_recovers_its_injected_fault(tmp_path, capsys):
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "demo", "--json",
                           "--state-dir", str(tmp_path / "state")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["status"] == "completed"
    assert summary["stages"] == ["prepare_data", "warmup_sweep", "train", "evaluate", "promote"]
    # a SIGKILLed trainer worker (resumed by a retry) and a window of corrupted batches
    # (rolled back past): both recovered with no human action
    assert summary["faults_injected"] == 2 and summary["faults_recovered"] >= 2
    assert summary["faults_seen"] >= 1  # the injected worker kill, seen as worker_lost
    assert summary["spike_rollbacks"] >= 1
    assert summary["human_actions"] == 0
    # it learns, visibly: 6.95 at step 0 to ~5.42 at 240 (deterministic on CPU: the kill
    # resumes exactly, and the trials' results, so the winner, do not depend on timing)
    assert summary["final_val_loss"] < 5.5 < summary["initial_val_loss"]
    assert summary["promoted_checkpoint"].endswith("promoted/step-000000240")
    assert "Temporal UI: http://" in proc.stderr
    # the post-incident report: the loss curve with the kill and the rollback marked
    report = (tmp_path / "state" / "reports" / summary["run_id"] / "report.html").read_text()
    assert summary["report"].endswith("report.html") and "data:image/png;base64," in report
    assert "kill_worker" in report and "sustained_spike" in report

    # The run's own record (the demo preset: 240 steps in two 120-step segments, one per
    # workflow run, a commit every 20, two sweep trials at once; the worker SIGKILLed after
    # step 50).
    run_id, durable = summary["run_id"], str(tmp_path / "state" / "store")
    events = read_events(durable, run_id)
    kinds = {(e["kind"], e["payload"].get("stage")) for e in events}
    for stage in STAGES:
        assert ("stage_started", stage) in kinds and ("stage_finished", stage) in kinds, stage
    committed = CheckpointStore(durable, run_id).list_committed()
    assert {0, 20, 40, 60, 80, 100, 120, 240} <= set(committed), committed
    logged = {e["step"] for e in events if e["kind"] == "checkpoint_committed"}
    assert set(committed) <= logged, (committed, logged)
    # the injected SIGKILL really killed the trainer worker: the next attempt saw a lost
    # worker, and its recovery resumed from the last commit before the kill
    injected = [e for e in events if e["kind"] == "fault" and e["payload"].get("injected")]
    seen = [e for e in events if e["kind"] == "fault" and not e["payload"].get("injected")]
    assert sorted(e["payload"]["kind"] for e in injected) == ["corrupt_batches", "kill_worker"]
    assert [e["payload"]["kind"] for e in seen] == ["worker_lost"]
    [recovered] = [e["payload"] for e in events if e["kind"] == "recovered"
                   and e["payload"]["fault_event_id"] == seen[0]["event_id"]]
    assert recovered["resumed_step"] == 40 and 0 < recovered["lost_steps"] <= 20, recovered
    # two segments with segments_per_run=1: the train stage continued as new once - the
    # workflow's spans carry two workflow runs of the one workflow id
    [train] = [e["payload"] for e in events if e["kind"] == "stage_finished"
               and e["payload"]["stage"] == "train"]
    assert train["segments"] == 2 and train["final_step"] == 240, train
    spans = read_spans(durable, run_id)  # all stored: the demo stopped its workers
    runs = {s["attributes"].get("temporalRunID") for s in spans
            if s["name"] == "RunWorkflow:TrainingRun"}
    assert len(runs - {None}) == 2, runs
    # the lost worker and the rollback are span events where they were seen
    span_events = {(ev["name"], ev["attributes"].get("kind")) for s in spans
                   for ev in s["events"]}
    assert ("fault", "worker_lost") in span_events, span_events
    assert any(name == "rollback" for name, _ in span_events), span_events
    # the warm-up sweep: two trials of different parameters, the better one chosen
    trials = [e["payload"] for e in events if e["kind"] == "sweep_trial"]
    assert len(trials) == 2 and trials[0]["params"] != trials[1]["params"]
    [sweep] = [e["payload"] for e in events if e["kind"] == "stage_finished"
               and e["payload"]["stage"] == "warmup_sweep"]
    assert sweep["best_params"] == min(trials, key=lambda t: t["result"])["params"]
    # the run's record, from the store alone: `mainspring trace` names the fault
    capsys.readouterr()
    assert main(["trace", run_id, "--durable", durable]) == 0
    assert "worker_lost" in capsys.readouterr().out
    # The fast tier is a cache: no checkpoint of a finished run (or its trials) is left on
    # the trainer's local disk (every segment's checkpoints once stayed there forever); the
    # segments' small records stay until the machine's next collection.
    fast = tmp_path / "state" / "fast"
    left = [d for d, _, _ in os.walk(fast) if os.path.basename(d).startswith("step-")]
    assert left == [] and not (fast / run_id / "ckpt").exists()
    assert list((fast / run_id / "segments").glob("*/progress.jsonl"))
