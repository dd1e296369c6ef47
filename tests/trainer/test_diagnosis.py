"""A spike's diagnosis from two replays of its window on the restored weights
(trainer/diagnosis.py): the pure verdict, on literal replays."""

from __future__ import annotations

import math

import torch

from trainer.diagnosis import (
    BatchReplay,
    diagnose,
    disagreement,
    explains,
    per_document,
    robust_z,
)
from trainer.model import IGNORE

THRESHOLD = 5.0


def window(doc_losses: dict[int, float], spike: dict[int, float] | None = None,
           tokens: int = 32) -> list[BatchReplay]:
    """One batch per document, cursor = document number; `spike`: their batch losses."""
    spike = spike or {}
    return [BatchReplay(d, spike.get(d, loss), {d: (loss * tokens, tokens)})
            for d, loss in doc_losses.items()]


def shared(doc_losses: dict[int, float], tokens: int = 32) -> list[BatchReplay]:
    """One batch per document d (cursor d), half of it d's tokens, half a healthy
    document 100 + d's (loss 3.0 to 3.1)."""
    healthy = {d: 3.0 + 0.05 * (d % 3) for d in doc_losses}
    return [BatchReplay(d, (loss + healthy[d]) / 2, {d: (loss * tokens, tokens),
                                                     100 + d: (healthy[d] * tokens, tokens)})
            for d, loss in doc_losses.items()]


def test_a_document_far_above_the_windows_others_that_explains_the_spike_is_the_cause():
    losses = {d: 3.0 + 0.05 * (d % 3) for d in range(10)}
    losses[7] = 9.0
    first = shared(losses)  # batch 7: 6.0, above the threshold; 3.0 without document 7
    found = diagnose(first, first, spike_cursors=[7], threshold=THRESHOLD)
    assert found.verdict == "data" and found.documents == (7,)
    (outlier,) = found.evidence["outliers"]
    assert outlier["document"] == 7 and outlier["z"] > 6


def test_a_bad_document_split_over_two_ranks_batches_under_the_step_threshold_is_the_cause():
    """As measured at W=2: the step's mean over ranks passed the detector's threshold (7.8),
    but on the healthy weights each rank's batch holding half the document reads 7.3,
    under it, while the window's other batches read ~5.3. The document (12 nats a token)
    is the outlier, and without it both batches are like their neighbours."""
    first = []
    for cursor in range(16):
        for rank in range(2):  # pooled: each cursor once per rank
            healthy = 5.3 + 0.1 * ((cursor + rank) % 5 - 2)
            doc = 100 + 2 * cursor + rank
            first.append(BatchReplay(cursor, healthy, {doc: (healthy * 64, 64)}))
    for rank in range(2):  # cursor 9 on both ranks: 20 tokens of document 7, 44 healthy
        first[2 * 9 + rank] = BatchReplay(9, (12.0 * 20 + 5.3 * 44) / 64, {
            7: (12.0 * 20, 20), 200 + rank: (5.3 * 44, 44)})
    found = diagnose(first, first, spike_cursors=[9], threshold=7.8)
    assert all(b.loss < 7.8 for b in first if b.cursor == 9)
    assert found.verdict == "data" and found.documents == (7,)
    assert found.evidence["elevated_bar"] < 7.8


def test_spike_batches_like_their_neighbours_on_healthy_weights_are_not_the_datas_fault():
    first = [BatchReplay(c, 5.3 + 0.1 * (c % 5 - 2), {100 + c: (5.3 * 64, 64)})
             for c in range(16)]
    assert diagnose(first, first, spike_cursors=[9], threshold=7.8).verdict == "optimisation"


def test_outlier_documents_that_leave_the_spike_batch_bad_accuse_the_batch_not_them():
    # a corrupted batch: every slot random, its own documents outliers, and the rest of
    # another document in it as bad: masking the outliers would not make it healthy
    first = shared({d: 3.0 + 0.05 * (d % 3) for d in range(10)})
    docs = {7: (9.0 * 32, 32), 107: (8.0 * 32, 32)}
    first[7] = BatchReplay(7, 8.5, docs)
    found = diagnose(first, first, spike_cursors=[7], threshold=THRESHOLD)
    assert found.evidence["outliers"] and found.documents == ()
    assert found.verdict == "data" and found.evidence["batches"] == [7]
    assert found.evidence["documents_explain_spike"] is False


TYPICAL = 3.0  # the window's median document loss


def test_documents_explain_a_spike_only_if_its_bad_batches_keep_healthy_tokens_without_them():
    two = BatchReplay(1, 6.0, {7: (9.0 * 4, 4), 8: (3.0 * 4, 4)})
    assert explains([two], {1}, {7}, THRESHOLD, TYPICAL, THRESHOLD)
    alone = BatchReplay(1, 9.0, {7: (9.0 * 4, 4)})  # masked, it would have no target left
    assert not explains([alone], {1}, {7}, THRESHOLD, TYPICAL, THRESHOLD)
    healthy = BatchReplay(1, 3.0, {7: (3.0 * 4, 4)})  # nothing to explain: not the cause
    assert not explains([healthy], {1}, {7}, THRESHOLD, TYPICAL, THRESHOLD)
    assert not explains([two], {1}, {8}, THRESHOLD, TYPICAL, THRESHOLD)  # the wrong document


SOUP = BatchReplay(179, (8.9 * 1938 + 6.5 * 109) / 2047, {133: (8.9 * 1938, 1938),
                                                         125: (6.5 * 109, 109)})


def test_a_document_that_nearly_fills_its_batch_explains_it_though_the_few_tokens_left_are_hard():
    """As measured at W=2 with 2048-token micro-batches: a 1,938-token token soup (8.9 nats
    a token) in one rank's batch; the 109 tokens beside it, another document's start, read
    6.5 a token, above the bar (5.4) on their own. Read as a typical document (5.05), the
    batch is 5.1, under the detector's threshold (6.7): the soup is the cause."""
    assert explains([SOUP], {179}, {133}, 5.4, 5.05, 6.7)
    assert not explains([SOUP], {179}, {133}, 5.4, 5.05, 5.0)  # still an outlier without it


def test_a_hard_batch_of_the_step_holding_a_sliver_of_the_document_does_not_clear_it():
    """The other rank's batch of the soup's step (as measured): a hard file, 5.9 a token,
    over the bar, with the soup's last 18 tokens. Read as typical, the soup leaves it at
    5.9 and the step at 5.5, both under the detector's threshold (6.7): the soup explains
    the spike. Under a threshold of 5.6 the hard file stays an outlier: it does not."""
    other = BatchReplay(179, (5.9 * 2029 + 8.9 * 18) / 2047, {98: (5.9 * 2029, 2029),
                                                             133: (8.9 * 18, 18)})
    assert explains([SOUP, other], {179}, {133}, 5.4, 5.05, 6.7)
    assert not explains([SOUP, other], {179}, {133}, 5.4, 5.05, 5.6)


def test_two_replays_that_disagree_are_numerics_whatever_the_data():
    losses = {d: 3.0 for d in range(6)}
    losses[2] = 9.0
    first = window(losses)
    second = [BatchReplay(b.cursor, b.loss * (1 + 1e-3), b.docs) for b in first]
    found = diagnose(first, second, spike_cursors=[2], threshold=THRESHOLD)
    assert found.verdict == "numerics" and found.documents == ()
    assert found.evidence["replay_disagreement"] > 1e-4


def test_a_second_replay_of_only_the_spikes_batches_is_compared_cursor_by_cursor():
    losses = {d: 3.0 for d in range(6)}
    losses[2] = 9.0
    first = window(losses) + window({2: 9.0})  # pooled: cursor 2 on two ranks
    same = [b for b in first if b.cursor == 2]
    assert disagreement(first, same) == 0.0
    assert diagnose(first, same, spike_cursors=[2], threshold=THRESHOLD).verdict != "numerics"
    other = [same[0], BatchReplay(2, 9.0 * (1 + 1e-3), same[1].docs)]  # the second rank's
    assert diagnose(first, other, spike_cursors=[2], threshold=THRESHOLD).verdict == "numerics"
    assert disagreement([BatchReplay(1, math.nan)], [BatchReplay(1, math.nan)]) == 0.0
    assert disagreement([BatchReplay(1, 3.0)], [BatchReplay(1, math.nan)]) == math.inf


def test_spike_batches_that_are_normal_on_healthy_weights_blame_the_update():
    first = window({d: 3.0 + 0.1 * (d % 2) for d in range(8)})  # the burst made the spike
    found = diagnose(first, first, spike_cursors=[3, 4], threshold=THRESHOLD)
    assert found.verdict == "optimisation"


def test_without_a_guilty_document_the_bad_batches_are_the_cause():
    # one long document per batch: no document stands out, two batches do
    losses = {d: 3.0 for d in range(8)}
    first = window(losses, spike={2: 7.0, 3: 7.5})
    found = diagnose(first, first, spike_cursors=[2], threshold=THRESHOLD)
    assert found.verdict == "data" and found.evidence["batches"] == [2, 3]


def test_a_window_that_is_bad_throughout_is_unclear():
    first = window({d: 3.0 for d in range(4)}, spike={d: 8.0 for d in range(4)})
    found = diagnose(first, first, spike_cursors=[0, 1], threshold=THRESHOLD)
    assert found.verdict == "unclear"


def test_per_document_sums_only_the_scored_tokens_of_each_document():
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    targets = torch.tensor([[5, IGNORE, 6, 7]])
    docs = torch.tensor([[10, 10, 11, 11]])
    assert per_document(loss, targets, docs) == {10: (1.0, 1), 11: (7.0, 2)}


def test_robust_z_ignores_the_outlier_in_its_own_spread():
    z = robust_z([1.0, 1.1, 0.9, 1.0, 10.0])
    assert z[-1] > 50 and max(abs(v) for v in z[:-1]) < 2
    assert robust_z([2.0, 2.0, 2.0]) == [0.0, 0.0, 0.0]
