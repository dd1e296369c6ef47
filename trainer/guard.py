"""The step loop's spike handling (DESIGN §3: a loss spike is skipped or rolled back, never
trained through): the verdict on every loss, and the skip and the rollback it asks for.
Online evaluation is trainer/online_eval.py, an operator's rollback
trainer/operator_rollback.py, when a segment stops trainer/stopping.py.

The decisions are pure (trainer/spikes.py); this module applies them to the live engine
and records every one with its evidence:

- `skip`: the loop vetoes the update of this step (trainer/optim.py): weights, Adam moments and
  step counts stay as if the batch were never seen. The step counter and the LR schedule
  still advance (the schedule is a function of the step, so the run ends on its planned
  step and token budget; docs/decisions.md). Events `loss_spike` + `batch_skipped`.
- `rollback`: uncommit checkpoints from the spike's onset on, restore the newest committed
  checkpoint before the onset, replay the data window around the onset on the restored
  weights to diagnose the spike (trainer/diagnosis.py), reset the detector's outlier window
  and continue. The verdict decides what is skipped from then on (spikes.what_to_skip):
  `data` with accused documents: those documents, wherever they occur (no target on their
  tokens, trainer/data.py), not the window; `optimisation` and `numerics`: no data;
  anything else (bad batches, unclear, no diagnosis) and a repeat in the region of an
  earlier rollback that skipped no window: the window (doubled when the region already had
  one). An abnormal loss first asks whether the ranks' copies of the weights still agree
  (trainer/replicas.py): copies that differ are `numerics` at once — a rollback that
  replays nothing, skips nothing, and names the ranks and nodes in the segment's
  `suspects`. Before each checkpoint commits the copies are compared too
  (`verify_before_commit`): copies that differ there, with no loss to show it, are the same
  `numerics` rollback (reason `replicas_disagree_at_commit`), so a corrupted copy is never
  committed.
  Events `loss_spike` + `spike_diagnosed` + `rollback`, flushed at once. More rollbacks in
  this segment than the workflow allows end the segment early so the workflow can escalate
  (trainer/stopping.py): a spike that keeps coming back ends in an LR backoff, then a hold;
  no checkpoint before the onset at all raises Diverged.
- a loss that shakes rather than spikes: every accepted loss goes on to the oscillation
  watch (trainer/oscillation_watch.py), whose answer is a larger batch asked for, a lower
  LR for a span, or a rollback verdict (the data path) applied here like a spike's.
Every rank runs the same code on the same all-reduced loss and diagnoses on every rank's
pooled replays, so verdicts and what they skip agree across ranks.
"""

from __future__ import annotations

import math

import structlog

from common.errors import Diverged
from common.protocol import SegmentOutcome
from trainer import tracing
from trainer.checkpoint_manager import CheckpointManager
from trainer.context import SegmentContext
from trainer.diagnosis import Diagnosis, Replayer
from trainer.engine import replica_ranks
from trainer.oscillation_watch import OscillationWatch
from trainer.replicas import ReplicaCheck, odd_ones_out
from trainer.replicas import evidence as replica_evidence
from trainer.spikes import (
    Verdict,
    maskable,
    merge_ranges,
    observe,
    reset_window,
    skip_range,
    times_in_region,
    uncovered,
    what_to_skip,
)
from trainer.state import TrainState

log = structlog.get_logger(__name__)

RECENT_LOSSES = 10  # the segment's reported training loss: mean of the last accepted ones
# a diagnosis replays at most this many micro-batches of the rollback's skip window (and
# the spike's own batches a second time)
MAX_REPLAY_BATCHES = 32


def loss_scale_verdict(step: int, loss: float, scale: float | None, min_scale: float,
                       overflowed: bool) -> Verdict | None:
    """fp16: an overflow at the minimum loss scale cannot be scaled away: a sustained spike."""
    if scale is None or not overflowed or scale > min_scale:
        return None
    return Verdict(action="rollback", step=step, loss=loss, reason="loss_scale_at_minimum",
                   onset=step, evidence={"loss_scale": scale, "min_loss_scale": min_scale})


class SpikeGuard:
    """The verdict on each step's loss (`judge`, before its update), fp16 overflow at the
    minimum loss scale (`after_step`), and the rollback a final verdict asks for
    (`resolve`). train_step vetoes the update of a skip or a rollback itself."""

    def __init__(self, ctx: SegmentContext, engine, outcome: SegmentOutcome,
                 checkpoints: CheckpointManager) -> None:
        self.ctx, self.engine, self.outcome = ctx, engine, outcome
        self.checkpoints = checkpoints
        self.cfg, self.train_cfg = ctx.spec.spikes, ctx.spec.train
        self.per_step = ctx.spec.train.grad_accum
        self.cursors: dict[int, int] = {}  # step -> data cursor its first batch was read at
        self.accepted: list[float] = []  # accepted losses since online_eval last took them
        self.recent: list[float] = []  # last accepted losses (the segment's reported loss)
        self.replayer: Replayer | None = None  # the spike's diagnosis (trainer/diagnosis.py)
        self.replicas: ReplicaCheck | None = None  # do the ranks' weights agree (numerics)
        self.suspected: Diagnosis | None = None  # copies that disagreed, until the rollback
        self.source = None  # the batch source whose documents a `data` verdict skips
        self.spared: list[int] = []  # onset cursors of this segment's rollbacks with no window
        # a loss that shakes rather than spikes (trainer/oscillation_watch.py)
        self.oscillation = OscillationWatch(ctx, engine, outcome, self._event)
        rows = ctx.spec.train.micro_batch_tokens // ctx.spec.model.seq_len  # per micro-batch
        self.batch_tokens = rows * ctx.spec.model.seq_len  # one micro-batch's token slots
        # sequences one cursor names on all data replicas together (a TP group's ranks, a
        # pipeline's stages, read one batch: trainer/engine.py replica_ranks)
        self.rows = rows * (ctx.world // replica_ranks(ctx.spec))

    # ---- per step ------------------------------------------------------------------
    def judge(self, state: TrainState, step: int, loss: float, cursor: int) -> Verdict:
        """Detector verdict for `step` (1-based), before its update; records it."""
        self.cursors[step] = cursor
        # an onset is inside the window (an oscillation's: inside its block)
        self.cursors.pop(step - max(self.cfg.window, self.cfg.oscillation.window), None)
        if not self.cfg.enabled:
            return Verdict(action="ok", step=step, loss=loss, reason="handling_off")
        state.detector, verdict = observe(state.detector, step, loss, self.cfg)
        if verdict.action != "ok":
            verdict = self.check_replicas(verdict)  # collective: a small all-gather
            self._event("loss_spike", step, f"loss_spike/{step}", **evidence(verdict))
        if verdict.action == "skip":
            state.skipped.append(step)
            self.outcome.skipped_steps.append(step)
            self._event("batch_skipped", step, f"batch_skipped/{step}", reason=verdict.reason,
                        batches=[cursor, cursor + self.per_step], loss=finite_or_none(loss))
        return verdict

    def check_replicas(self, verdict: Verdict) -> Verdict:
        """An abnormal loss: do the ranks' copies of the weights still agree
        (trainer/replicas.py)? Copies that differ are silent data corruption, whatever the
        loss looks like: no skipped update heals a rank's copy, so roll back at once (every
        rank restores the same bytes) and skip no data."""
        copies = self.replicas.gather() if self.replicas is not None else []
        if not self.suspect(copies, verdict.step):
            return verdict
        return Verdict(action="rollback", step=verdict.step, loss=verdict.loss,
                       baseline=verdict.baseline, spread=verdict.spread,
                       threshold=verdict.threshold, reason="replicas_disagree",
                       onset=verdict.onset or verdict.step,
                       evidence={**verdict.evidence, "detector": verdict.reason})

    def verify_before_commit(self, state: TrainState) -> TrainState:
        """Before a checkpoint commits: do the ranks' copies still agree? A corruption the
        loss never shows (a flipped bit in a weight) would otherwise be committed, resumed
        and trained on for good; copies that differ are rolled back to the last commit as
        an abnormal loss's would be (`numerics`: nothing replayed, nothing skipped, the
        suspects named). Collective: the fingerprint's small all-gather, once a checkpoint.
        The restored state, or `state` itself."""
        copies = self.replicas.gather() if self.replicas is not None else []
        if not self.suspect(copies, state.step):
            return state
        log.warning("replicas_disagree_at_commit", step=state.step,
                    ranks=self.suspected.evidence["ranks"] if self.suspected else [])
        loss = self.recent_loss()
        return self.rollback(state, Verdict(
            action="rollback", step=state.step, loss=math.nan if loss is None else loss,
            reason="replicas_disagree_at_commit", onset=state.step))

    def suspect(self, copies: list, step: int) -> bool:
        """Copies that differ: the `numerics` diagnosis the rollback records, and the
        suspected ranks and nodes in the segment's result (the workflow sets nodes aside on
        them). False when every copy agrees."""
        if not odd_ones_out(copies):
            return False
        self.suspected = Diagnosis("numerics", (), replica_evidence(copies))
        self.outcome.suspects.append({"step": step, **{
            k: self.suspected.evidence[k] for k in ("ranks", "node_ranks")}})
        return True

    def after_step(self, step: int, loss: float, verdict: Verdict) -> Verdict:
        """After engine.step(): count fp16 overflow skips; one at the minimum scale is a
        sustained spike (rollback verdict). Keeps accepted losses for online eval, and
        hands them to the oscillation watch (a rollback verdict on its data path)."""
        if verdict.action == "ok" and math.isfinite(loss):
            self.accepted.append(loss)
            self.recent = (self.recent + [loss])[-RECENT_LOSSES:]
        if self.train_cfg.precision != "fp16" or self.engine.was_step_applied():
            return self.oscillation.observe(step, loss, verdict)
        self.outcome.overflow_steps += 1
        scaled = loss_scale_verdict(step, loss, getattr(self.engine.optimizer, "cur_scale", None),
                                    self.train_cfg.fp16_min_loss_scale, overflowed=True)
        if scaled is None or not self.cfg.enabled:
            return verdict
        self._event("loss_spike", step, f"loss_spike/{step}", **evidence(scaled))
        return scaled

    def recent_loss(self) -> float | None:
        """Mean of the last RECENT_LOSSES accepted training losses (None if there are none)."""
        return sum(self.recent) / len(self.recent) if self.recent else None

    # ---- rollback --------------------------------------------------------------------
    def resolve(self, verdict: Verdict, state: TrainState) -> TrainState:
        """The state the loop goes on from after a step with this final verdict: the
        restored one for a rollback, else `state` itself."""
        return self.rollback(state, verdict) if verdict.action == "rollback" else state

    def rollback(self, state: TrainState, verdict: Verdict) -> TrainState:
        """Restore the newest checkpoint before the onset; skip the data around it."""
        self.ctx.windows.close()  # the steps up to the spike: their own span
        with tracing.span("rollback", badput="rollback", step=verdict.step, rank=self.ctx.rank):
            return self._rollback(state, verdict)

    def _rollback(self, state: TrainState, verdict: Verdict) -> TrainState:
        onset = verdict.onset or verdict.step
        onset_cursor = self.cursors.get(onset, state.data_cursor)
        # The onset's loss was computed with the weights after update onset-1, which may be
        # the bad one (an LR burst shows only in the next loss): go back before it too.
        before = max(0, onset - 2)
        # Restore first, uncommit the abandoned trajectory only once the target has loaded:
        # with no checkpoint left before the onset nothing is deleted (uncommitting first
        # once deleted the only checkpoint a spike just after a commit could go back to).
        restored, gone = self.checkpoints.rollback_to(before)
        if restored is None:
            raise Diverged(verdict.step, f"no committed checkpoint at or before step {before} "
                                         f"(before the spike's onset at step {onset}) to roll "
                                         f"back to; every checkpoint is kept")
        # decisions made after the restored checkpoint was written stay decided
        ranges = merge_ranges(list(state.skip_ranges) + list(restored.skip_ranges))
        documents = sorted(set(state.skip_documents) | set(restored.skip_documents))
        skip_documents(self.source, documents)  # the replay reads what the loop will read
        times = times_in_region(ranges, onset_cursor, self.cfg, self.per_step)
        window = skip_range(onset_cursor, self.cfg, times, self.per_step)
        restored.detector = reset_window(restored.detector)
        self.oscillation.restored()
        found = self._diagnose(verdict, onset, window, restored.step)
        skipped = self._what_to_skip(found, onset_cursor)
        accused = sorted(found.documents) if skipped == "documents" else []
        kept = 0 if skipped == "window" else uncovered(window, ranges)
        if skipped == "window":
            restored.skip_ranges = merge_ranges(ranges + [window])
        else:
            restored.skip_ranges = ranges
            self.spared.append(onset_cursor)
        restored.skip_documents = sorted(set(documents) | set(accused))
        skip_documents(self.source, restored.skip_documents)
        record = {"at_step": verdict.step, "onset": onset, "to_step": restored.step,
                  "skipped": skipped, "skip": list(window) if skipped == "window" else None,
                  "window": list(window), "documents": accused, "kept_batches": kept,
                  "kept_sequences": kept * self.rows, "verdict": found.verdict if found else None,
                  "times_in_region": times, "discarded": gone}
        self.outcome.rollbacks.append(record)
        self._event("rollback", verdict.step, f"rollback/{verdict.step}/{onset}/{restored.step}",
                    **record, lost_steps=verdict.step - restored.step, **evidence(verdict))
        log.warning("rollback", **{**record, "documents": accused[:20]})
        return restored

    def _what_to_skip(self, found: Diagnosis | None, onset_cursor: int) -> str:
        """spikes.what_to_skip for this rollback: documents only where the batch source can
        mask them and every micro-batch keeps a sequence's worth of other tokens
        (spikes.maskable)."""
        near = self.cfg.skip_window * self.per_step
        repeat = any(abs(onset_cursor - c) <= near for c in self.spared)
        tokens_of = getattr(self.source, "tokens_of", None)
        can_mask = bool(found and found.documents and tokens_of is not None and maskable(
            tokens_of(found.documents), self.batch_tokens, self.ctx.spec.model.seq_len))
        return what_to_skip(found.verdict if found else None,
                            found.documents if found else (), maskable=can_mask, repeat=repeat)

    def _diagnose(self, verdict: Verdict, onset: int, window: tuple[int, int],
                  restored: int) -> Diagnosis | None:
        """Why it spiked, recorded (`spike_diagnosed`, before the rollback it decides):
        copies of the weights that disagreed (found when the loss was judged), else a replay
        of the spike's data window on the restored weights; None when neither is possible."""
        passes, seconds = 0, 0.0
        if self.suspected is not None:  # numerics, without a replay
            found, self.suspected = self.suspected, None
            # collective: every copy restored from the same bytes agrees again
            found.evidence["agree_after_restore"] = not odd_ones_out(self.replicas.gather())
        elif self.replayer is None or verdict.threshold is None:
            return None
        else:
            spike = {self.cursors[s] + i for s in range(onset, verdict.step + 1)
                     if s in self.cursors for i in range(self.per_step)}
            lo, hi = window
            cursors = sorted(set(range(lo, min(hi, lo + MAX_REPLAY_BATCHES))) | spike)
            found, seconds = self.replayer.diagnose(cursors, spike, verdict.step,
                                                    verdict.threshold)
            passes = len(cursors) + len(spike)  # the window once, the spike's batches again
        self._event("spike_diagnosed", verdict.step,
                    f"spike_diagnosed/{verdict.step}/{onset}/{restored}",
                    verdict=found.verdict, documents=list(found.documents), onset=onset,
                    replay_s=round(seconds, 3), forward_passes=passes,
                    steps_worth=round(passes / (3 * self.per_step), 2),
                    rank=self.ctx.rank, **json_safe(found.evidence))
        log.warning("spike_diagnosed", step=verdict.step, verdict=found.verdict,
                    documents=list(found.documents)[:20], replay_s=round(seconds, 3))
        return found

    def _event(self, kind: str, step: int, event_id: str, **payload) -> None:
        decision_event(self.ctx, self.outcome, kind, step, event_id, **payload)


def decision_event(ctx: SegmentContext, outcome: SegmentOutcome, kind: str, step: int,
                   event_id: str, **payload) -> None:
    """Record one automatic decision with its evidence (rank 0). A replay after a rollback
    passes the same step numbers again: its events are new ones."""
    if ctx.events is None:
        return
    event_id += f"/a{ctx.args.launch}r{len(outcome.rollbacks)}"
    ctx.events.emit(kind, step=step, event_id=event_id, **payload)
    if kind in ("rollback", "overfitting", "oscillation_detected"):
        ctx.events.flush()  # every recovery decision is durable at once


def recorded_skip_ranges(ctx: SegmentContext) -> list[tuple[int, int]]:
    """The skip window of every rollback in the run's event log (flushed at each decision).

    A rollback restores a checkpoint committed *before* it decided the window, so until the
    next commit the window lives only in memory: a segment that ends at the restored step
    (rollback budget spent) or dies before its next commit would replay the bad data. The
    restored TrainState is merged with these, read by rank 0 and broadcast.
    """
    events = ctx.read_events(("rollback",))
    return [(int(e["payload"]["skip"][0]), int(e["payload"]["skip"][1]))
            for e in events if e["payload"].get("skip")]  # None: no window was skipped


def recorded_skip_documents(ctx: SegmentContext) -> list[int]:
    """The documents every rollback in the run's event log skipped (as for the windows,
    recorded_skip_ranges: a rollback's decision lives only in memory and events until the
    next commit)."""
    events = ctx.read_events(("rollback",))
    return sorted({int(d) for e in events if e["payload"].get("skipped") == "documents"
                   for d in e["payload"].get("documents") or ()})


def resume_skipped_documents(ctx: SegmentContext, state: TrainState, source) -> None:
    """At a segment's start: the restored state's skipped documents and those of the
    rollbacks decided after its checkpoint (events, read by rank 0 and broadcast), masked by
    `source` from the first batch on."""
    state.skip_documents = sorted(set(state.skip_documents) | set(recorded_skip_documents(ctx)))
    skip_documents(source, state.skip_documents)


def skip_documents(source, documents: list[int]) -> None:
    """`source` masks these documents from its next batch on; a source without documents
    (fixed windows) is never asked to skip any."""
    mask = getattr(source, "skip_documents", None)
    if mask is not None:
        mask(documents)
    elif documents:
        log.warning("documents_not_skipped", documents=documents[:20],
                    reason="the batch source has no documents")


def evidence(v: Verdict) -> dict:
    return {"loss": finite_or_none(v.loss), "baseline": v.baseline, "spread": v.spread,
            "threshold": v.threshold, "reason": v.reason, **v.evidence}


def json_safe(value):
    """`value` with every non-finite float as None (events are strict JSON)."""
    if isinstance(value, float):
        return finite_or_none(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def finite_or_none(x: float | None) -> float | None:
    """JSON has no NaN: a non-finite loss is reported as null."""
    return x if x is not None and math.isfinite(x) else None
