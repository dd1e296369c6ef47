"""Multi-node runs across hosts: each "host" a Linux network namespace with its
own network stack (tests/e2e/netns.py), joined by veth pairs to a bridge; the Temporal dev
server listens on the bridge address; each host runs its own trainer worker (`--node`,
`--node-address` its veth address, its own fast tier); gloo and the rendezvous store talk
over the veths. Nothing is sent outside the namespaces and the bridge. Skipped, with the
reason, where namespaces cannot be created; tests/e2e/test_multinode.py is the loopback
variant of the same runs.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from common.procs import WorkerFleet
from ops.client import connect
from ops.services import TemporalDevServer, free_port
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.e2e.conftest import terminate_running
from tests.e2e.netns import NetnsCluster, netns_unavailable
from tests.e2e.runs import run_in_background, run_to_end, tiny_spec, wait_for
from tests.e2e.test_multinode import (
    SLOW,
    SMALL,
    activity_ends,
    assert_set_aside_and_finished_on_one_node,
    elastic_spec,
    model_weights,
    node_step,
)

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(netns_unavailable() is not None,
                                                  reason=f"{netns_unavailable()}")]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Two namespace hosts, and a Temporal dev server they reach on their bridge: the
    server on loopback, relayed from the bridge address (the dev server dials its own
    services on 127.0.0.1 whatever --ip says: tests/e2e/netns.py)."""
    with NetnsCluster(n_hosts=2) as cluster:
        server = TemporalDevServer(str(tmp_path_factory.mktemp("netns-temporal")),
                                   port=free_port(), headless=True).start()
        try:
            yield cluster, server, cluster.forward(server.port)
        finally:
            server.stop()


@pytest.fixture(scope="module")
def cluster_workers(hosts, tmp_path_factory):
    """The orchestrator and data workers in the root namespace, one trainer worker (a
    node) per namespace host; all on the bridge's Temporal server. One set for the
    module's tests: the workers of a test's runs are the same whatever the run (a killed
    node's worker comes back by itself: restart=True), and a set takes seconds to start
    and to register."""
    cluster, server, bridged = hosts
    root = tmp_path_factory.mktemp("netns-workers")
    fleets = [WorkerFleet(server.address, roles=("orchestrator", "data"),
                          log_dir=str(root / "logs-root")).start()]
    nodes = {}
    try:
        for i, host in enumerate(cluster.hosts):
            nodes[f"host{i}"] = WorkerFleet(
                bridged, roles=("trainer",), log_dir=str(root / f"logs-host{i}"), restart=True,
                wrap=tuple(host.argv([])), env={"GLOO_SOCKET_IFNAME": host.ifname},
                args=("--node", f"host{i}", "--node-address", host.address,
                      "--rdzv-port", "29400", "--fast-root", str(root / f"fast-host{i}"))
            ).start()
            fleets.append(nodes[f"host{i}"])
        yield server, nodes, root
    finally:
        for fleet in fleets:
            fleet.stop()


@pytest.fixture
def cluster_fleet(cluster_workers):
    """The module's workers, both hosts registered; what a test's runs left running is
    terminated when it ends (the next test's workers would pick it up), the node registry
    kept (its nodes are the module's)."""
    from activities.contracts import NODE_REGISTRY_ID

    server, nodes, root = cluster_workers
    wait_for(lambda: len(registered(server.address)) == 2, 90, "both hosts registered")
    yield server, nodes, root
    asyncio.run(terminate_running(server.address, "end of test", keep=frozenset({NODE_REGISTRY_ID})))


def registered(address: str) -> list[str]:
    from tests.e2e.test_multinode import registered as names
    return names(address)


def test_multinode_a_segment_runs_across_two_namespace_hosts_and_matches_a_one_host_run_bitwise(
        cluster_fleet, fleet_factory, tmp_path):
    server, _, root = cluster_fleet
    spec = tiny_spec("e2e-netns", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **SMALL, **{"train.nodes": 2, "train.procs_per_node": 1})
    result = asyncio.run(run_to_end(server.address, spec, 600))
    assert result["status"] == "completed", result
    for i in range(2):  # both ranks trained, each on its own host
        assert node_step(root / f"fast-host{i}", spec, "000000010-000000020") == 20
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    events = read_events(spec.storage.durable, spec.run_id)
    committed = sorted({e["step"] for e in events if e["kind"] == "checkpoint_committed"})
    assert committed == [0, 5, 10, 15, 20]
    assert {"train_state-rank0.pt", "train_state-rank1.pt"} <= set(store.manifest(20).files)

    fleet_factory(roles=("trainer",), address=server.address, log_dir="logs-one-host")
    one = tiny_spec("e2e-netns-ref", str(tmp_path / "store"), str(tmp_path / "fast-ref"),
                    **SMALL, **{"train.nodes": 1, "train.procs_per_node": 2})
    assert asyncio.run(run_to_end(server.address, one, 600))["status"] == "completed"
    a, b = model_weights(spec, 20), model_weights(one, 20)
    import torch
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_multinode_killing_one_hosts_worker_stops_the_other_host_within_the_heartbeat_timeout_and_the_run_completes(
        cluster_fleet, tmp_path):
    server, nodes, root = cluster_fleet
    spec = tiny_spec("e2e-netns-kill", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **SLOW, **{"train.nodes": 2, "train.procs_per_node": 1})
    runner, box = run_in_background(server.address, spec, 600)
    wait_for(lambda: node_step(root / "fast-host1", spec) >= 14, 240, "host1 past step 14")
    committed_before = CheckpointStore(spec.storage.durable, spec.run_id).list_committed()
    killed_at = time.time()
    nodes["host1"].kill("trainer")
    runner.join(600)
    assert box.get("result", {}).get("status") == "completed", box

    events = read_events(spec.storage.durable, spec.run_id)
    lost = [e for e in events if e["kind"] == "fault" and e["payload"]["kind"] == "worker_lost"]
    assert lost and lost[0]["payload"]["node"] == "host1", lost
    [recovered] = [e["payload"] for e in events if e["kind"] == "recovered"]
    assert recovered["fault_event_id"] == lost[0]["event_id"]
    assert recovered["resumed_step"] == max(committed_before)
    ends = sorted(when for _, when in activity_ends(server.address, spec.run_id)
                  if when > killed_at)[:2]
    assert max(ends) - killed_at <= spec.ops.heartbeat_timeout_s + 10, ends
    print(f"\nnetns kill: members ended {[round(e - killed_at, 1) for e in ends]} s after "
          f"the kill (heartbeat timeout {spec.ops.heartbeat_timeout_s}s)")


# Soak: the parts, each in the default suite: tests/workflows/test_gang.py (a node that
# fails node_failure_limit launches in a row is set aside with its evidence; an elastic run
# shrinks to the nodes left after the wait), tests/trainer/test_elastic.py (the global
# batch and data cursor at the new world size), tests/trainer/test_safe_load.py (a real
# ZeRO checkpoint reshards), and the two-node segment run of the bitwise test (in
# test_netns_run.py where namespaces can be made, else in test_multinode.py).
@pytest.mark.soak
def test_multinode_a_host_that_keeps_failing_is_set_aside_and_the_run_finishes_on_the_other_from_the_resharded_zero2_checkpoint(
        cluster_fleet, tmp_path):
    server, _, _ = cluster_fleet
    spec = elastic_spec("e2e-netns-elastic", tmp_path, "host1")
    result = asyncio.run(run_to_end(server.address, spec, 600))
    assert result["status"] == "completed", result
    assert_set_aside_and_finished_on_one_node(spec, "host1")


def test_multinode_registry_sees_each_host_at_its_own_address(cluster_fleet, hosts):
    cluster = hosts[0]
    server, _, _ = cluster_fleet

    async def nodes():
        from activities.contracts import NODE_REGISTRY_ID, NodeInfo
        client = await connect(server.address)
        return await client.get_workflow_handle(NODE_REGISTRY_ID).query(
            "nodes", result_type=list[NodeInfo])
    got = {n.name: n.address for n in asyncio.run(nodes())}
    assert got == {f"host{i}": h.address for i, h in enumerate(cluster.hosts)}
