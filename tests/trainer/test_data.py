"""Batching is a pure function of (tokens, seed, cursor, rank, world)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.errors import BadData
from trainer.data import (
    IGNORE,
    PackedBatches,
    TrainBatches,
    cursor_after,
    doc_lengths,
    epoch_order,
    locate,
    mask_documents,
    n_windows,
    pack_layout,
    pack_row,
    sample_indices,
    skip_past,
    val_batches,
    windows,
)


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


def test_cursor_after_counts_read_batches_and_steps_over_skip_ranges():
    assert cursor_after(10, 0, []) == 10
    assert cursor_after(10, 4, []) == 14
    assert cursor_after(10, 4, [(12, 20)]) == 22  # reads 10, 11, 20, 21
    assert cursor_after(10, 2, [(10, 12), (12, 15)]) == 17  # chained: reads 15, 16
    assert cursor_after(10, 2, [(0, 5)]) == 12  # a range behind the cursor changes nothing


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


# ---- token-budget packing ---------------------------------------------------------------
def corpus(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Documents of the given lengths; token value = its own index, so sources are visible."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.arange(sum(lengths)), starts


SKEWED = [3, 40, 5, 1, 17, 2, 64, 9, 30, 4, 11, 2]  # 1..64 tokens: a 64x spread


def epoch_rows(p: PackedBatches, epoch: int) -> list[tuple[np.ndarray, ...]]:
    return [pack_row(r, p.seq_len, p.starts, *p.layout(epoch)) for r in range(p.n)]


def test_packing_feeds_every_token_exactly_once_per_epoch():
    tokens, starts = corpus(SKEWED)
    p = PackedBatches(tokens, starts, seq_len=8, batch_size=2, seed=0)
    for epoch in (0, 1):
        src = np.concatenate([r[0] for r in epoch_rows(p, epoch)])
        real = src[src >= 0]
        assert sorted(real.tolist()) == list(range(tokens.size))


def test_packing_pads_only_the_last_row_of_an_epoch():
    tokens, starts = corpus(SKEWED)  # 188 tokens -> 24 rows of 8, 4 padding slots
    p = PackedBatches(tokens, starts, seq_len=8, batch_size=2, seed=0)
    rows = epoch_rows(p, 0)
    assert p.n == 24
    assert all((r[0] >= 0).all() for r in rows[:-1])
    assert (rows[-1][0] < 0).sum() == 24 * 8 - 188


def test_packed_micro_batch_is_exactly_the_token_budget_with_several_documents():
    tokens, starts = corpus(SKEWED)
    p = PackedBatches(tokens, starts, seq_len=16, batch_size=4, seed=1)  # budget 64 tokens
    x, y, pos, doc = p.get(0)
    assert x.shape == y.shape == pos.shape == doc.shape == (4, 16)
    assert len({(r, int(d)) for r in range(4) for d in doc[r]}) > 4  # variable docs per row


def test_positions_restart_per_document_and_targets_stay_inside_it():
    tokens, starts = corpus(SKEWED)
    p = PackedBatches(tokens, starts, seq_len=16, batch_size=12, seed=2)
    x, y, pos, doc = (t.numpy() for t in p.get(0))
    ends = set((starts + np.array(SKEWED) - 1).tolist())  # last token of each document
    for r in range(x.shape[0]):
        for i in range(16):
            new_doc = i == 0 or doc[r, i] != doc[r, i - 1]
            assert (pos[r, i] == 0) == new_doc
            if doc[r, i] >= 0 and x[r, i] not in ends:
                assert y[r, i] == x[r, i] + 1  # the next token of the same document
            else:
                assert y[r, i] == IGNORE


def test_long_documents_continue_across_rows():
    tokens, starts = corpus([50])
    p = PackedBatches(tokens, starts, seq_len=16, batch_size=1, seed=0)
    rows = epoch_rows(p, 0)
    assert [r[0][0] for r in rows[:4]] == [0, 16, 32, 48]
    assert rows[0][1][-1] == 16  # the row's last token still predicts its successor


def test_packed_world_of_two_reads_the_rows_of_world_one_with_double_batch():
    tokens, starts = corpus(SKEWED * 5)
    one = PackedBatches(tokens, starts, seq_len=8, batch_size=4, seed=5)
    two = [PackedBatches(tokens, starts, seq_len=8, batch_size=2, seed=5, rank=r, world=2)
           for r in (0, 1)]
    for c in (0, 3, 50):  # 50 is several epochs in
        assert torch.equal(one.get(c)[0], torch.cat([two[0].get(c)[0], two[1].get(c)[0]]))


def test_packed_order_is_a_pure_function_of_seed_epoch_and_cursor():
    tokens, starts = corpus(SKEWED)
    a = PackedBatches(tokens, starts, seq_len=8, batch_size=2, seed=1)
    b = PackedBatches(tokens, starts, seq_len=8, batch_size=2, seed=1)
    for c in (7, 0, 30, 7):  # out of order, across epochs
        assert all(ta.equal(tb) for ta, tb in zip(a.get(c), b.get(c)))
    other = PackedBatches(tokens, starts, seq_len=8, batch_size=2, seed=2)
    assert not other.get(0)[0].equal(a.get(0)[0])


def test_skip_ranges_drop_their_batches_without_shifting_the_rest():
    tokens, starts = corpus(SKEWED * 3)
    p = PackedBatches(tokens, starts, seq_len=8, batch_size=2, seed=0)
    skips = [(3, 6)]
    cursor, seen = 0, []
    for _ in range(6):
        cursor = skip_past(cursor, skips)
        seen.append(cursor)
        cursor += 1
    assert seen == [0, 1, 2, 6, 7, 8]
    assert p.get(seen[3])[0].equal(PackedBatches(tokens, starts, seq_len=8, batch_size=2,
                                                 seed=0).get(6)[0])


def test_doc_lengths_come_from_starts_and_the_token_count():
    assert doc_lengths(np.array([0, 3, 3, 10]), 12).tolist() == [3, 0, 7, 2]
    assert pack_layout(np.array([3, 5, 2]), np.array([2, 0, 1])).tolist() == [0, 2, 5, 10]


def test_documents_not_starting_at_zero_are_bad_data():
    with pytest.raises(BadData):
        PackedBatches(np.arange(10), np.array([2, 5]), seq_len=4, batch_size=1, seed=0)


def test_unsigned_token_arrays_still_get_ignore_targets():
    tokens, starts = corpus([5, 3])
    p = PackedBatches(tokens.astype(np.uint16), starts, seq_len=4, batch_size=2, seed=0)
    y = p.get(0)[1]
    assert (y == IGNORE).sum() == 2 and y.dtype == torch.int64  # the two document ends


# ---- skipped documents ------------------------------------------------------------------
def test_mask_documents_takes_the_target_of_every_slot_of_a_skipped_document_only():
    targets = np.array([[5, 6, IGNORE, 8], [9, 10, 11, IGNORE]])
    docs = np.array([[3, 3, 3, 4], [4, 7, 7, -1]])
    assert mask_documents(targets, docs, [4]).tolist() == [[5, 6, IGNORE, IGNORE],
                                                           [IGNORE, 10, 11, IGNORE]]
    assert mask_documents(targets, docs, [3, 7]).tolist() == [[IGNORE] * 3 + [8],
                                                              [9] + [IGNORE] * 3]
    assert mask_documents(targets, docs, []) is targets  # nothing skipped: untouched


def test_a_skipped_document_trains_nothing_in_any_batch_while_its_row_mates_still_train():
    tokens, starts = corpus(SKEWED * 3)
    p = PackedBatches(tokens, starts, seq_len=8, batch_size=2, seed=0)
    before = [p.get(c) for c in range(60)]  # several epochs
    p.skip_documents([6, 13])  # 64 tokens (document 6) and 40 (13 = 12 + 1)
    seen = 0
    for c, (x, y, pos, doc) in enumerate(before):
        x2, y2, pos2, doc2 = p.get(c)
        assert x2.equal(x) and pos2.equal(pos) and doc2.equal(doc)  # the same rows
        mine = np.isin(p.documents(c).numpy(), [6, 13])
        assert (y2.numpy()[mine] == IGNORE).all()
        assert y2.numpy()[~mine].tolist() == y.numpy()[~mine].tolist()
        seen += int(mine.any() and (y2.numpy()[~mine] != IGNORE).any())
    assert seen >= 2  # batches shared with the skipped documents kept their other targets
    assert p.tokens_of([6, 13]) == 64 + 40
    p.skip_documents([])
    assert all(a.equal(b) for a, b in zip(p.get(3), before[3]))
