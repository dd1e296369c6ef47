"""benchmarks/scale.py --quick on the real services: 8 simulated nodes under one TrainingRun,
a node lost, a rank lost and a hang, each recovered by the orchestrator alone, and the
figures it prints are sane — goodput from the record within 1 % of the simulation's truth.
Minutes long: a soak test, outside the default suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.soak
@pytest.mark.process  # it starts the services and workers (tests/conftest.py)
@pytest.mark.timeout(900)
def test_quick_scale_run_recovers_every_fault_and_its_goodput_matches_the_truth(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/scale.py", "--quick",
                           "--plots", str(tmp_path / "plots")], cwd=ROOT, capture_output=True,
                          text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (count,) = out["counts"]
    assert "error" not in count, count
    shape = count["inputs"]

    # the simulated span was trained to its end, every planned fault struck and was answered
    assert count["ended"]["steps_kept"] == shape["total_steps"]
    assert count["ended"]["strikes_left"] == 0
    faults = count["recovery"]["per_fault"]
    assert sorted(f["kind"] for f in faults) == ["hang", "node_lost", "rank_lost"]
    for f in faults:
        assert f["decision_s"] is not None and f["first_step_s"] is not None, f
        assert 0 < f["decision_s"] < f["first_step_s"] < 60, f
    by = {f["kind"]: f for f in faults}
    # a lost node is seen by its heartbeat timeout, a hang by the hang floor at the
    # earliest; a rank that dies is seen by its supervisor at once
    assert by["node_lost"]["decision_s"] >= shape["heartbeat_timeout_s"] - 1
    assert by["hang"]["decision_s"] >= shape["hang_floor_s"] - 1
    assert by["rank_lost"]["decision_s"] < by["node_lost"]["decision_s"]

    goodput = count["goodput"]
    assert goodput["within_1pct"], goodput
    assert 0.2 < goodput["from_record"] < 1.0
    assert goodput["record_productive_s"] == pytest.approx(goodput["truth_productive_s"],
                                                           rel=1e-3)

    cost = count["cost"]
    assert cost["host"]["rss_mb_per_node"] > 0 and cost["host"]["cores_per_node"] > 0
    assert cost["host"]["heartbeat_calls_per_node_s"] > 0.5  # a running member beats
    assert cost["orchestrator"]["cpu_cores"] > 0 and cost["temporal_server"]["cpu_cores"] > 0
    history = count["history"]["run"]
    assert history["runs"] >= 2  # continued as new every train.segments_per_run segments
    assert 0 < history["largest_events_of_limit"] < 0.1
    assert count["record"]["events"]["lines_per_sim_day"] > 0
    assert out["machine"]["max_nodes"] > 0
    assert sorted(os.listdir(tmp_path / "plots")) == ["scale_cost.png", "scale_recovery.png"]
