"""Do the ranks' copies of the weights agree (trainer/replicas.py): the fingerprint is exact
and order-free, and the odd copy out is named by majority, else by its non-finite values."""

from __future__ import annotations

import pytest
import torch

from trainer.replicas import Replica, comparable, evidence, fingerprint, odd_ones_out


def weights(seed: int = 0, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 7, generator=g).to(dtype), torch.randn(3, generator=g).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equal_copies_have_equal_fingerprints_in_any_order(dtype):
    a, b = weights(dtype=dtype), [w.clone() for w in weights(dtype=dtype)]
    assert fingerprint(a) == fingerprint(b) == fingerprint(list(reversed(b)))
    assert fingerprint(a)[1] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_flipped_low_bit_changes_the_fingerprint(dtype):
    """The smallest change a float can take (its last mantissa bit), which a float sum
    of the weights would round away."""
    a = weights(dtype=dtype)
    b = [w.clone() for w in a]
    bits = b[0].view(torch.int32 if dtype == torch.float32 else torch.int16)
    bits[2, 3] ^= 1
    assert b[0][2, 3] != a[0][2, 3]
    assert fingerprint(a)[0] != fingerprint(b)[0]


def test_non_finite_elements_are_counted():
    a = weights()
    a[1][0], a[0][1, 1] = float("nan"), float("inf")
    assert fingerprint(a)[1] == 2
    assert fingerprint([]) == (0, 0)


def copies(*prints: tuple[int, int]) -> list[Replica]:
    return [Replica(rank, rank // 2, fp, bad) for rank, (fp, bad) in enumerate(prints)]


def test_copies_that_agree_name_nobody():
    assert odd_ones_out(copies((7, 0), (7, 0), (7, 0))) == []
    assert odd_ones_out([]) == []


def test_the_majority_names_the_odd_copy_out():
    assert odd_ones_out(copies((7, 0), (9, 0), (7, 0), (7, 0))) == [1]
    assert odd_ones_out(copies((7, 0), (9, 0), (7, 0), (8, 0))) == [1, 3]  # 2 beat 1 and 1
    assert odd_ones_out(copies((7, 0), (9, 0), (7, 0), (9, 0))) == [0, 1, 2, 3]  # a tie


def test_two_copies_name_the_one_with_non_finite_values_else_both():
    assert odd_ones_out(copies((7, 0), (9, 3))) == [1]
    assert odd_ones_out(copies((7, 0), (9, 0))) == [0, 1]  # no way to tell which changed
    assert odd_ones_out(copies((7, 2), (9, 3))) == [0, 1]


def test_the_evidence_names_ranks_and_their_nodes():
    found = evidence(copies((7, 0), (7, 0), (9, 1), (7, 0)))
    assert found["ranks"] == [2] and found["node_ranks"] == [1]
    assert found["fingerprints"] == ["7", "7", "9", "7"] and found["nonfinite"] == [0, 0, 1, 0]


def test_copies_compare_only_where_every_rank_holds_the_whole_model():
    assert comparable(2, 0) and comparable(4, 2)
    assert not comparable(1, 0)  # one copy
    assert not comparable(4, 3)  # ZeRO-3: each rank holds a shard
