"""One checkpoint commit for every rank on every node: a node other than 0 puts its files and
then its part record on the durable tier, node 0 waits for every part of this launch and
writes the one manifest, last, listing every rank's files. A part is never a commit, a
part of an earlier launch is never merged, and `parts/` never lands in a manifest."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from common.errors import BadData
from storage.checkpoints import MANIFEST, CheckpointStore, FileEntry, hash_dir
from storage.tiered import CheckpointWriterFailed, TieredCheckpointer, TierPolicy
from tests.storage.ckpt_helpers import durable, write_files

__all__ = ["durable"]  # fixture

STEP = 3


def node_files(node_rank: int, tag: bytes = b"a") -> dict[str, bytes]:
    """What DeepSpeed and the trainer write on node `node_rank` of a 2-rank gang (one rank
    a node): node 0 holds the weights and rank 0's shard, node 1 only rank 1's shard."""
    files = {f"zero_pp_rank_{node_rank}_mp_rank_00_optim_states.pt": tag * 2048 + bytes([node_rank]),
             f"train_state-rank{node_rank}.pt": b"state" + tag + bytes([node_rank])}
    if node_rank == 0:
        files["mp_rank_00_model_states.pt"] = b"weights" + tag * 1024
    return files


def gang_node(durable_url: str, fast_dir, node_rank: int, *, session: str = "launch-b",
              nnodes: int = 2, parts_timeout_s: float = 60.0) -> TieredCheckpointer:
    policy = TierPolicy(retry_s=0.2, retry_max_s=1.0, drain_timeout_s=30.0)
    return TieredCheckpointer(CheckpointStore(durable_url, "r"),
                              CheckpointStore.local(str(fast_dir)), policy, node_rank=node_rank,
                              nnodes=nnodes, session=session, parts_timeout_s=parts_timeout_s)


def save_on(ckpt: TieredCheckpointer, step: int, tag: bytes = b"a") -> None:
    write_files(ckpt.prepare(step), node_files(ckpt.node_rank, tag))
    ckpt.submit(step, tokens_seen=step * 10, data_cursor=step)


def entries(files: dict[str, bytes], directory) -> dict[str, FileEntry]:
    return hash_dir(write_files(directory, files))


def manifest_appears(store: CheckpointStore, step: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if store.fs.exists(store.path(step, MANIFEST)):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.process
def test_a_two_node_checkpoint_commits_once_after_both_nodes_files_with_one_manifest_listing_every_rank(  # noqa: E501
        durable, tmp_path):
    node0 = gang_node(durable, tmp_path / "fast0", 0)
    node1 = gang_node(durable, tmp_path / "fast1", 1)
    store = node0.durable
    seen = []
    node0.on_commit = lambda man, uri: seen.append(
        (man.step, store.fs.exists(store.part_path(man.step, 1))))
    try:
        save_on(node0, STEP)
        drained = threading.Thread(target=node0.drain)
        drained.start()
        drained.join(0.5)
        assert drained.is_alive() and not store.fs.exists(store.path(STEP, MANIFEST))
        save_on(node1, STEP)
        node1.drain()
        drained.join(30)
        assert not drained.is_alive()
    finally:
        node0.close()
        node1.close()
    assert seen == [(STEP, True)]  # committed once, and only after node 1's part was durable
    assert node0.committed == [STEP] and node1.committed == [] and node1.parts == [STEP]
    man = store.manifest(STEP)
    assert sorted(man.files) == sorted({**node_files(0), **node_files(1)})
    assert man.tokens_seen == STEP * 10 and store.verify(STEP) == []
    assert store.list_committed() == [STEP]


@pytest.mark.process
def test_node_0_does_not_commit_while_a_node_part_is_missing(tmp_path):
    node0 = gang_node(str(tmp_path / "durable"), tmp_path / "fast0", 0)
    store = node0.durable
    save_on(node0, STEP)
    assert not manifest_appears(store, STEP, within_s=1.0)
    assert store.latest_committed() is None and node0.in_flight() == [STEP]
    t0 = time.monotonic()
    node0.close()  # ends the wait for the part, as it ends the wait out of an outage
    assert time.monotonic() - t0 < 5
    assert not store.fs.exists(store.path(STEP, MANIFEST)) and node0.committed == []
    assert node0.fast.list_committed() == [STEP]  # still resumable on its own fast tier


@pytest.mark.process
def test_node_0_fails_the_job_naming_the_missing_node_after_the_parts_timeout(tmp_path):
    node0 = gang_node(str(tmp_path / "durable"), tmp_path / "fast0", 0, nnodes=3,
                      parts_timeout_s=0.5)
    try:
        write_files(tmp_path / "n1", node_files(1))
        assert node0.durable.commit_part(STEP, str(tmp_path / "n1"),
                                         files=hash_dir(str(tmp_path / "n1")), node_rank=1,
                                         session="launch-b")
        save_on(node0, STEP)
        with pytest.raises(CheckpointWriterFailed, match=r"node\(s\) 2 of session 'launch-b'"):
            node0.drain()
    finally:
        node0.close()
    assert node0.durable.latest_committed() is None


@pytest.mark.process
def test_a_part_from_an_earlier_launch_is_not_merged(tmp_path):
    url = str(tmp_path / "durable")
    old = write_files(tmp_path / "old", node_files(1, b"o"))
    assert CheckpointStore(url, "r").commit_part(STEP, old, files=hash_dir(old), node_rank=1,
                                                 session="launch-a")
    node0 = gang_node(url, tmp_path / "fast0", 0, session="launch-b")
    node1 = gang_node(url, tmp_path / "fast1", 1, session="launch-b")
    store = node0.durable
    try:
        save_on(node0, STEP)
        assert not manifest_appears(store, STEP, within_s=1.0)  # the stale part is not enough
        save_on(node1, STEP, tag=b"n")
        node1.drain()
        node0.drain()
    finally:
        node0.close()
        node1.close()
    fresh = entries(node_files(1, b"n"), tmp_path / "expected")
    man = store.manifest(STEP)
    assert {name: man.files[name] for name in fresh} == fresh and store.verify(STEP) == []


def test_parts_reads_only_well_formed_parts_of_its_session(durable, tmp_path):
    store = CheckpointStore(durable, "r")
    one = write_files(tmp_path / "n1", node_files(1))
    assert store.commit_part(STEP, one, files=hash_dir(one), node_rank=1, session="s")
    store.fs.pipe_file(store.part_path(STEP, 2), b'{"step": 3, "node_rank": 2, "session": "s"')
    bad_name = {"step": STEP, "node_rank": 3, "session": "s", "created": 1.0,
                "files": {"parts/node-1.json": {"size": 1, "sha256": "0" * 64}}}
    store.fs.pipe_file(store.part_path(STEP, 3), json.dumps(bad_name).encode())
    assert store.parts(STEP, "s", nnodes=5) == {1: hash_dir(one)}  # 2, 3 malformed; 4 missing
    assert store.parts(STEP, "another launch", nnodes=5) == {}
    assert store.parts(STEP, "s", nnodes=1) == {}


def test_a_part_of_an_already_committed_step_is_a_no_op(durable, tmp_path):
    store = CheckpointStore(durable, "r")
    zero, one = (write_files(tmp_path / f"n{r}", node_files(r)) for r in (0, 1))
    assert store.commit_part(STEP, one, files=hash_dir(one), node_rank=1, session="launch-a")
    store.commit(STEP, zero, files=hash_dir(zero),
                 remote=store.parts(STEP, "launch-a", nnodes=2)[1])
    part_before = store.fs.cat_file(store.part_path(STEP, 1))
    again = write_files(tmp_path / "again", node_files(1, b"x"))  # a retry saved other bytes
    assert not store.commit_part(STEP, again, files=hash_dir(again), node_rank=1,
                                 session="launch-b")
    assert store.verify(STEP) == []  # none of the committed step's files was replaced
    assert store.fs.cat_file(store.part_path(STEP, 1)) == part_before


@pytest.mark.process
def test_a_retry_of_a_committed_step_is_not_waited_for_on_either_node(tmp_path):
    url = str(tmp_path / "durable")
    store = CheckpointStore(url, "r")
    zero, one = (write_files(tmp_path / f"n{r}", node_files(r)) for r in (0, 1))
    store.commit_part(STEP, one, files=hash_dir(one), node_rank=1, session="launch-a")
    first = store.commit(STEP, zero, files=hash_dir(zero),
                         remote=store.parts(STEP, "launch-a", nnodes=2)[1])
    node0, node1 = (gang_node(url, tmp_path / f"fast{r}", r, parts_timeout_s=5.0)
                    for r in (0, 1))
    try:
        save_on(node1, STEP, tag=b"r")  # writes no part: the step is committed
        node1.drain()
        save_on(node0, STEP, tag=b"r")  # so node 0 must not wait for one
        node0.drain()
    finally:
        node0.close()
        node1.close()
    assert store.manifest(STEP).files == first.files and store.verify(STEP) == []


def test_a_name_two_nodes_wrote_differently_is_refused_naming_it(tmp_path):
    store = CheckpointStore(str(tmp_path / "durable"), "r")
    zero = write_files(tmp_path / "n0", node_files(0))
    clash = {"train_state-rank0.pt": FileEntry(size=1, sha256="0" * 64)}
    with pytest.raises(BadData, match="train_state-rank0.pt comes with two different contents"):
        store.commit(STEP, zero, files=hash_dir(zero), remote=clash)
    assert store.latest_committed() is None


def test_parts_never_land_in_a_manifest(durable, tmp_path):
    store = CheckpointStore(durable, "r")
    zero, one = (write_files(tmp_path / f"n{r}", node_files(r)) for r in (0, 1))
    store.commit_part(STEP, one, files=hash_dir(one), node_rank=1, session="s")
    write_files(tmp_path / "n0" / "parts", {"node-1.json": b"{}"})  # a parts/ dir in a fast dir
    assert not any(name.startswith("parts/") for name in hash_dir(zero))
    with pytest.raises(BadData, match="parts/node-1.json"):
        store.commit(STEP, zero, remote={"parts/node-1.json": FileEntry(size=2, sha256="0" * 64)})
    man = store.commit(STEP, zero, remote=store.parts(STEP, "s", nnodes=2)[1])
    assert store.fs.exists(store.part_path(STEP, 1))
    assert sorted(man.files) == sorted({**node_files(0), **node_files(1)})
    assert store.verify(STEP) == []
    fast = CheckpointStore.local(str(tmp_path / "fast"))
    write_files(fast.path(STEP), {**node_files(0), "parts/node-0.json": b"{}"})
    assert sorted(fast.commit_in_place(STEP).files) == sorted(node_files(0))
    store.delete(STEP)  # the parts go with the step
    assert not store.fs.exists(store.part_path(STEP, 1))


@pytest.mark.process
def test_resume_with_fast_false_fetches_the_durable_copy_even_when_the_fast_copy_verifies(
        tmp_path):
    ckpt = gang_node(str(tmp_path / "durable"), tmp_path / "fast", 0, nnodes=1, session="")
    try:
        save_on(ckpt, STEP)
        ckpt.drain()
        assert ckpt.fast.verify(STEP) == []
        _, _, tier = ckpt.resume(str(tmp_path / "restore-fast"), None)
        assert tier == "fast"
        man, root, tier = ckpt.resume(str(tmp_path / "restore"), None, fast=False)
    finally:
        ckpt.close()
    assert (tier, root, man.step) == ("durable", str(tmp_path / "restore"), STEP)
    restored = tmp_path / "restore" / f"step-{STEP:09d}"
    assert sorted(os.listdir(restored)) == sorted(node_files(0))
    assert ckpt.fast.list_committed() == [STEP]  # the fast copy was neither used nor touched


@pytest.mark.parametrize(("node_rank", "nnodes", "session"),
                         [(0, 2, ""), (1, 1, "s"), (2, 2, "s"), (-1, 2, "s")])
def test_a_checkpointer_outside_its_gang_or_without_a_session_is_refused(
        tmp_path, node_rank, nnodes, session):
    with pytest.raises(ValueError, match="node_rank|session"):
        gang_node(str(tmp_path / "durable"), tmp_path / "fast", node_rank, nnodes=nnodes,
                  session=session)
