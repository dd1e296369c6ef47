"""Helpers for spec tests: the demo preset with overrides, and the BadConfig a raw spec raises."""

from __future__ import annotations

import pytest

import spec as spec_module
from common.errors import BadConfig
from spec import PRESETS, RunSpec


def demo(**dotted) -> dict:
    return spec_module.deep_merge(PRESETS["demo"], spec_module.dotted_to_nested(dotted))


def refused(raw) -> BadConfig:
    with pytest.raises(BadConfig) as info:
        RunSpec.from_dict(raw)
    return info.value
