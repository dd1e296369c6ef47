"""`mainspring demo --json` as a user runs it: embedded Temporal, fleet, injected kill."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_demo_json_completes_five_stages_and_recovers_its_injected_fault(tmp_path):
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
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    assert summary["promoted_checkpoint"].endswith("promoted/step-000000160")
    assert "Temporal UI: http://" in proc.stderr
    # the post-incident report: the loss curve with the kill and the rollback marked
    report = (tmp_path / "state" / "reports" / summary["run_id"] / "report.html").read_text()
    assert summary["report"].endswith("report.html") and "data:image/png;base64," in report
    assert "kill_worker" in report and "sustained_spike" in report
