"""The listing of a store's committed steps: one flat listing of the `step-` keys on S3,
however many checkpoints the run has (a walk, one LIST per step directory, made a restore
389 checkpoints into a run take 7.6 s); only `step-<n>/MANIFEST.json` counts. A listing
that races retention's delete of an old step (a walk looks inside a step directory that is
gone by then: FileNotFoundError, seen in benchmarks/recovery.py as a rank crashing on its
first step) is taken again; one that keeps failing that way still fails, after LIST_TRIES."""

from __future__ import annotations

import uuid

import pytest

from storage import checkpoints
from storage.checkpoints import CheckpointStore
from tests.storage.ckpt_helpers import durable, payload, write_files  # noqa: F401

__all__ = ["durable"]


def committed_store(url: str, tmp_path, steps) -> CheckpointStore:
    store = CheckpointStore(url, "r")
    for step in steps:
        store.commit(step, write_files(tmp_path / f"local-{step}", payload(step)))
    return store


def racing_delete(monkeypatch, store: CheckpointStore, victim: int, times: int):
    """The store's listing, as it races a retention delete `times` times: the delete lands
    (for real) while the listing runs, and the listing fails as a walk's does. (The store's
    filesystem object is shared: monkeypatch puts the real find back after the test.)"""
    real, calls = store.fs.find, []

    def find(path, **kw):
        calls.append(path)
        if len(calls) <= times:
            store.delete(victim)
            raise FileNotFoundError(f"{path}: step-{victim} vanished during the listing")
        return real(path, **kw)
    monkeypatch.setattr(store.fs, "find", find)
    return calls


def test_a_listing_that_races_a_delete_is_taken_again_and_omits_the_deleted_step(
        durable, tmp_path, monkeypatch):  # noqa: F811
    store = committed_store(durable, tmp_path, [10, 20, 30])
    calls = racing_delete(monkeypatch, store, 10, times=2)
    assert store.list_committed() == [20, 30]
    assert len(calls) == 3


def test_a_listing_that_fails_every_time_still_fails_after_its_tries(
        durable, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(checkpoints, "LIST_TRIES", 3)
    store = committed_store(durable, tmp_path, [10, 20])
    calls = racing_delete(monkeypatch, store, 10, times=10)
    with pytest.raises(FileNotFoundError):
        store.list_committed()
    assert len(calls) == 3


def test_listing_the_committed_steps_on_s3_is_one_request_however_many_checkpoints_there_are(
        s3_env, tmp_path, monkeypatch):
    store = committed_store(f"s3://mainspring/tests/{uuid.uuid4().hex[:12]}", tmp_path,
                            range(10, 410, 10))  # 40 checkpoints
    store.fs.pipe_file(store.path(500, "model.pt"), b"uncommitted: no manifest")
    store.fs.pipe_file(store.part_path(600, 1), b"{}")  # a part record, no commit
    real, listings = store.fs._lsdir, []

    async def lsdir(path, *args, **kw):
        listings.append(path)
        return await real(path, *args, **kw)
    monkeypatch.setattr(store.fs, "_lsdir", lsdir)
    assert store.list_committed() == list(range(10, 410, 10))
    assert len(listings) == 1, listings[:5]  # a walk: 1 + one per step directory
