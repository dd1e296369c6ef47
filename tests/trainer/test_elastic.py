"""Fewer nodes than the spec asks for (trainer/elastic.py, trainer/checkpointing.py)."""

from __future__ import annotations

import pytest

from common.errors import BadConfig
from spec import RunSpec
from trainer.elastic import on_nodes, resharded
from trainer.state import TrainState


def spec(**train) -> RunSpec:
    return RunSpec.from_dict({"run_id": "r", "train": train})


def test_on_fewer_nodes_the_global_batch_is_kept_by_more_accumulation():
    s = spec(nodes=4, min_nodes=1, procs_per_node=2, grad_accum=3)
    two = on_nodes(s, 2)
    assert (two.train.nodes, two.train.world_size, two.train.grad_accum) == (2, 4, 6)
    global_batch = lambda t: t.world_size * t.grad_accum  # noqa: E731
    assert global_batch(two.train) == global_batch(s.train) == global_batch(on_nodes(s, 1).train)
    assert on_nodes(s, 4) is s


def test_a_node_count_the_spec_does_not_allow_is_refused_naming_the_allowed_ones():
    with pytest.raises(BadConfig, match=r"use one of \[4, 2\]"):
        on_nodes(spec(nodes=4, min_nodes=2), 1)
    with pytest.raises(BadConfig, match="3 nodes"):
        on_nodes(spec(nodes=4, min_nodes=1), 3)


def test_the_data_cursor_and_skip_ranges_name_the_same_global_samples_at_the_new_world_size():
    state = TrainState(step=10, data_cursor=10, skip_ranges=[(4, 6)])
    out = resharded(state, saved_world=2, world=1)
    # rank r of world W reads samples (cursor * W + r) * bs: cursor 10 at W=2 is sample 20*bs
    assert out.data_cursor == 20 and out.skip_ranges == [(8, 12)]
    same = TrainState(step=10, data_cursor=10)
    assert resharded(same, 2, 2).data_cursor == 10


def test_a_cursor_that_is_not_whole_at_the_new_world_size_is_an_error_not_a_silent_skew():
    with pytest.raises(RuntimeError, match="not a whole cursor"):
        resharded(TrainState(step=3, data_cursor=3), saved_world=1, world=2)
