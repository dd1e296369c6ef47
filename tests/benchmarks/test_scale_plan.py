"""The scale harness's pure parts (benchmarks/scale_plan.py, benchmarks/scale_sim.py's
argument reading): the fault draw, time compression and the figures made from samples."""

from __future__ import annotations

import pytest

from activities.contracts import GangMember
from activities.supervise import trainer_command
from benchmarks.scale_plan import (
    DAY_S,
    Compression,
    draw_strikes,
    even_strikes,
    fault_boost,
    faults_per_node_day,
    history_figures,
    machine_limit,
    per_node_cost,
    percentile,
    recovery_marks,
    spares_for,
    truth_goodput,
)
from benchmarks.scale_sim import trainer_args


def test_llama3_rate_is_419_interruptions_in_54_days_on_2048_nodes():
    assert faults_per_node_day() * 2048 * 54 == pytest.approx(419)


def test_compression_shrinks_simulated_time_and_refuses_a_slowdown():
    c = Compression(factor=60)
    assert c.real_s(DAY_S) == 1440.0 and c.sim_s(1440.0) == DAY_S
    with pytest.raises(ValueError, match="compress"):
        Compression(factor=0.5)


def test_a_1024_node_month_draws_about_llama3s_rate_in_kinds_rotating():
    c = Compression(factor=1000)
    strikes = draw_strikes(1024, 30, c, boost=1.0, seed=1)
    expected = faults_per_node_day() * 1024 * 30  # ~116
    assert abs(len(strikes) - expected) < 4 * expected ** 0.5
    times = [s.at_s for s in strikes]
    assert times == sorted(times) and 0 < times[0] and times[-1] < c.real_s(30 * DAY_S)
    assert [s.kind for s in strikes[:5]] == ["node_lost", "rank_lost", "hang",
                                             "server_restart", "node_lost"]
    assert draw_strikes(1024, 30, c, boost=1.0, seed=1) == strikes  # reproducible


def test_strikes_keep_the_settle_gap_between_them():
    strikes = draw_strikes(64, 1, Compression(factor=60), boost=200.0, settle_s=30.0)
    assert len(strikes) > 3
    assert all(b.at_s - a.at_s >= 30.0 - 1e-6 for a, b in zip(strikes, strikes[1:]))


def test_the_auto_boost_brings_the_wanted_faults_and_never_slows_the_rate():
    boost = fault_boost(64, 1.0, want=6)
    assert faults_per_node_day() * 64 * boost == pytest.approx(6)
    assert fault_boost(2048, 54, want=6) == 1.0  # Llama 3 itself needs no boost
    assert fault_boost(64, 1.0, want=6, asked=3.0) == 3.0


def test_even_strikes_spread_over_the_span_and_every_lost_node_has_a_spare():
    strikes = even_strikes(3, 80.0, ("node_lost", "rank_lost"))
    assert [(s.at_s, s.kind) for s in strikes] == [(20.0, "node_lost"), (40.0, "rank_lost"),
                                                   (60.0, "node_lost")]
    assert spares_for(strikes) == 3
    # no closer than the settle gap: a recovery is timed before the next fault
    assert [s.at_s for s in even_strikes(3, 80.0, settle_s=25.0)] == [25.0, 50.0, 75.0]


def test_bad_draw_inputs_name_what_is_wrong():
    with pytest.raises(ValueError, match="nodes >= 1"):
        draw_strikes(0, 1, Compression(factor=10), boost=1.0)


def test_nearest_rank_percentiles():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(map(float, range(1, 101))), 99) == 99.0
    assert percentile([5.0], 99) == 5.0


def test_recovery_marks_take_the_first_decision_and_the_first_step_after_it():
    marks = recovery_marks(100.0, decisions=[90.0, 110.0, 130.0], first_steps=[105.0, 111.5])
    assert marks == {"decision_s": 10.0, "first_step_s": 11.5}
    # marks past the next strike belong to it
    assert recovery_marks(100.0, [110.0], [111.5], until_ts=105.0) == {
        "decision_s": None, "first_step_s": None}


def test_per_node_cost_is_per_simulated_hour_and_the_machine_limit_names_what_binds():
    cost = per_node_cost(cpu_s=60.0, rss_bytes=100 * 2**20, wall_s=60.0, nodes=10,
                         compress=Compression(factor=60))
    assert cost == {"cpu_s_per_node_sim_hour": 6.0, "cores_per_node": 0.1,
                    "rss_mb_per_node": 10.0}
    limit = machine_limit(0.1, 10.0, cores=2, mem_mb=1000)
    assert limit["max_nodes_by_cpu"] == 20 and limit["max_nodes_by_memory"] == 100
    assert (limit["binding"], limit["max_nodes"]) == ("cpu", 20)


def test_truth_goodput_keeps_each_steps_last_execution():
    execs = [{"step": 1, "time_s": 1.0, "end": 1.0}, {"step": 2, "time_s": 1.0, "end": 2.0},
             {"step": 2, "time_s": 3.0, "end": 9.0}]  # step 2 replayed after a fault
    truth = truth_goodput(execs, wall_s=10.0)
    assert truth["productive_s"] == 4.0 and truth["goodput"] == 0.4
    assert (truth["steps_kept"], truth["steps_executed"]) == (2, 3)


def test_history_figures_against_temporals_limits():
    runs = [{"events": 25600, "bytes": 5 * 2**20}, {"events": 100, "bytes": 1000}]
    h = history_figures(runs, sim_days=2.0)
    assert h["events_per_sim_day"] == 12850 and h["continue_as_new_per_sim_day"] == 0.5
    assert h["largest_events_of_limit"] == 0.5 and h["largest_bytes_of_limit"] == 0.1


def test_the_simulated_child_reads_the_supervisors_gang_command_line():
    gang = GangMember(node="n3", node_rank=3, nnodes=8, master="10.0.0.1:29500", session="s/0")
    cmd = trainer_command("trainer.segment", 1, [
        "--spec", "/w/spec.json", "--to-step", "240", "--workdir", "/w", "--attempt", "2",
        "--checkpoint-every", "40", "--nnodes", "8", "--session", "s/0", "--unfinished",
        "--restart", "1"], gang)
    a = trainer_args(cmd)
    assert (a["node_rank"], a["procs"], a["nnodes"], a["session"]) == (3, 1, 8, "s/0")
    assert (a["to_step"], a["attempt"], a["restart"], a["checkpoint_every"]) == (240, 2, 1, 40)
    assert a["unfinished"] is True and a["workdir"] == "/w"
