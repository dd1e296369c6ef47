"""Tiered async checkpointing: the loop only waits for the fast tier, progress hears of a
checkpoint only once it is durable, and a slow uploader applies bounded backpressure."""

from __future__ import annotations

import time

import pytest

from storage.checkpoints import MANIFEST
from storage.events import EventLog, read_events
from tests.storage.ckpt_helpers import save, tiered


@pytest.fixture
def slow_link(monkeypatch):
    """Each durable file upload takes 0.3 s (a slow network), on the real local filesystem."""
    def install(ckpt) -> None:
        real = ckpt.durable.fs.put_file

        def slow(*args, **kwargs):
            time.sleep(0.3)
            return real(*args, **kwargs)

        monkeypatch.setattr(ckpt.durable.fs, "put_file", slow)
    return install


def test_save_returns_before_the_upload_and_commit_is_reported_only_once_durable(
        tmp_path, slow_link):
    ckpt = tiered(str(tmp_path / "durable"), tmp_path / "fast", max_in_flight=4)
    slow_link(ckpt)
    seen = []
    ckpt.on_commit = lambda man, uri: seen.append(
        (man.step, ckpt.durable.fs.exists(ckpt.durable.path(man.step, MANIFEST))))
    t0 = time.perf_counter()
    save(ckpt, 1)
    pause = time.perf_counter() - t0
    assert pause < 0.3 and seen == []  # three files x 0.3 s are still uploading
    ckpt.drain()
    ckpt.close()
    assert seen == [(1, True)]  # reported after, never before, the durable manifest


def test_a_slow_uploader_makes_the_loop_wait_and_says_so(tmp_path, slow_link):
    url = str(tmp_path / "durable")
    ckpt = tiered(url, tmp_path / "fast", max_in_flight=1, events=EventLog(url, "r", "t"))
    slow_link(ckpt)
    save(ckpt, 1)
    waited = save(ckpt, 2)  # one snapshot in flight at most: wait for step 1's upload
    assert waited > 0.3 and ckpt.in_flight() == [2]
    ckpt.drain()
    ckpt.close()
    ckpt.events.flush()
    back = read_events(url, "r", kinds=("checkpoint_backpressure",))
    assert [(e["step"], e["payload"]["max_in_flight"]) for e in back] == [(2, 1)]
    assert back[0]["payload"]["waited_s"] >= 0.3


def test_parent_chain_follows_the_saves(tmp_path):
    ckpt = tiered(str(tmp_path / "durable"), tmp_path / "fast")
    for step in (0, 4, 8):
        save(ckpt, step)
    ckpt.drain()
    ckpt.close()
    assert [ckpt.durable.manifest(s).parent for s in (0, 4, 8)] == [None, 0, 4]
    assert ckpt.durable.manifest(8).tokens_seen == 80 and ckpt.committed == [0, 4, 8]
