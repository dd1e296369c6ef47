"""Shared pieces of the checkpoint/event-log tests: stores on file:// and real SeaweedFS S3."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from storage.checkpoints import CheckpointStore
from storage.events import EventLog, read_events
from storage.tiered import TieredCheckpointer, TierPolicy

BACKENDS = ["file", "s3"]


def durable_url(backend: str, tmp_path, request) -> str:
    """A fresh durable root: a local directory, or a prefix on the session SeaweedFS."""
    if backend == "file":
        return str(tmp_path / "durable")
    env = request.getfixturevalue("s3_env")
    assert env["AWS_ENDPOINT_URL"]
    return f"s3://mainspring/tests/{uuid.uuid4().hex[:12]}"


def write_files(directory, files: dict[str, bytes]) -> str:
    for name, data in files.items():
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return str(directory)


def payload(step: int, size: int = 4096) -> dict[str, bytes]:
    """A checkpoint-shaped directory: a model file, an optimizer shard, a train state."""
    seed = step.to_bytes(4, "little")
    return {"mp_rank_00_model_states.pt": seed * (size // 4),
            "zero_pp_rank_0_mp_rank_00_optim_states.pt": seed[::-1] * (size // 2),
            "train_state-rank0.pt": b"state" + seed}


def tiered(durable: str, fast_dir, *, events: EventLog | None = None, **policy) -> TieredCheckpointer:
    policy = {"retry_s": 0.2, "retry_max_s": 1.0, "drain_timeout_s": 120.0, **policy}
    return TieredCheckpointer(CheckpointStore(durable, "r"), CheckpointStore.local(str(fast_dir)),
                              TierPolicy(**policy), events=events)


def save(ckpt: TieredCheckpointer, step: int, size: int = 4096) -> float:
    """What the trainer does: write the fast tier in the loop, then hand over."""
    write_files(ckpt.prepare(step), payload(step, size))
    return ckpt.submit(step, tokens_seen=step * 10, data_cursor=step, parent=ckpt.last_step)


def kinds(url: str) -> list[str]:
    return [e["kind"] for e in read_events(url, "r")]


@pytest.fixture(params=BACKENDS)
def durable(request, tmp_path):
    """A fresh durable root on each backend (file://, real SeaweedFS S3)."""
    return durable_url(request.param, tmp_path, request)


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB filesystem (tmpfs) to fill up; needs mount rights (root here)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=False,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)
