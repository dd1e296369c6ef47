"""A listing of the committed steps that races retention's delete of an old step (on S3 the
glob lists the prefix, then looks inside a step directory that is gone by then:
FileNotFoundError, seen in benchmarks/recovery.py as a rank crashing on its first step) is
taken again; a listing that keeps failing that way still fails, after LIST_TRIES."""

from __future__ import annotations

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
    """The store's glob, as it races a retention delete `times` times: the delete lands
    (for real) while the listing runs, and the listing fails as s3fs's does. (fsspec shares
    one filesystem object per URL: monkeypatch puts the real glob back after the test.)"""
    real, calls = store.fs.glob, []

    def glob(path, **kw):
        calls.append(path)
        if len(calls) <= times:
            store.delete(victim)
            raise FileNotFoundError(f"{path}: step-{victim} vanished during the listing")
        return real(path, **kw)
    monkeypatch.setattr(store.fs, "glob", glob)
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
