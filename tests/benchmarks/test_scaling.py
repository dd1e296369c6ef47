"""benchmarks/scaling.py: its figures from literal launches, and a real quick run's JSON line
(DeepSpeed on gloo under torchrun, two steps a launch)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from benchmarks.scaling import (
    PROBE_BYTES,
    autogroup,
    background,
    choose_hosts,
    figures,
    host_split,
    layout,
    main,
    node_launches,
    other_runnable_groups,
)
from tests.e2e.netns import NetnsHost


def run(ranks: int, loop_s: float, allreduce_s: float | None, cpu_s: float) -> dict:
    return {"ranks": ranks, "loop_s": loop_s, "steps": 10, "tokens_per_step": 1024,
            "params": 1_000_000, "allreduce_s": allreduce_s, "background": 0.0,
            "cpu_s": [cpu_s] * ranks}


def test_speedups_are_tokens_per_second_over_one_rank_and_the_plan_uses_the_probed_link():
    # 0.1 s a step alone, all of it CPU; 2 ranks 0.11 s; 4 ranks 0.22 s (half a core each)
    out = figures({1: run(1, 1.0, None, 1.0), 2: run(2, 1.1, 0.004, 1.0),
                   4: run(4, 2.2, 0.006, 1.0)}, cores=2)
    assert out["tokens_per_s"]["1"] == pytest.approx(10240.0)
    assert out["measured"] == pytest.approx({"2": 2 / 1.1, "4": 4 / 2.2})
    # the probe: 2·(1/2)·4 MiB in 4 ms; the gradients: 1M fp32 = 4 MB, 2·(1/2)·4 MB of them
    assert out["link_bytes_per_s"]["2"] == pytest.approx(PROBE_BYTES / 0.004)
    comm_2 = 4e6 / (PROBE_BYTES / 0.004)
    assert out["predicted_comm_s"]["2"] == pytest.approx(comm_2)
    assert out["predicted"]["2"] == pytest.approx(2 * 0.1 / (0.1 + comm_2))
    comm_4 = 6e6 / (1.5 * PROBE_BYTES / 0.006)
    assert out["predicted"]["4"] == pytest.approx(4 * 0.1 / (0.2 + comm_4))
    assert out["error"]["4"] == pytest.approx(out["predicted"]["4"] / out["measured"]["4"] - 1)
    assert out["cpu_share"] == {"1": 1.0, "2": 1.0, "4": 0.5}
    assert out["observed_share"] == pytest.approx({"1": 1.0, "2": 1 / 1.1, "4": 1 / 2.2})
    assert out["core_step_ratio"] == pytest.approx({"1": 1.0, "2": 1.0, "4": 1.0})


def test_the_ranks_cpu_per_step_is_set_beside_the_lone_ranks():
    # 4 ranks that each spent 1.2 s of CPU on the 10 steps the lone rank did in 1.0 s
    out = figures({1: run(1, 1.0, None, 1.0), 4: run(4, 2.6, 0.006, 1.2)}, cores=2)
    assert out["core_step_ratio"] == pytest.approx({"1": 1.0, "4": 1.2})
    assert out["core_step_1_s"] == pytest.approx(0.1)


def test_background_is_the_mean_of_the_samples_inside_the_timed_steps():
    samples = [(9.0, 5), (10.0, 1), (10.5, 2), (11.0, 3), (12.0, 7)]
    assert background(samples, [10.0, 11.0]) == pytest.approx(2.0)
    assert background(samples[:1], [10.0, 11.0]) == 5  # none inside: all of them
    assert background([], [10.0, 11.0]) == 0.0


def test_other_runnable_groups_leave_out_our_own_process_tree():
    # this test's own thread is running as it scans: it is in its own tree
    assert str(os.getpid()) not in other_runnable_groups(os.getpid())


@pytest.mark.process
def test_a_process_without_a_readable_autogroup_has_none_rather_than_failing_the_scan():
    # a process that has ended (and, on machines with autogroup off or in some
    # containers, every process) has no group to read: the scan must not fail on it
    child = subprocess.Popen(["true"])
    child.wait()
    assert autogroup(child.pid) is None
    mine = autogroup(os.getpid())
    assert mine is None or mine.startswith("/autogroup-")


def test_only_the_largest_launch_spreads_over_the_hosts_in_nodes_of_two_or_more_ranks():
    assert host_split([1, 2, 4], 2) == {1: 1, 2: 1, 4: 2}
    assert host_split([1, 2, 4], 1) == {1: 1, 2: 1, 4: 1}
    # a short list keeps its 2-rank launch whole rather than two nodes of one rank
    assert host_split([1, 2], 2) == {1: 1, 2: 1}
    # an uneven split is not made: torchrun's nodes have one size
    assert host_split([1, 2, 6], 4) == {1: 1, 2: 1, 6: 1}
    assert host_split([1, 8], 2) == {1: 1, 8: 2}


def test_two_hosts_by_default_and_one_with_the_reason_where_namespaces_cannot_be_made():
    assert choose_hosts(None, None) == (2, None)
    hosts, note = choose_hosts(None, "network namespaces need root (euid 1000)")
    assert hosts == 1 and "need root" in note and note.startswith("one host")
    assert choose_hosts(2, "no `ip` binary")[0] == 1
    assert choose_hosts(1, None) == (1, None)


def test_the_layout_says_which_launch_crossed_hosts():
    assert "one host" in layout({1: 1, 2: 1, 4: 1})
    two = layout({1: 1, 2: 1, 4: 2})
    assert "1 and 2 rank(s) on one host" in two
    assert "4 as 2 torchrun nodes of 2 ranks in 2 network namespace hosts" in two


def test_a_two_host_launch_is_two_torchrun_nodes_rendezvousing_on_host_0s_namespace():
    hosts = [NetnsHost(name="ms-x-h0", address="10.9.8.2"),
             NetnsHost(name="ms-x-h1", address="10.9.8.3", ifname="veth-b")]
    args = ["--rank-loop", "--steps", "3", "--out", "/o.json"]
    launches = node_launches(4, hosts, args, {"OMP_NUM_THREADS": "1"}, port=29504)
    assert len(launches) == 2
    for i, (argv, env) in enumerate(launches):
        # inside host i's namespace
        assert argv[:4] == ["ip", "netns", "exec", hosts[i].name]
        torchrun = argv[4:]
        assert torchrun[1:3] == ["-m", "torch.distributed.run"]
        # a static rendezvous with node ranks fixed: node 0 (rank 0) on host 0
        assert "--nnodes=2" in torchrun and f"--node-rank={i}" in torchrun
        assert "--master-addr=10.9.8.2" in torchrun and "--master-port=29504" in torchrun
        assert "--standalone" not in torchrun
        assert "--nproc_per_node=2" in torchrun  # 4 ranks, 2 a node
        assert torchrun[-len(args) - 2:] == ["-m", "benchmarks.scaling", *args]
        # gloo on the host's own interface; the caller's environment kept
        assert env == {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": hosts[i].ifname}
    with pytest.raises(ValueError, match="evenly"):
        node_launches(3, hosts, args, {}, port=29503)


# Soak: launches real ranks at 1 and 2 (15-20 s); the default suite checks the arithmetic
# and the JSON shape on literal launches above.
@pytest.mark.soak
def test_a_quick_run_prints_one_json_line_with_measured_and_predicted_speedups(capsys):
    assert main(["--quick", "--ranks", "2"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["figure"] == "scaling_speedup"
    for key in ("measured", "predicted", "error", "link_bytes_per_s"):
        assert set(line[key]) == {"2"} and line[key]["2"] == line[key]["2"]  # not NaN
    assert line["measured"]["2"] > 0 and line["predicted"]["2"] > 0
    assert line["tokens_per_s"]["1"] > 0 and line["params"] > 0 and line["step_1_s"] > 0
