"""Multi-node segments on one machine (issue 15), loopback variant: two trainer workers,
each a node of its own (`--node`, its own queue, fast tier and rendezvous port), under a
real Temporal dev server; the workflow gang-schedules one train_segment per node and each
launches torchrun for its node (static rendezvous on node 0's address). The namespace
variant, where each node is a host of its own network stack, is tests/e2e/test_netns_run.py.
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
from tests.e2e.runs import run_in_background, run_to_end, tiny_spec, wait_for

pytestmark = pytest.mark.e2e

# Two segments (a boundary crossed on both nodes), a commit every 5 steps.
SMALL = {"train.total_steps": 20, "train.segment_steps": 10, "train.segments_per_run": 4,
         "train.checkpoint_every": 5, "train.micro_batch_tokens": 512, "sweep.enabled": False,
         "ops.heartbeat_timeout_s": 8.0}


def node_fleets(fleet_factory, tmp_path, names=("h0", "h1"), address="127.0.0.1"):
    """One trainer worker per node name, each with its own fast tier and rendezvous port."""
    return {name: fleet_factory(roles=("trainer",), log_dir=f"logs-{name}", args=(
        "--node", name, "--node-address", address, "--rdzv-port", str(free_port()),
        "--fast-root", str(tmp_path / f"fast-{name}"))) for name in names}


def registered(address: str) -> list[str]:
    async def ask():
        client = await connect(address)
        from activities.contracts import NODE_REGISTRY_ID, NodeInfo
        try:
            found = await client.get_workflow_handle(NODE_REGISTRY_ID).query(
                "nodes", result_type=list[NodeInfo])
        except Exception:  # noqa: BLE001 - not started yet
            return []
        return [n.name for n in found if time.time() - n.seen < 15]
    return asyncio.run(ask())


def model_weights(spec, step: int) -> dict[str, torch.Tensor]:
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    path = store.path(step, "mp_rank_00_model_states.pt")
    return torch.load(path, map_location="cpu", weights_only=False)["module"]


def test_multinode_a_segment_on_two_nodes_trains_both_ranks_commits_once_per_interval_and_matches_one_host_bitwise(
        temporal_server, fleet_factory, tmp_path):
    fleet_factory(roles=("orchestrator", "data"))
    node_fleets(fleet_factory, tmp_path)
    wait_for(lambda: len(registered(temporal_server.address)) == 2, 60, "two nodes registered")
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
