"""The checkpoint interval of `train.checkpoint_every: "auto"` (workflows/interval.py):
Young-Daly with literal inputs, the MTBF from the prior and the run's faults, and the choice
from a literal carry."""

from __future__ import annotations

import pytest

from spec import preset
from workflows.carry import RunCarry
from workflows.interval import choose, observed_mtbf, young_daly_steps


def test_young_daly_is_the_square_root_of_twice_cost_times_mtbf_in_steps():
    # sqrt(2 x 2 s x 3600 s) = 120 s = 240 steps of 0.5 s
    assert young_daly_steps(2.0, 3600.0, 0.5, lo=10, hi=1000) == 240
    # sqrt(2 x 1 s x 50 s) = 10 s = 33.3 steps of 0.3 s: the nearest
    assert young_daly_steps(1.0, 50.0, 0.3, lo=1, hi=1000) == 33
    # four times the MTBF: twice the interval
    assert young_daly_steps(2.0, 4 * 3600.0, 0.5, lo=10, hi=1000) == 480


def test_young_daly_is_clamped_to_its_bounds():
    assert young_daly_steps(2.0, 3600.0, 0.5, lo=10, hi=100) == 100
    # sqrt(2 x 0.02 s x 100 s) = 2 s = 4 steps of 0.5 s, below the lower bound
    assert young_daly_steps(0.02, 100.0, 0.5, lo=10, hi=100) == 10


def test_the_prior_mtbf_holds_until_the_run_has_seen_faults():
    assert observed_mtbf(0.0, 0, prior_mtbf_s=21600.0, prior_faults=3) == 21600.0
    # fault-free time raises it: 3 pseudo-faults over 3 x 3600 + 36000 s
    assert observed_mtbf(36000.0, 0, prior_mtbf_s=3600.0, prior_faults=3) == 15600.0


def test_each_fault_seen_replaces_one_prior_fault_until_the_runs_own_rate_alone_counts():
    # (1800 s + 2 prior faults x 3600 s) / 3 faults
    assert observed_mtbf(1800.0, 1, prior_mtbf_s=3600.0, prior_faults=3) == 3000.0
    assert observed_mtbf(1800.0, 2, prior_mtbf_s=3600.0, prior_faults=3) == 1800.0
    assert observed_mtbf(1800.0, 3, prior_mtbf_s=3600.0, prior_faults=3) == 600.0
    assert observed_mtbf(1800.0, 4, prior_mtbf_s=3600.0, prior_faults=3) == 450.0
    # one prior fault: the first fault seen replaces the prior entirely
    assert observed_mtbf(40.0, 1, prior_mtbf_s=1e6, prior_faults=1) == 40.0


AUTO = {"train.checkpoint_every": "auto", "train.checkpoint_every_min": 10,
        "train.segment_steps": 100, "train.total_steps": 1000, "ops.mtbf_s": 3600.0,
        "ops.mtbf_prior_faults": 3}


def test_a_run_with_nothing_measured_checkpoints_at_the_lower_bound():
    chosen = choose(preset("demo", **AUTO), RunCarry())
    assert chosen.steps == 10
    assert chosen.payload["steps"] == 10 and "lower bound" in chosen.payload["how"]
    assert (chosen.payload["mtbf_s"], chosen.payload["mtbf_source"]) == (3600.0, "prior")


def test_the_interval_shrinks_once_the_runs_own_faults_replace_the_prior():
    spec = preset("demo", **AUTO)
    # two checkpoints stalled 4 s together: C = 2 s; steps of 0.5 s
    measured = {"checkpoint_stall_s": 4.0, "checkpoints_measured": 2, "step_time_s": 0.5}
    calm = choose(spec, RunCarry.from_json(measured))
    assert calm.steps == 100  # sqrt(2 x 2 x 3600) = 120 s = 240 steps: the segment bound
    assert calm.payload["young_daly_s"] == 120.0 and calm.payload["checkpoint_cost_s"] == 2.0
    # 3 faults in 1200 s: M = 400 s, sqrt(2 x 2 x 400) = 40 s = 80 steps
    faulty = choose(spec, RunCarry.from_json(
        {**measured, "train_wall_s": 1200.0, "faults_seen": 3}))
    assert faulty.steps == 80
    p = faulty.payload
    assert (p["mtbf_s"], p["mtbf_source"], p["faults"], p["train_wall_s"]) == \
        (400.0, "observed", 3, 1200.0)
    assert (p["young_daly_s"], p["seconds"], p["steps_at_prior"]) == (40.0, 40.0, 100)
    assert (p["min_steps"], p["max_steps"], p["step_time_s"]) == (10, 100, 0.5)


@pytest.mark.parametrize("every", [25, "auto"])
def test_the_first_interval_is_the_specs_number_or_the_auto_lower_bound(every):
    spec = preset("demo", **{**AUTO, "train.checkpoint_every": every})
    assert spec.train.first_checkpoint_every == (25 if every == 25 else 10)
