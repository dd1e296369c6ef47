"""Deterministic batching: every batch is a pure function of (tokens, seed, data cursor, rank).

The train split is cut into non-overlapping windows of seq_len + 1 tokens (inputs are the
first seq_len, targets the last seq_len). Epoch e visits the windows in the order
`np.random.default_rng([seed, e]).permutation(n)`, so global sample index g lives at
epoch g // n, position g % n. The data cursor b (one integer, saved in every checkpoint)
names a micro-batch: rank r of world W reads samples (b*W + r)*bs + i, i < bs. Resuming
from a cursor therefore replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch

from ops.errors import BadData


def n_windows(n_tokens: int, seq_len: int) -> int:
    return n_tokens // (seq_len + 1)


def windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """(n, seq_len + 1) view of the token array; the tail that does not fill a window is dropped."""
    n = n_windows(tokens.size, seq_len)
    return tokens[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def sample_indices(cursor: int, rank: int, world: int, batch_size: int) -> np.ndarray:
    """Global sample indices of rank `rank`'s micro-batch at data cursor `cursor`."""
    start = (cursor * world + rank) * batch_size
    return np.arange(start, start + batch_size, dtype=np.int64)


def locate(g: np.ndarray | int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Global sample index -> (epoch, position in that epoch's order)."""
    g = np.asarray(g, dtype=np.int64)
    return g // n, g % n


def skip_past(cursor: int, skip_ranges: Iterable[Sequence[int]]) -> int:
    """The first cursor >= `cursor` outside every [start, end) skip range (ranges may chain)."""
    ranges = sorted((int(a), int(b)) for a, b in skip_ranges)
    for start, end in ranges:
        if start <= cursor < end:
            cursor = end
    return cursor


def to_tensors(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.from_numpy(rows.astype(np.int64))
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


class TrainBatches:
    """Micro-batches of one rank. Caches one epoch's permutation; otherwise stateless."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world: int = 1, source: str = "train split") -> None:
        self.windows = windows(tokens, seq_len)
        self.n = self.windows.shape[0]
        if self.n == 0:
            raise BadData(source, f"{tokens.size} tokens do not fill one window of "
                          f"{seq_len + 1}", "use a larger corpus or a shorter model.seq_len")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world = rank, world
        self._orders: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(self.seed, epoch, self.n)}  # keep one epoch
        return self._orders[epoch]

    def window_ids(self, cursor: int) -> np.ndarray:
        epochs, positions = locate(sample_indices(cursor, self.rank, self.world,
                                                  self.batch_size), self.n)
        return np.array([self.order(int(e))[p] for e, p in zip(epochs, positions)],
                        dtype=np.int64)

    def get(self, cursor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, seq_len) int64."""
        return to_tensors(self.windows[self.window_ids(cursor)])


def val_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, k: int,
                source: str = "val split") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first k micro-batches of validation windows, in order (fewer if the split is short)."""
    w = windows(tokens, seq_len)
    if w.shape[0] == 0:
        raise BadData(source, f"{tokens.size} tokens do not fill one window of {seq_len + 1}",
                      "raise data.val_fraction or use a shorter model.seq_len")
    count = max(1, min(k, w.shape[0] // batch_size))
    return [to_tensors(w[j * batch_size:(j + 1) * batch_size]) for j in range(count)]
