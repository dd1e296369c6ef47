"""Deterministic batching: every batch is a pure function of (tokens, seed, data cursor, rank).

The train split is cut into non-overlapping windows of seq_len + 1 tokens (inputs are the
first seq_len, targets the last seq_len). Epoch e visits the windows in the order
`np.random.default_rng([seed, e]).permutation(n)`, so global sample index g lives at
epoch g // n, position g % n. The data cursor b (one integer, saved in every checkpoint)
names a micro-batch: rank r of world W reads samples (b*W + r)*bs + i, i < bs. Resuming
from a cursor therefore replays exactly the batches an uninterrupted run would have seen.

Packing (`train.packing`, `PackedBatches`): epoch e lays the documents (split at the
dataset's doc_starts, each ending in EOS) back to back in the order
`np.random.default_rng([seed, e]).permutation(n_docs)` and cuts that stream into rows of
seq_len tokens. A row holds as many documents as fit; a document that crosses a row end
continues at the start of the next row. Attention never crosses a document (doc_ids),
positions restart at each document and each row, and the target of a document's last
token is ignored, so each token is an input exactly once per epoch and only the epoch's
last row is padded. The rows then play the role of the windows above: same cursor
arithmetic, same skip ranges.

Skipped documents (`PackedBatches.skip_documents`: a spike's diagnosis accused them,
trainer/guard.py): every slot of theirs carries the target IGNORE in every batch read from
then on (`mask_documents`), so they train nothing wherever they occur while the other
documents packed in the same rows still train; attention never crosses a document, so
their tokens change no other document's loss either.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from common.errors import BadData

IGNORE = -100  # == trainer.model.IGNORE; kept here so data stays torch-model free


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


def cursor_after(cursor: int, batches: int, skip_ranges: Iterable[Sequence[int]]) -> int:
    """Where the cursor is after the step loop reads `batches` batches from `cursor`
    (each read first steps over the skip ranges, as trainer/loop.py does)."""
    ranges = [tuple(r) for r in skip_ranges]
    for _ in range(batches):
        cursor = skip_past(cursor, ranges) + 1
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


def mask_documents(targets: np.ndarray, documents: np.ndarray,
                   skipped: Sequence[int] | np.ndarray) -> np.ndarray:
    """Pure: `targets` with every slot whose document (by number in the split, `documents`,
    same shape) is in `skipped` set to IGNORE; the rest unchanged."""
    if len(skipped) == 0:
        return targets
    return np.where(np.isin(documents, np.asarray(skipped, dtype=np.int64)), IGNORE, targets)


def doc_lengths(doc_starts: np.ndarray, n_tokens: int) -> np.ndarray:
    """Token count of each document; empty documents (repeated starts) have length 0."""
    starts = np.asarray(doc_starts, dtype=np.int64)
    return np.diff(np.append(starts, n_tokens))


def pack_layout(lengths: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Stream offset of each document in `order`, plus the stream length at the end."""
    return np.concatenate([[0], np.cumsum(lengths[order])]).astype(np.int64)


def pack_row(row: int, seq_len: int, starts: np.ndarray, order: np.ndarray,
             offsets: np.ndarray) -> tuple[np.ndarray, ...]:
    """Row `row` of one epoch's packed stream as (src, target_src, position_ids, doc_ids).

    src: index into the token array of each slot (-1 = padding). target_src: index of the
    token it predicts, -1 where there is none (document end, padding). Pure numpy.
    """
    total = int(offsets[-1])
    p = np.arange(row * seq_len, (row + 1) * seq_len, dtype=np.int64)
    real = p < total
    k = np.searchsorted(offsets, np.minimum(p, total - 1), side="right") - 1
    within = p - offsets[k]
    src = np.where(real, starts[order[k]] + within, -1)
    has_next = real & (within + 1 < offsets[k + 1] - offsets[k])
    target_src = np.where(has_next, src + 1, -1)
    first = np.maximum(offsets[k], row * seq_len)  # documents restart at the row start
    position_ids = np.where(real, p - first, p - max(total, row * seq_len))
    doc_ids = np.where(real, k, -1)  # padding attends only to padding
    return src, target_src, position_ids, doc_ids


class PackedBatches:
    """Token-budget micro-batches of packed documents for one rank (see the module doc)."""

    def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray, *, seq_len: int,
                 batch_size: int, seed: int, rank: int = 0, world: int = 1,
                 source: str = "train split") -> None:
        self.tokens = tokens
        self.starts = np.asarray(doc_starts, dtype=np.int64)
        self.lengths = doc_lengths(self.starts, tokens.size)
        total = int(self.lengths.sum())
        if total < 2 or self.starts.size == 0 or self.starts[0] != 0:
            raise BadData(source, f"{tokens.size} tokens in {self.starts.size} documents "
                          "cannot be packed (need >= 2 tokens, first document at offset 0)",
                          "re-run data preparation; doc_starts must begin at 0")
        self.n = -(-total // seq_len)  # rows per epoch; only the last one is padded
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world = rank, world
        self._layout: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.skipped = np.zeros(0, dtype=np.int64)  # documents with no target (skip_documents)

    def layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch not in self._layout:
            order = epoch_order(self.seed, epoch, self.starts.size)
            self._layout = {epoch: (order, pack_layout(self.lengths, order))}  # keep one epoch
        return self._layout[epoch]

    def skip_documents(self, documents: Iterable[int]) -> None:
        """From now on every batch read carries no target on these documents' slots."""
        self.skipped = np.array(sorted({int(d) for d in documents}), dtype=np.int64)

    def rows(self, cursor: int) -> list[tuple[np.ndarray, ...]]:
        """Batch `cursor`'s rows as pack_row's arrays plus each slot's document number in
        the split (-1: padding)."""
        out = []
        for e, r in zip(*locate(sample_indices(cursor, self.rank, self.world, self.batch_size),
                                self.n)):
            order, offsets = self.layout(int(e))
            src, tgt, pos, k = pack_row(int(r), self.seq_len, self.starts, order, offsets)
            out.append((src, tgt, pos, k, np.where(k >= 0, order[np.maximum(k, 0)], -1)))
        return out

    def documents(self, cursor: int) -> torch.Tensor:
        """(batch_size, seq_len): the number in the split of the document each slot of
        batch `cursor` holds (-1: padding) — what a spike's diagnosis accuses."""
        return torch.from_numpy(np.stack([row[4] for row in self.rows(cursor)]).astype(np.int64))

    def tokens_of(self, documents: Iterable[int]) -> int:
        """How many tokens these documents hold together."""
        return int(sum(int(self.lengths[int(d)]) for d in documents))

    def get(self, cursor: int) -> tuple[torch.Tensor, ...]:
        """(inputs, targets, position_ids, doc_ids), each (batch_size, seq_len) int64; no
        target on a skipped document's slots."""
        src, tgt, pos, doc, number = (np.stack(a) for a in zip(*self.rows(cursor)))
        # int64 before mixing in IGNORE: token arrays are unsigned (uint16 would wrap -100).
        x = np.where(src >= 0, self.tokens[np.maximum(src, 0)].astype(np.int64), 0)
        y = np.where(tgt >= 0, self.tokens[np.maximum(tgt, 0)].astype(np.int64), IGNORE)
        y = mask_documents(y, number, self.skipped)
        return tuple(torch.from_numpy(a.astype(np.int64)) for a in (x, y, pos, doc))


def val_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, k: int,
                source: str = "val split") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first k micro-batches of validation windows, in order (fewer if the split is short)."""
    w = windows(tokens, seq_len)
    if w.shape[0] == 0:
        raise BadData(source, f"{tokens.size} tokens do not fill one window of {seq_len + 1}",
                      "raise data.val_fraction or use a shorter model.seq_len")
    count = max(1, min(k, w.shape[0] // batch_size))
    return [to_tensors(w[j * batch_size:(j + 1) * batch_size]) for j in range(count)]
