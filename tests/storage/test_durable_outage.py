"""Durable tier unreachable: training keeps saving to the fast tier, uploads retry with
backoff and catch up when it returns, and the outage and recovery are events.

S3: a private SeaweedFS instance (not the session one) is stopped and restarted.
file://: the durable directory is a real filesystem remounted read-only, then read-write
(a durable disk or NFS export going read-only is the local analogue of an outage).
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from ops.services import SeaweedS3
from storage.checkpoints import CheckpointStore
from storage.events import EventLog, read_events
from tests.storage.ckpt_helpers import kinds, save, tiered

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)


class SeaweedOutage:
    def __init__(self, tmp_path, monkeypatch) -> None:
        self.s3 = SeaweedS3(str(tmp_path / "weed")).start()
        for key, value in self.s3.env().items():
            monkeypatch.setenv(key, value)
        self.url = f"s3://{self.s3.bucket}/outage"

    def down(self) -> None:
        self.s3.stop()

    def up(self) -> None:
        self.s3.start()

    def close(self) -> None:
        self.s3.stop()


class ReadOnlyDisk:
    def __init__(self, tmp_path, monkeypatch) -> None:
        self.mnt = tmp_path / "durable"
        self.mnt.mkdir()
        self._sh("mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(self.mnt))
        self.url = str(self.mnt)

    def _sh(self, *cmd: str) -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            pytest.skip(f"{' '.join(cmd)}: {proc.stderr.strip()}")

    def down(self) -> None:
        self._sh("mount", "-o", "remount,ro", str(self.mnt))

    def up(self) -> None:
        self._sh("mount", "-o", "remount,rw", str(self.mnt))

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.mnt)], check=False)


@pytest.fixture(params=["file", "s3"])
def outage(request, tmp_path, monkeypatch):
    kind = ReadOnlyDisk if request.param == "file" else SeaweedOutage
    target = kind(tmp_path, monkeypatch)
    yield target
    target.close()


def test_outage_keeps_training_on_the_fast_tier_and_uploads_catch_up_after(outage, tmp_path):
    events = EventLog(outage.url, "r", "test")
    ckpt = tiered(outage.url, tmp_path / "fast", events=events, max_in_flight=2)
    save(ckpt, 1)
    ckpt.drain()
    outage.down()
    t0 = time.monotonic()
    for step in (2, 3, 4, 5):  # the loop keeps checkpointing while the durable tier is gone
        save(ckpt, step)
    saving_s = time.monotonic() - t0
    deadline = time.monotonic() + 30
    while 5 not in ckpt.fast.list_committed():  # the newest save is resumable locally
        assert time.monotonic() < deadline, ckpt.fast.list_committed()
        time.sleep(0.2)
    assert ckpt.fast.verify(5) == [] and 5 in ckpt.in_flight()  # ...and not yet durable
    outage.up()
    ckpt.drain(timeout_s=120)
    ckpt.close()
    durable = CheckpointStore(outage.url, "r").list_committed()
    assert durable[0] == 1 and durable[-1] == 5, durable  # caught up to the newest save
    assert all(CheckpointStore(outage.url, "r").verify(s) == [] for s in durable)
    seen = kinds(outage.url)
    assert "durable_unavailable" in seen and "durable_recovered" in seen
    assert seen.index("durable_unavailable") < seen.index("durable_recovered")
    superseded = [e["step"] for e in read_events(outage.url, "r", kinds=("checkpoint_superseded",))]
    assert set(superseded) == {3, 4} - set(durable)
    recovered = read_events(outage.url, "r", kinds=("durable_recovered",))[0]["payload"]
    assert recovered["failed_uploads"] >= 1 and recovered["outage_s"] > 0
    # Training did not wait for the outage: four saves took far less than it lasted.
    assert saving_s < 15.0, saving_s
    assert os.path.isdir(ckpt.fast.root)
