"""Multi-node segments on one machine, loopback variant: two trainer workers,
each a node of its own (`--node`, its own queue, fast tier and rendezvous port), under a
real Temporal dev server; the workflow gang-schedules one train_segment per node and each
launches torchrun for its node (static rendezvous on node 0's address). The namespace
variant, where each node is a host of its own network stack, is tests/e2e/test_netns_run.py;
where it runs, the tests it repeats here are skipped.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from ops.client import connect
from ops.services import free_port
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.e2e.netns import netns_unavailable
from tests.e2e.runs import run_in_background, run_to_end, tiny_spec, wait_for

pytestmark = pytest.mark.e2e
# the same run across namespace hosts (test_netns_run.py) covers it where those can be made
loopback_only = pytest.mark.skipif(
    netns_unavailable() is None,
    reason="namespaces available: tests/e2e/test_netns_run.py runs this across hosts")

# Two segments (a boundary crossed on both nodes), a commit every 5 steps.
SMALL = {"train.total_steps": 20, "train.segment_steps": 10, "train.segments_per_run": 4,
         "train.checkpoint_every": 5, "train.micro_batch_tokens": 512, "sweep.enabled": False,
         "ops.heartbeat_timeout_s": 8.0}


def node_fleets(fleet_factory, tmp_path, names=("h0", "h1"), address="127.0.0.1",
                restart=False):
    """One trainer worker per node name, each with its own fast tier and rendezvous port."""
    return {name: fleet_factory(roles=("trainer",), log_dir=f"logs-{name}", restart=restart, args=(
        "--node", name, "--node-address", address, "--rdzv-port", str(free_port()),
        "--fast-root", str(tmp_path / f"fast-{name}"))) for name in names}


def two_nodes(fleet_factory, tmp_path, address: str, restart: bool = False) -> dict:
    """Orchestrator and data workers, and two trainer nodes h0 and h1, both registered."""
    fleet_factory(roles=("orchestrator", "data"))
    fleets = node_fleets(fleet_factory, tmp_path, restart=restart)
    wait_for(lambda: len(registered(address)) == 2, 60, "two nodes registered")
    return fleets


def registered(address: str) -> list[str]:
    """The healthy nodes of the running registry. A closed one (an earlier test's teardown
    terminates every workflow) still answers the query from its last state: its nodes are
    the workers of that test, and waiting on them let a test start before its own
    workers had announced themselves."""
    async def ask():
        client = await connect(address)
        from activities.contracts import NODE_REGISTRY_ID, NodeInfo
        handle = client.get_workflow_handle(NODE_REGISTRY_ID)
        try:
            if (await handle.describe()).status.name != "RUNNING":
                return []
            found = await handle.query("nodes", result_type=list[NodeInfo])
        except Exception:  # noqa: BLE001 - not started yet
            return []
        return [n.name for n in found if time.time() - n.seen < 15]
    return asyncio.run(ask())


def model_weights(spec, step: int) -> dict[str, torch.Tensor]:
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    path = store.path(step, "mp_rank_00_model_states.pt")
    return torch.load(path, map_location="cpu", weights_only=False)["module"]


@loopback_only
def test_multinode_a_segment_on_two_nodes_trains_both_ranks_commits_once_per_interval_and_matches_one_host_bitwise(
        temporal_server, fleet_factory, tmp_path):
    two_nodes(fleet_factory, tmp_path, temporal_server.address)
    spec = tiny_spec("e2e-multinode", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **SMALL, **{"train.nodes": 2, "train.procs_per_node": 1})
    result = asyncio.run(run_to_end(temporal_server.address, spec, 600))
    assert result["status"] == "completed", result

    events = read_events(spec.storage.durable, spec.run_id)
    # both ranks trained: each node's supervisor saw its node's step lines
    for name in ("h0", "h1"):
        root = tmp_path / f"fast-{name}" / spec.run_id / "segments"
        lines = [json.loads(x) for p in root.glob("*/progress.jsonl")
                 for x in p.read_text().splitlines()]
        steps = sorted({x["step"] for x in lines if x.get("type") == "step"})
        assert steps == list(range(1, 21)), (name, steps)
    # one commit per interval, each listing both ranks' files in one manifest
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    committed = [e["step"] for e in events if e["kind"] == "checkpoint_committed"]
    assert sorted(set(committed)) == [0, 5, 10, 15, 20], committed
    for step in store.list_committed():
        names = set(store.manifest(step).files)
        assert {"train_state-rank0.pt", "train_state-rank1.pt"} <= names, (step, names)
        assert not store.verify(step)
    started = [e for e in events if e["kind"] == "segment_started"]
    assert len(started) == 2, started  # node 0 speaks for the gang

    # the same run on one host, world size 2, same seed: the same weights, bit for bit
    fleet_factory(roles=("trainer",), log_dir="logs-single")
    one = tiny_spec("e2e-multinode-ref", str(tmp_path / "store"), str(tmp_path / "fast-ref"),
                    **SMALL, **{"train.nodes": 1, "train.procs_per_node": 2})
    ref = asyncio.run(run_to_end(temporal_server.address, one, 600))
    assert ref["status"] == "completed", ref
    a, b = model_weights(spec, 20), model_weights(one, 20)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_multinode_two_nodes_wanted_and_one_registered_waits_and_says_so_in_status(
        temporal_server, fleet_factory, tmp_path, capsys):
    fleet_factory(roles=("orchestrator", "data"))
    node_fleets(fleet_factory, tmp_path, names=("solo",))
    wait_for(lambda: "solo" in registered(temporal_server.address), 60, "the node registered")
    spec = tiny_spec("e2e-multinode-wait", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **SMALL, **{"train.nodes": 2, "train.procs_per_node": 1})
    run_in_background(temporal_server.address, spec, 120)

    async def status():
        client = await connect(temporal_server.address)
        try:
            return await client.get_workflow_handle(spec.run_id).query("status")
        except Exception:  # noqa: BLE001 - not started yet
            return {}
    st = wait_for(lambda: (s := asyncio.run(status())).get("stage") == "waiting_for_nodes" and s,
                  90, "the run waiting for nodes")
    assert "1 of 2 nodes available (solo)" in st["waiting_for_nodes"], st
    assert "--node" in st["waiting_for_nodes"]
    time.sleep(3)
    assert asyncio.run(status())["step"] == 0  # nothing trained on one host
    assert not (tmp_path / "fast-solo" / spec.run_id / "segments").exists()
    assert not CheckpointStore(spec.storage.durable, spec.run_id).list_committed()
    kinds = [e["kind"] for e in read_events(spec.storage.durable, spec.run_id)]
    assert "waiting_for_nodes" in kinds and "segment_started" not in kinds


# Steps slow enough to strike inside a segment: 40 steps, a commit every 10.
SLOW = {**SMALL, "train.total_steps": 40, "train.segment_steps": 40,
        "train.checkpoint_every": 10, "train.micro_batch_tokens": 4096,
        "ops.heartbeat_timeout_s": 6.0}


def node_step(fast_root, spec, segment: str = "000000000-000000040") -> int:
    path = fast_root / spec.run_id / "segments" / segment / "progress.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(x).get("step", 0) for x in path.read_text().splitlines()
             if '"type": "step"' in x]
    return max(steps, default=0)


def activity_ends(address: str, run_id: str) -> list[tuple[str, float]]:
    """(how, when) of every train_segment activity that ended, from the run's history."""
    async def read():
        client = await connect(address)
        history = await client.get_workflow_handle(run_id).fetch_history()
        out = []
        for e in history.events:
            name = e.WhichOneof("attributes") or ""
            if name.startswith("activity_task_") and name.split("_")[2] in (
                    "completed", "failed", "timed", "canceled"):
                out.append((name, e.event_time.ToDatetime().timestamp()))
        return out
    return asyncio.run(read())


@loopback_only
def test_multinode_a_killed_node_stops_its_peer_within_the_heartbeat_timeout_and_the_run_resumes_from_the_last_commit(
        temporal_server, fleet_factory, tmp_path):
    fleets = two_nodes(fleet_factory, tmp_path, temporal_server.address, restart=True)
    spec = tiny_spec("e2e-multinode-kill", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **SLOW, **{"train.nodes": 2, "train.procs_per_node": 1})
    runner, box = run_in_background(temporal_server.address, spec, 600)
    wait_for(lambda: node_step(tmp_path / "fast-h1", spec) >= 14, 240, "node h1 past step 14")
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    committed_before = store.list_committed()
    killed_at = time.time()
    fleets["h1"].kill("trainer")  # the worker; its torchrun and ranks die with it
    runner.join(600)
    assert box.get("result", {}).get("status") == "completed", box

    events = read_events(spec.storage.durable, spec.run_id)
    faults = [e for e in events if e["kind"] == "fault"]
    lost = [e for e in faults if e["payload"]["kind"] == "worker_lost"]
    assert lost and lost[0]["payload"]["node"] == "h1", faults
    [recovered] = [e["payload"] for e in events if e["kind"] == "recovered"]
    assert recovered["fault_event_id"] == lost[0]["event_id"], recovered
    # the peer's own fault (its collective broke) is answered by the same recovery
    peer = [e["event_id"] for e in faults if e is not lost[0]]
    assert set(peer) <= set(recovered.get("also_answers", [])), (peer, recovered)
    assert recovered["resumed_step"] == max(s for s in committed_before if s <= 40)
    assert set(committed_before) <= set(store.list_committed())  # nothing committed lost
    # every member of the launch the kill broke ended within heartbeat timeout + 10 s
    ends = [when for how, when in activity_ends(temporal_server.address, spec.run_id)
            if when > killed_at]
    first_launch_ends = sorted(ends)[:2]
    assert len(first_launch_ends) == 2
    assert max(first_launch_ends) - killed_at <= spec.ops.heartbeat_timeout_s + 10, (
        [e - killed_at for e in ends])
    print(f"\nmultinode kill: members ended {[round(e - killed_at, 1) for e in first_launch_ends]}"
          f" s after the kill (heartbeat timeout {spec.ops.heartbeat_timeout_s}s)")


def elastic_spec(run_id: str, tmp_path, bad_node: str):
    """Two nodes, one allowed; a bad host: its rank fails at step 7 whenever it runs."""
    return tiny_spec(run_id, str(tmp_path / "store"), str(tmp_path / "fast"),
                     **{**SMALL, "train.segment_steps": 20},
                     **{"train.nodes": 2, "train.min_nodes": 1, "train.procs_per_node": 1,
                        "train.zero_stage": 2, "ops.node_failure_limit": 2,
                        "ops.node_wait_s": 2.0,
                        "faults": [{"kind": "crash", "at_step": 7, "node": bad_node}]})


def assert_set_aside_and_finished_on_one_node(spec, bad_node: str) -> None:
    """The bad node set aside after two failed launches, the run on one node from the
    two-node ZeRO-2 commit (resharded), every fault answered by a recovery."""
    events = read_events(spec.storage.durable, spec.run_id)
    [aside] = [e["payload"] for e in events if e["kind"] == "node_set_aside"]
    assert aside["node"] == bad_node and aside["failures"] == 2 and aside["kind"] == "crash"
    assert "injected crash at step 7" in aside["evidence"]
    [changed] = [e["payload"] for e in events if e["kind"] == "nodes_changed"]
    assert (changed["from_nodes"], changed["to_nodes"]) == (2, 1), changed
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    worlds = {s: store.manifest(s).extra["world_size"] for s in store.list_committed()}
    assert worlds[5] == 2 and worlds[20] == 1, worlds  # written by two nodes, then by one
    assert "train_state-rank1.pt" not in store.manifest(20).files
    recovered = [e["payload"] for e in events if e["kind"] == "recovered"]
    assert recovered[-1]["resumed_step"] == 5, recovered  # the two-node commit, resharded
    answered = {r["fault_event_id"] for r in recovered} | {
        x for r in recovered for x in r.get("also_answers", [])}
    faults = {e["event_id"] for e in events if e["kind"] == "fault"}
    assert faults <= answered, (faults, recovered)


# Soak: the parts, each in the default suite: tests/workflows/test_gang.py (a node that
# fails node_failure_limit launches in a row is set aside with its evidence; an elastic run
# shrinks to the nodes left after the wait), tests/trainer/test_elastic.py (the global
# batch and data cursor at the new world size), tests/trainer/test_safe_load.py (a real
# ZeRO checkpoint reshards), and the two-node segment run of the bitwise test (in
# test_netns_run.py where namespaces can be made, else in test_multinode.py).
@pytest.mark.soak
@loopback_only
def test_multinode_a_node_that_keeps_failing_is_set_aside_and_the_run_finishes_on_one_node_from_the_resharded_zero2_checkpoint(
        temporal_server, fleet_factory, tmp_path):
    two_nodes(fleet_factory, tmp_path, temporal_server.address)
    spec = elastic_spec("e2e-multinode-elastic", tmp_path, "h1")
    result = asyncio.run(run_to_end(temporal_server.address, spec, 600))
    assert result["status"] == "completed", result
    assert_set_aside_and_finished_on_one_node(spec, "h1")
