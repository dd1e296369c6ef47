"""Session fixtures for the real services: Temporal dev server and SeaweedFS S3."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def temporal_server(tmp_path_factory):
    from ops.services import TemporalDevServer, free_port

    server = TemporalDevServer(str(tmp_path_factory.mktemp("temporal")), port=free_port(),
                               headless=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    from ops.services import SeaweedS3

    s3 = SeaweedS3(str(tmp_path_factory.mktemp("seaweedfs"))).start()
    yield s3
    s3.stop()


@pytest.fixture
def s3_env(seaweed, monkeypatch):
    """Point this process (and the workers it starts) at the SeaweedFS S3 gateway."""
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    return seaweed.env()
