"""Why a loss spiked: after a rollback has restored the weights from before the spike, the
spike's data window is replayed on them with no update, and the spike's own batches a
second time, and the evidence decides:

- `numerics`: the two replays of the spike's batches disagree (on CPU and with
  deterministic kernels they are bitwise equal): silent data corruption is suspected on
  this rank (the ranks' copies of the weights disagreeing is the other evidence of it,
  trainer/replicas.py, checked before any replay);
- `data`: documents whose loss on the healthy weights is an outlier against the window's
  other documents (a robust z-score over per-document mean losses) and that explain the
  spike (`explains`: the spike's batches that stand above the window's other batches on
  the healthy weights, `elevated_bar`, fall back under that bar without those documents'
  tokens): those documents are the cause; otherwise
  the spike's batches that are still above the detector's threshold on the healthy
  weights while the window's other batches are not (documents empty, `batches`);
- `optimisation`: the spike's own batches are unremarkable on the healthy weights, so the
  data is not guilty — the update was (a learning rate too large for the moment);
- `unclear`: none of these holds.

The pure verdict is `diagnose`; `Replayer` does the forward passes (no gradients, eval
mode, the batch source's own batches and documents) and pools every rank's replays, so
every rank reaches the same verdict on the same evidence. The rollback records the verdict
as a `spike_diagnosed` event with its evidence and cost, then acts on it (trainer/guard.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from statistics import median, pstdev
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.model import IGNORE

# Two replays of a batch differ by more than this (relative): not the same arithmetic.
REPLAY_RTOL = 1e-5
DOC_Z = 6.0  # a document this many robust spreads above the window's median is an outlier
# A spike batch this many spreads above the window's other batches on the healthy weights is
# still elevated there: guilty documents must bring it back under that bar
ELEVATED_Z = 2.0
MIN_DOC_TOKENS = 8  # shorter documents' mean loss is too noisy to accuse
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class BatchReplay:
    """One micro-batch replayed: its mean loss and, per document, (loss sum, tokens)."""

    cursor: int
    loss: float
    docs: dict[int, tuple[float, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Diagnosis:
    verdict: str  # numerics | data | optimisation | unclear
    documents: tuple[int, ...]  # the guilty documents (data), by number in the split
    evidence: dict[str, Any]


def per_document(token_loss: torch.Tensor, targets: torch.Tensor, docs: torch.Tensor
                 ) -> dict[int, tuple[float, int]]:
    """Pure: document number -> (sum of its tokens' losses, scored tokens), over the
    tokens with a target (padding and document ends carry none)."""
    scored = targets != IGNORE
    out: dict[int, tuple[float, int]] = {}
    ids = docs[scored]
    losses = token_loss[scored].double()
    for d in torch.unique(ids).tolist():
        mine = ids == d
        out[int(d)] = (float(losses[mine].sum()), int(mine.sum()))
    return out


def robust_z(values: Sequence[float]) -> list[float]:
    """Pure: (v - median) / (1.4826 MAD), the spread floored at 1e-3 of the median's size
    so a window of equal losses makes no infinite z."""
    mid = median(values)
    spread = max(MAD_TO_SIGMA * median(abs(v - mid) for v in values), 1e-3 * max(abs(mid), 1.0))
    return [(v - mid) / spread for v in values]


def disagreement(first: Sequence[BatchReplay], second: Sequence[BatchReplay]) -> float:
    """Pure: the largest relative difference between two replays of the same batches. The
    second may replay only some of the first's cursors (the spike's own); replays of one
    cursor pair up in order (pooled: one per rank, in rank order)."""
    losses: dict[int, list[float]] = {}
    for b in first:
        losses.setdefault(b.cursor, []).append(b.loss)
    seen: dict[int, int] = {}
    worst = 0.0
    for b in second:
        i = seen[b.cursor] = seen.get(b.cursor, -1) + 1
        a = losses.get(b.cursor, [])[i:i + 1]
        if not a:  # not in the first replay: nothing to compare it with
            continue
        worst = max(worst, relative_difference(a[0], b.loss))
    return worst


def relative_difference(a: float, b: float) -> float:
    """Pure: |a - b| / |a|; two NaNs are the same result, one NaN differs infinitely."""
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    return abs(a - b) / max(abs(a), 1e-12)


def diagnose(first: Sequence[BatchReplay], second: Sequence[BatchReplay],
             spike_cursors: Iterable[int], threshold: float) -> Diagnosis:
    """Pure: the verdict from two replays of a window (`spike_cursors`: the batches of the
    spike's own steps; `threshold`: the loss above which the detector called a step an
    outlier)."""
    spiky = set(spike_cursors)
    differ = disagreement(first, second)
    evidence: dict[str, Any] = {"replayed_batches": len(first), "replay_disagreement": differ,
                                "threshold": threshold}
    if differ > REPLAY_RTOL:
        return Diagnosis("numerics", (), evidence)
    sums: dict[int, list[float]] = {}
    for b in first:
        for d, (loss, n) in b.docs.items():
            acc = sums.setdefault(d, [0.0, 0])
            acc[0] += loss
            acc[1] += n
    docs = sorted(d for d, (_, n) in sums.items() if n >= MIN_DOC_TOKENS)
    means = [sums[d][0] / sums[d][1] for d in docs]
    guilty: list[tuple[int, float, float]] = []
    if len(docs) >= 3:
        guilty = [(d, m, z) for d, m, z in zip(docs, means, robust_z(means)) if z > DOC_Z]
    in_spike = [b.loss for b in first if b.cursor in spiky]
    evidence.update(documents_replayed=len(docs),
                    window_doc_loss_median=median(means) if means else None,
                    spike_batch_losses=in_spike,
                    outliers=[{"document": d, "loss": m, "z": z} for d, m, z in guilty])
    # the bar the window's other batches set on the healthy weights (the detector's
    # threshold is a step's mean over ranks on other weights: a rank's batch that holds a bad
    # document can sit under it and still be far above its neighbours)
    bar = elevated_bar([b.loss for b in first if b.cursor not in spiky], threshold)
    evidence["elevated_bar"] = bar
    if guilty and explains(first, spiky, {d for d, _, _ in guilty}, bar, median(means),
                           threshold):
        return Diagnosis("data", tuple(d for d, _, _ in guilty), evidence)
    if guilty:  # outliers, but the spike's batches stay bad without them
        evidence["documents_explain_spike"] = False
    # no document stands out (a batch may hold one long document, or bad bytes spread over
    # many), or those that do leave the spike's batches bad: batches still above the threshold on healthy weights — the spike's among them
    # — while the weights do well on the rest of the window (a quarter of it, two batches
    # at least: evidence that they are healthy)
    bad = [b.cursor for b in first if not b.loss <= threshold]
    clean = len(first) - len(bad)
    if spiky & set(bad) and clean >= max(2, len(first) / 4):
        evidence["batches"] = sorted(set(bad))  # pooled: a cursor once per rank
        return Diagnosis("data", (), evidence)
    if in_spike and all(math.isfinite(v) and v <= threshold for v in in_spike):
        return Diagnosis("optimisation", (), evidence)
    return Diagnosis("unclear", (), evidence)


def elevated_bar(others: Sequence[float], threshold: float) -> float:
    """Pure: ELEVATED_Z spreads above the median of the window's other batches (the spread:
    the larger of 1.4826 MAD and the standard deviation, floored at 1e-3 of the median),
    never above the detector's `threshold`; the threshold itself with fewer than four."""
    vals = [v for v in others if math.isfinite(v)]
    if len(vals) < 4:
        return threshold
    mid = median(vals)
    spread = max(MAD_TO_SIGMA * median(abs(v - mid) for v in vals), pstdev(vals),
                 1e-3 * max(abs(mid), 1.0))
    return min(threshold, mid + ELEVATED_Z * spread)


def explains(replays: Sequence[BatchReplay], spike_cursors: set[int], documents: set[int],
             bar: float, typical: float, threshold: float) -> bool:
    """Pure: the accused `documents` account for the spike: a spike batch above `bar`
    (`elevated_bar`) holds some of their tokens, and were those tokens as hard as the
    window's typical document (`typical`, its median per-token loss), every spike batch
    holding them would be at or below the detector's `threshold` keeping some scored token
    beside them, and so would the spike's batches together (the step the detector judged).
    A batch of random bytes holds more than the accused documents: reading those as typical
    would not bring it under, and masking them would not get past it. Counting the accused
    tokens at `typical`, not dropping them, judges a batch a long document nearly fills by
    all its tokens (the few left beside it, often documents' first and hardest tokens, are
    too few to judge alone), and a batch of the step that is hard on its own, holding a
    sliver of the document or none, does not clear it."""
    def counterfactual(b: BatchReplay) -> tuple[float, int, int]:
        rest = [(loss, n) for d, (loss, n) in b.docs.items() if d not in documents]
        tokens = sum(n for _, n in rest)
        accused = sum(n for d, (_, n) in b.docs.items() if d in documents)
        total = sum(loss for loss, _ in rest) + accused * typical
        return total / max(tokens + accused, 1), tokens, accused

    spike = [b for b in replays if b.cursor in spike_cursors]
    holding = [b for b in spike if counterfactual(b)[2]]
    if not any(not b.loss <= bar for b in holding):
        return False
    for b in holding:
        loss, tokens, _ = counterfactual(b)
        if not tokens or not loss <= threshold:
            return False
    return sum(counterfactual(b)[0] for b in spike) / len(spike) <= threshold


def pooled(replays: list[BatchReplay], group: Any = None) -> list[BatchReplay]:
    """Every rank's replays of the same cursors, in rank order (the same list on every
    rank: each rank reads its own samples at a cursor). `group`: the ranks to pool over
    (default: all), one per data replica (a pipeline's stages hold one replica's replays)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return replays
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, replays, group=group)
    return [b for rank in gathered for b in rank]


def scored(cursor: int, logits: torch.Tensor, targets: torch.Tensor,
           docs: torch.Tensor | None) -> BatchReplay:
    """Micro-batch `cursor` replayed, from its logits: the mean cross-entropy over its scored
    targets and, with its documents' numbers, `per_document` (one rule for every layout's
    replay, so a pipeline's last stage scores exactly as the whole model does)."""
    token_loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                 ignore_index=IGNORE, reduction="none").view_as(targets)
    scored_targets = int((targets != IGNORE).sum())
    loss = float(token_loss.sum()) / max(scored_targets, 1)
    return BatchReplay(cursor, loss, per_document(token_loss.cpu(), targets.cpu(), docs)
                       if docs is not None else {})


@contextlib.contextmanager
def evaluating(module: torch.nn.Module) -> Iterator[None]:
    """`module` in eval mode without gradients for a replay, its mode restored after."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(was_training)


class Sources:
    """Where accused documents came from: the train split's document index, read once,
    on the first accusation (storage/provenance.py); nothing for a dataset without one."""

    def __init__(self, dataset_uri: str, cache_dir: str | None = None) -> None:
        self.dataset_uri, self.cache_dir = dataset_uri, cache_dir
        self._provenance: Any = False  # False: not read yet

    def __call__(self, documents: Sequence[int]) -> list[dict[str, Any]]:
        if self._provenance is False:
            from storage.provenance import load_provenance

            self._provenance = load_provenance(self.dataset_uri, "train", self.cache_dir)
        if self._provenance is None or not documents:
            return []
        out = []
        for d in documents:
            e = self._provenance.index.entry(int(d))
            out.append({"document": e.document, "source": e.source, "record": e.record,
                        "sha256": e.sha256, "chars": e.chars})
        return out


class Replayer:
    """Forward passes of given micro-batches on the engine's current weights, no update.
    A layout whose ranks do not each hold the whole model overrides `replay` (and `pool`,
    where its ranks hold copies of one replica's replays): trainer/pipeline_replay.py."""

    def __init__(self, engine, batches, sources: Sources | None = None) -> None:
        self.engine, self.batches, self.sources = engine, batches, sources

    def replay(self, cursors: Sequence[int], step: int) -> list[BatchReplay]:
        """This rank's micro-batches at `cursors`, each through the whole model."""
        module = self.engine.module
        out = []
        with evaluating(module):
            for cursor in cursors:
                x, y, *rest = (t.to(self.engine.device) for t in self.batches.replay(cursor, step))
                pos, doc = (rest + [None, None])[:2]
                logits, _ = module(x, position_ids=pos, doc_ids=doc)
                out.append(scored(cursor, logits, y, self.batches.documents(cursor)))
        return out

    def pool(self, replays: list[BatchReplay]) -> list[BatchReplay]:
        """Every data replica's replays, the same list on every rank (collective)."""
        return pooled(replays)

    def diagnose(self, cursors: Sequence[int], spike_cursors: Iterable[int], step: int,
                 threshold: float) -> tuple[Diagnosis, float]:
        """A replay of `cursors`, a second of the spike's, and their verdict; with the
        seconds it took."""
        began = time.perf_counter()
        spike = sorted(set(spike_cursors))
        # collectives: every rank's replays pooled, so the verdict is the same on every rank.
        # The second replay is of the spike's own batches: the computation whose
        # determinism is in question; the window is the first's reference.
        first = self.pool(self.replay(cursors, step))
        second = self.pool(self.replay(spike, step))
        found = diagnose(first, second, spike, threshold)
        if found.documents and self.sources is not None:  # the guilty documents' records
            found.evidence["sources"] = self.sources(found.documents)
        return found, time.perf_counter() - began
