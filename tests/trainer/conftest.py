"""Shared fixtures: a tiny committed dataset (each segment on it takes seconds)."""

from __future__ import annotations

import pytest

from tests.trainer.helpers import make_dataset


@pytest.fixture(scope="session")
def dataset_uri(tmp_path_factory) -> str:
    return make_dataset(tmp_path_factory.mktemp("data"))

