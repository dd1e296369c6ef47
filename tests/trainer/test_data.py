"""Batching is a pure function of (tokens, seed, cursor, rank, world)."""

from __future__ import annotations

import numpy as np
import pytest

from ops.errors import BadData
from trainer.data import (TrainBatches, epoch_order, locate, n_windows, sample_indices,
                          skip_past, val_batches, windows)


def test_windows_are_non_overlapping_runs_of_seq_len_plus_one_tokens():
    w = windows(np.arange(23), 4)
    assert w.shape == (4, 5)
    assert w[0].tolist() == [0, 1, 2, 3, 4]
    assert w[3].tolist() == [15, 16, 17, 18, 19]  # the tail 20..22 does not fill a window
    assert n_windows(23, 4) == 4


def test_sample_indices_interleave_ranks_within_a_cursor():
    assert sample_indices(0, 0, 1, 4).tolist() == [0, 1, 2, 3]
    assert sample_indices(3, 0, 2, 4).tolist() == [24, 25, 26, 27]
    assert sample_indices(3, 1, 2, 4).tolist() == [28, 29, 30, 31]
    assert sample_indices(4, 0, 2, 4).tolist() == [32, 33, 34, 35]


def test_locate_maps_global_index_to_epoch_and_position():
    epochs, positions = locate(np.array([0, 9, 10, 25]), 10)
    assert epochs.tolist() == [0, 0, 1, 2]
    assert positions.tolist() == [0, 9, 0, 5]


def test_epoch_order_is_a_seeded_permutation_that_changes_per_epoch():
    a = epoch_order(7, 0, 50)
    assert sorted(a.tolist()) == list(range(50))
    assert np.array_equal(a, epoch_order(7, 0, 50))
    assert not np.array_equal(a, epoch_order(7, 1, 50))
    assert not np.array_equal(a, epoch_order(8, 0, 50))


def test_same_cursor_gives_the_same_batch_in_a_fresh_loader():
    tokens = np.arange(5_000) % 997
    a = TrainBatches(tokens, seq_len=8, batch_size=3, seed=1)
    b = TrainBatches(tokens, seq_len=8, batch_size=3, seed=1)
    for cursor in (0, 5, 1000):  # 1000 is several epochs in
        xa, ya = a.get(cursor)
        xb, yb = b.get(cursor)
        assert xa.equal(xb) and ya.equal(yb)


def test_targets_are_inputs_shifted_by_one_token():
    x, y = TrainBatches(np.arange(1_000), seq_len=8, batch_size=4, seed=0).get(3)
    assert x.shape == y.shape == (4, 8)
    assert x[:, 1:].equal(y[:, :-1])
    assert (y[:, -1] == x[:, -1] + 1).all()
    assert (x[:, 0] % 9 == 0).all()  # every sample starts on a window boundary


def test_ranks_get_disjoint_samples_and_one_epoch_covers_every_window_once():
    tokens = np.arange(40 * 9)  # exactly 40 windows of seq_len 8
    ranks = [TrainBatches(tokens, seq_len=8, batch_size=5, seed=3, rank=r, world=2)
             for r in range(2)]
    seen = [np.concatenate([ranks[r].window_ids(c) for c in range(4)]) for r in range(2)]
    assert set(seen[0]).isdisjoint(seen[1])
    assert sorted(np.concatenate(seen).tolist()) == list(range(40))


def test_world_of_two_reads_the_same_samples_as_world_of_one_with_double_batch():
    tokens = np.arange(100 * 9)
    one = TrainBatches(tokens, seq_len=8, batch_size=8, seed=5)
    two = [TrainBatches(tokens, seq_len=8, batch_size=4, seed=5, rank=r, world=2) for r in (0, 1)]
    for c in range(3):
        assert one.window_ids(c).tolist() == (two[0].window_ids(c).tolist()
                                              + two[1].window_ids(c).tolist())


def test_second_epoch_uses_a_new_order():
    ids = TrainBatches(np.arange(10 * 9), seq_len=8, batch_size=10, seed=0)
    first, second = ids.window_ids(0), ids.window_ids(1)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(10))
    assert first.tolist() != second.tolist()


def test_skip_past_jumps_over_skip_ranges_including_chained_ones():
    assert skip_past(5, []) == 5
    assert skip_past(5, [(0, 3)]) == 5
    assert skip_past(5, [(5, 9)]) == 9
    assert skip_past(6, [(5, 9), (9, 12)]) == 12
    assert skip_past(6, [(9, 12), (5, 9)]) == 12
    assert skip_past(9, [(5, 9)]) == 9  # end is exclusive


def test_val_batches_are_the_first_windows_in_order():
    batches = val_batches(np.arange(100), seq_len=4, batch_size=3, k=2)
    assert len(batches) == 2
    assert batches[0][0][:, 0].tolist() == [0, 5, 10]
    assert batches[1][0][:, 0].tolist() == [15, 20, 25]


def test_val_batches_shrink_to_what_the_split_holds():
    assert len(val_batches(np.arange(100), seq_len=4, batch_size=3, k=50)) == 6


def test_too_few_tokens_for_one_window_is_bad_data_naming_the_source():
    with pytest.raises(BadData) as err:
        TrainBatches(np.arange(5), seq_len=8, batch_size=1, seed=0, source="mem://d")
    assert err.value.path == "mem://d"
    with pytest.raises(BadData):
        val_batches(np.arange(5), seq_len=8, batch_size=1, k=1)
