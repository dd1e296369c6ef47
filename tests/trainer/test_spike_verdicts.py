"""What a rollback skips follows its spike's diagnosis: the step loop in-process
(tests/trainer/test_step_loop.py's harness: the real guard, diagnosis, detector, checkpoint
cadence and event log, a fake engine) over real packed batches, the real fault injector's
batch source and a replayer on a model whose loss is a function of the targets.

The corpus is documents of DOC tokens below HALF; the planted bad document's tokens are
HALF and above, which the model finds ~10 nats less likely. Documents are all DOC long, so
the stream's layout does not depend on which document sits where: the document at stream
offset BAD_AT straddles the micro-batches of steps 9 and 10 (cursors 8 and 9), two outliers
in a row, a sustained spike (patience 2).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.trainer.test_step_loop import FakeEngine, events, fresh, segment, step_lines
from trainer.data import IGNORE, PackedBatches
from trainer.diagnosis import Replayer
from trainer.faults import FaultInjector
from trainer.guard import resume_skipped_documents
from trainer.optim import SkippableAdamW

VOCAB, HALF, DOC, DOCS = 64, 32, 30, 100
BAD_AT = 38 * DOC  # tokens 1140..1169: cursor 8 holds 12 of them, cursor 9 the other 18
ONSET, AT = 9, 10  # the spike's first outlier step and the rollback's step
WINDOW = [7, 11]  # skip_before 1, skip_window 4 (steps), from the onset's cursor 8
SPIKES = {"spikes.skip_before": 1, "spikes.skip_window": 4}


class Unigram(torch.nn.Module):
    """Logits that favour the tokens below HALF: each such target costs log(HALF) nats, a
    target of HALF or above ~10 more. `w` moves no loss (a common shift of the logits): it
    is there for the optimizer to update or not."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.register_buffer("bias", torch.where(torch.arange(VOCAB) < HALF, 0.0, -10.0))

    def forward(self, x, y=None, **_):
        logits = (self.bias + self.w).expand(*x.shape, VOCAB)
        if y is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)


class TokenEngine(FakeEngine):
    """The fake engine around Unigram. `transient`: steps whose first run reads a loss 10
    nats too high, as after a bad update (the data is fine, the replay finds it so);
    `recurring`: cursors where that happens every time the loop trains on them (the
    replay, the module's forward alone, still finds them fine)."""

    def __init__(self, transient: tuple[int, ...] = (), recurring: tuple[int, ...] = ()):
        super().__init__()
        self.module = Unigram()
        self.optimizer = self.basic_optimizer = SkippableAdamW(self.module.parameters(),
                                                               lr=0.01, weight_decay=0.0)
        self.optimizer.cur_scale = 1.0
        self.transient, self.recurring, self.fired = set(transient), set(recurring), set()
        self.at = (0, 0)  # (step, cursor) being run (Reads tells it)

    def __call__(self, x, y, **kw):
        logits, loss = self.module(x, y, **kw)
        step, cursor = self.at
        if cursor in self.recurring or (step in self.transient and step not in self.fired):
            self.fired.add(step)
            loss = loss + 10.0
        return logits, loss


class Reads:
    """The loop's batch source (the fault injector's wrapper), recording what it read."""

    def __init__(self, source, engine: TokenEngine):
        self.source, self.engine, self.read = source, engine, []

    def get(self, cursor, step):
        self.engine.at = (step, cursor)
        batch = self.source.get(cursor, step)
        self.read.append((cursor, batch[1].clone()))
        return batch


def corpus(bad: int | None) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, HALF, DOCS * DOC)
    if bad is not None:
        tokens[bad * DOC:(bad + 1) * DOC] = rng.integers(HALF, VOCAB, DOC)
    return tokens, np.arange(0, DOCS * DOC, DOC)


def packed(spec, bad: int | None) -> PackedBatches:
    return PackedBatches(*corpus(bad), seq_len=spec.model.seq_len, batch_size=4,
                         seed=spec.seed)


def bad_document(tmp_path: Path) -> int:
    """The document epoch 0 places at BAD_AT (the stream's 39th)."""
    trainer, *_ = segment(tmp_path / "layout")
    order, offsets = packed(trainer.ctx.spec, None).layout(0)
    assert offsets[38] == BAD_AT
    return int(order[38])


def wired(tmp_path: Path, *, bad: int | None, engine: TokenEngine | None = None,
          to_step: int = 16, **over):
    """A segment over packed batches, the fault injector's source and a replayer, as
    trainer/segment.py build_trainer wires them; returns (trainer, source, reads, outcome)."""
    engine = engine or TokenEngine()
    trainer, _, _, outcome = segment(tmp_path, to_step=to_step, every=2, engine=engine,
                                     **{**SPIKES, **over})
    source = packed(trainer.ctx.spec, bad)
    faulty = FaultInjector([], batches_per_step=1, vocab_size=VOCAB, seed=0).batches(source)
    reads = Reads(faulty, engine)
    object.__setattr__(trainer, "batches", reads)  # the frozen Trainer's batch source
    trainer.guard.source = source
    trainer.guard.replayer = Replayer(engine, faulty)
    return trainer, source, reads, outcome


def masked_as_planned(source: PackedBatches, cursor: int, y: torch.Tensor, bad: int) -> bool:
    """y is batch `cursor`'s targets with none on the bad document and every other intact."""
    mine = source.documents(cursor) == bad
    _, clean, *_ = PackedBatches(*corpus(None), seq_len=source.seq_len,
                                 batch_size=source.batch_size, seed=source.seed).get(cursor)
    return bool(mine.any() and (y[mine] == IGNORE).all() and torch.equal(y[~mine], clean[~mine])
                and (y[~mine] != IGNORE).any())


@pytest.fixture
def planted(tmp_path):
    """A 48-step segment (two epochs) over the corpus with the bad document planted."""
    bad = bad_document(tmp_path)
    trainer, source, reads, outcome = wired(tmp_path, bad=bad, to_step=48)
    state = trainer.train(fresh(trainer))
    return bad, trainer, source, reads, outcome, state


def test_a_bad_document_is_accused_and_skipped_wherever_it_occurs_while_its_window_trains(
        planted):
    bad, trainer, source, reads, outcome, state = planted
    (rb,) = outcome.rollbacks
    assert (rb["at_step"], rb["onset"], rb["to_step"]) == (AT, ONSET, 6)
    assert rb["skipped"] == "documents" and rb["documents"] == [bad] and rb["skip"] is None
    assert rb["window"] == WINDOW and rb["kept_batches"] == 4 and rb["kept_sequences"] == 16
    assert state.skip_documents == [bad] and state.skip_ranges == []
    # the window's batches were read again after the rollback and trained (verdict ok)
    after = [c for c, _ in reads.read][AT:]
    assert after[:6] == [6, 7, 8, 9, 10, 11]
    lines = step_lines(trainer)
    assert [x.verdict for x in lines][ONSET - 1:AT] == ["skip", "rollback"]
    assert [x.verdict for x in lines][AT:] == ["ok"] * (48 - 6)
    # ... with no target on the bad document, every other target intact, in every batch
    # that holds it from then on: the spike's two and its place in the next epoch
    holding = [(c, y) for c, y in reads.read[AT:] if (source.documents(c) == bad).any()]
    assert [c for c, _ in holding][:2] == [8, 9] and max(c for c, _ in holding) > 23
    assert all(masked_as_planned(source, c, y, bad) for c, y in holding)
    # the decision's evidence, in order: the diagnosis first, then the rollback it drove
    kinds = [e["kind"] for e in events(trainer, "spike_diagnosed") + events(trainer, "rollback")]
    assert kinds == ["spike_diagnosed", "rollback"]
    (diag,) = events(trainer, "spike_diagnosed")
    (logged,) = events(trainer, "rollback")
    assert diag["payload"]["verdict"] == "data" and diag["payload"]["documents"] == [bad]
    assert diag["ts"] <= logged["ts"]
    assert (logged["payload"]["skipped"], logged["payload"]["documents"]) == ("documents", [bad])
    assert logged["payload"]["skip"] is None and logged["payload"]["kept_batches"] == 4


def test_skipped_documents_survive_a_resume_from_the_checkpoint_written_after_the_decision(
        planted, tmp_path):
    bad, trainer, _, _, _, state = planted
    kept = trainer.checkpoints.kept
    assert kept[max(kept)][2].skip_documents == [bad]  # committed with the train state
    # the next segment of the run, from its newest checkpoint
    again, source, reads, outcome = wired(tmp_path / "again", bad=bad, to_step=96)
    again.checkpoints.kept = kept
    resumed = again.checkpoints.restore()
    resume_skipped_documents(again.ctx, resumed, source)
    assert resumed.step == 48 and resumed.skip_documents == [bad]
    again.train(resumed)
    assert outcome.rollbacks == []
    holding = [(c, y) for c, y in reads.read if (source.documents(c) == bad).any()]
    assert holding and all(masked_as_planned(source, c, y, bad) for c, y in holding)


def test_skipped_documents_survive_a_segment_that_ends_before_its_next_commit(tmp_path):
    bad = bad_document(tmp_path)
    trainer, _, _, outcome = wired(tmp_path, bad=bad, max_rollbacks=0)
    state = trainer.train(fresh(trainer))
    assert outcome.stopped == "rollback_budget" and state.step == 6
    kept = trainer.checkpoints.kept
    assert max(kept) == 6 and kept[6][2].skip_documents == []  # committed before the decision
    # the next segment restores step 6 and finds the decision in the run's event log
    again, source, reads, outcome = wired(tmp_path, bad=bad, to_step=14)
    again.checkpoints.kept = kept
    resumed = again.checkpoints.restore()
    resume_skipped_documents(again.ctx, resumed, source)
    assert resumed.skip_documents == [bad]
    again.train(resumed)
    assert outcome.rollbacks == [] and outcome.skipped_steps == []
    holding = [(c, y) for c, y in reads.read if (source.documents(c) == bad).any()]
    assert [c for c, _ in holding] == [8, 9]
    assert all(masked_as_planned(source, c, y, bad) for c, y in holding)


def test_an_optimisation_verdict_rolls_back_and_skips_no_data(tmp_path):
    engine = TokenEngine(transient=(ONSET, AT))
    trainer, _, reads, outcome = wired(tmp_path, bad=None, engine=engine, to_step=16)
    state = trainer.train(fresh(trainer))
    (diag,) = events(trainer, "spike_diagnosed")
    assert diag["payload"]["verdict"] == "optimisation"
    (rb,) = outcome.rollbacks
    assert (rb["skipped"], rb["skip"], rb["documents"]) == ("nothing", None, [])
    assert rb["window"] == WINDOW and rb["kept_batches"] == 4
    assert state.skip_ranges == [] and state.skip_documents == []
    assert [c for c, _ in reads.read][AT:] == list(range(6, 16))  # every batch read again
    (logged,) = events(trainer, "rollback")
    assert logged["payload"]["skipped"] == "nothing" and logged["payload"]["skip"] is None


def test_a_spike_that_comes_back_after_skipping_nothing_gets_its_window_skipped(tmp_path):
    engine = TokenEngine(recurring=(ONSET - 1, AT - 1))  # the cursors steps 9 and 10 read
    # (a budget, so that without the rule the segment ends instead of looping forever)
    trainer, _, _, outcome = wired(tmp_path, bad=None, engine=engine, to_step=16,
                                   max_rollbacks=2)
    state = trainer.train(fresh(trainer))
    first, second = outcome.rollbacks
    assert first["skipped"] == "nothing" and first["verdict"] == "optimisation"
    assert second["skipped"] == "window" and second["skip"] == WINDOW
    assert state.step == 16 and state.skip_ranges == [tuple(WINDOW)] and not outcome.stopped
