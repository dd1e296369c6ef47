"""The step loop (trainer/loop.py) in-process, with a small fake engine: no DeepSpeed, no
processes. The loop's real owners run — the spike guard and its detector, the checkpoint
manager's cadence, online evaluation, the stopper, the progress file and the event log —
and only the storage of checkpoints is kept in memory.

The fake model is one parameter `w` with loss mean((w - x)^2) over a batch of x's, so each
test chooses every batch's loss by the value it serves at that data cursor.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from common.errors import Diverged
from common.procs import STOP_FILE
from common.protocol import SegmentOutcome, StepLine, parse_line
from storage.events import read_events
from tests.trainer.helpers import tiny_spec
from trainer.checkpoint_manager import CheckpointManager, save_due
from trainer.context import SegmentArgs, SegmentContext
from trainer.guard import SpikeGuard
from trainer.loop import Trainer
from trainer.online_eval import OnlineEval
from trainer.optim import SkippableAdamW
from trainer.schedule import LRSchedule
from trainer.state import TrainState
from trainer.step_metrics import StepProbe
from trainer.stopping import TARGET, Stopper, StopRules, stop_reason
from trainer.throughput import Meter

ROWS = 4  # sequences per micro-batch (tiny_spec: 128 tokens of 32)
SPIKE = 50.0  # a batch value whose loss is ~2500 where the others' is ~1


class Scalar(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x, y, **_):
        return None, ((self.w - x) ** 2).mean()


class FakeEngine:
    """What train_step asks of DeepSpeed's engine, with its accumulation rule: backward
    scales the loss by 1/accum and gradients add up; every accum-th step() call is the
    optimizer step (the one a veto skips), then the gradients are zeroed. `overflow`: the
    updates (1-based) an fp16 overflow skips at the minimum loss scale."""

    device = "cpu"

    def __init__(self, accum: int = 1, overflow: tuple[int, ...] = (), scale: float = 1.0):
        self.module = Scalar()
        self.optimizer = self.basic_optimizer = SkippableAdamW(self.module.parameters(),
                                                               lr=0.01, weight_decay=0.0)
        self.optimizer.cur_scale = scale
        self.accum, self.overflow, self.calls = accum, overflow, 0
        self.applied = True
        self.weights: list[float] = []  # w after each optimizer step, skipped ones too

    def __call__(self, x, y, **kw):
        return self.module(x, y, **kw)

    @staticmethod
    def autotp_size() -> int:
        return 0  # DeepSpeed's answer without a tensor_parallel section: no TP

    def backward(self, loss):
        (loss / self.accum).backward()

    def step(self):
        self.calls += 1
        if self.calls % self.accum:
            return
        overflowed = len(self.weights) + 1 in self.overflow
        if overflowed:
            self.basic_optimizer.veto = True  # DeepSpeed's fp16 wrapper skips the update
        self.applied = not self.basic_optimizer.veto
        self.basic_optimizer.step()
        self.basic_optimizer.zero_grad()
        self.weights.append(float(self.module.w.detach()))

    def get_global_grad_norm(self):
        return None

    # DeepSpeed's plain fp32 ZeRO-0 path: the gradients are the parameters' .grad
    def fp16_enabled(self) -> bool:
        return False

    def bfloat16_enabled(self) -> bool:
        return False

    def zero_optimization(self) -> bool:
        return False

    def was_step_applied(self) -> bool:
        return self.applied

    def updates(self) -> int:
        """Adam's own count of the updates it made."""
        return int(self.optimizer.state[self.module.w].get("step", 0))


class Batches:
    """x = `values.get(cursor, default)` in every row; records each cursor read."""

    def __init__(self, values: dict[int, float] | None = None, default: float = 1.0):
        self.values, self.default, self.read = values or {}, default, []

    def get(self, cursor: int, step: int):
        self.read.append(cursor)
        x = torch.full((ROWS,), self.values.get(cursor, self.default))
        return x, torch.zeros(ROWS, dtype=torch.long)


class MemoryCheckpoints(CheckpointManager):
    """The real manager's cadence (maybe_save, save_due, saved_step) with its storage in
    memory: per saved step the weights, the optimizer state and the TrainState."""

    def __init__(self, ctx, engine, every):
        super().__init__(ctx, engine, every)
        self.kept: dict[int, tuple] = {}
        self.commits: list[int] = []  # steps committed, in order

    def _commit(self, state):
        self.kept[state.step] = copy.deepcopy((self.engine.module.state_dict(),
                                               self.engine.optimizer.state_dict(), state))
        self.commits.append(state.step)
        self.last_commit = (state.step, f"memory://{state.step}")

    def restore(self, at_or_before=None):
        bound = self.ctx.target if at_or_before is None else at_or_before
        steps = [s for s in self.kept if s <= bound]
        if not steps:
            return None
        module, optim, state = copy.deepcopy(self.kept[max(steps)])
        self.engine.module.load_state_dict(module)
        self.engine.optimizer.load_state_dict(optim)
        self.restored, self.saved_step = (state.step, "memory"), state.step
        return state

    def rollback_to(self, at_or_before):
        state = self.restore(at_or_before)
        if state is None:
            return None, []
        gone = sorted(s for s in self.kept if s > state.step)
        for s in gone:
            del self.kept[s]
        return state, gone


class Faults:
    """The fault injector's after-step hook; `then(step)` runs after that step."""

    def __init__(self, then=None):
        self.steps, self.then = [], then or (lambda step: None)

    def after_step(self, step, last_committed):
        self.steps.append(step)
        self.then(step)


SPIKES = {"spikes.warmup": 3, "spikes.window": 8, "spikes.patience": 2,
          "spikes.skip_before": 0, "spikes.skip_window": 2}


def segment(tmp_path: Path, *, to_step: int = 10, every: int = 4, batches: Batches | None = None,
            engine: FakeEngine | None = None, faults: Faults | None = None, val=None,
            max_rollbacks: int = -1, **over):
    """A Trainer over the fake engine; returns (trainer, engine, checkpoints, outcome)."""
    spec = tiny_spec(tmp_path / "store", **{**SPIKES, **over})
    workdir = tmp_path / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    args = SegmentArgs(spec="-", dataset="-", to_step=to_step, workdir=str(workdir),
                       checkpoint_every=every)
    ctx = SegmentContext(args, spec, rank=0, world=1)
    engine = engine or FakeEngine(spec.train.grad_accum)
    outcome = SegmentOutcome()
    checkpoints = MemoryCheckpoints(ctx, engine, every)
    guard = SpikeGuard(ctx, engine, outcome, checkpoints)
    guard.oscillation.schedule = schedule = LRSchedule(spec.train, ())  # as build_trainer
    trainer = Trainer(
        ctx=ctx, engine=engine, batches=batches or Batches(), lr=schedule,
        meter=Meter(flops_token=1.0, peak=1e12, peak_source="test", devices=1),
        probe=StepProbe(ctx, engine), guard=guard, checkpoints=checkpoints,
        faults=faults or Faults(), evaluator=OnlineEval(ctx, engine, val, guard, outcome),
        stopper=Stopper(StopRules(target=to_step, max_rollbacks=max_rollbacks,
                                  early_stop_on_overfit=spec.train.early_stop_on_overfit),
                        outcome))
    return trainer, engine, checkpoints, outcome


def fresh(trainer: Trainer) -> TrainState:
    state = TrainState()
    trainer.checkpoints.save(state)  # step 0, as a fresh segment commits it
    return state


def step_lines(trainer: Trainer) -> list[StepLine]:
    text = Path(trainer.ctx.workdir, "progress.jsonl").read_text()
    return [x for x in map(parse_line, text.splitlines()) if isinstance(x, StepLine)]


def events(trainer: Trainer, kind: str) -> list[dict]:
    """The run's events of `kind`, once the segment's buffered ones are flushed."""
    ctx = trainer.ctx
    ctx.events.flush()
    return read_events(ctx.spec.storage.durable, ctx.spec.run_id, (kind,))


# ---- gradient accumulation ---------------------------------------------------------------
def test_a_step_accumulates_its_micro_batches_into_one_update_and_reports_their_mean_loss(
        tmp_path):
    batches = Batches({0: 1.0, 1: 3.0})  # step 1's two micro-batches: losses ~1 and ~9
    trainer, engine, _, _ = segment(tmp_path, to_step=3, batches=batches,
                                    **{"train.grad_accum": 2})
    trainer.train(fresh(trainer))
    assert batches.read == [0, 1, 2, 3, 4, 5]  # two micro-batches per step, in order
    assert engine.calls == 6 and engine.updates() == 3  # one update per step
    first = step_lines(trainer)[0]
    assert first.loss == pytest.approx((1.0 + 3.0 ** 2) / 2, rel=1e-6)
    # the one update is Adam's on the mean of the two gradients
    w = torch.nn.Parameter(torch.zeros(()))
    ref = torch.optim.AdamW([w], lr=first.lr, weight_decay=0.0)
    ((w - 1.0) ** 2 / 2 + (w - 3.0) ** 2 / 2).backward()
    ref.step()
    assert engine.weights[0] == pytest.approx(float(w.detach()), abs=1e-7)


# ---- the veto ----------------------------------------------------------------------------
def test_a_skipped_batch_makes_no_update_and_its_step_line_says_skip(tmp_path):
    trainer, engine, _, outcome = segment(tmp_path, to_step=8, batches=Batches({5: SPIKE}))
    trainer.train(fresh(trainer))
    lines = step_lines(trainer)
    assert [x.verdict for x in lines] == ["ok"] * 5 + ["skip"] + ["ok"] * 2
    assert outcome.skipped_steps == [6]
    assert engine.weights[5] == engine.weights[4]  # step 6 left w where step 5 put it
    assert engine.weights[4] != engine.weights[3] and engine.weights[6] != engine.weights[5]
    assert engine.updates() == 7 and engine.optimizer.vetoed == 1  # Adam's count too
    assert [e["step"] for e in events(trainer, "batch_skipped")] == [6]


# ---- the rollback ------------------------------------------------------------------------
def test_a_sustained_spike_rolls_back_before_its_onset_and_replays_past_its_data(tmp_path):
    batches = Batches({6: SPIKE, 7: SPIKE})  # steps 7 and 8: two outliers = patience
    val = [(torch.zeros(ROWS), torch.zeros(ROWS, dtype=torch.long))]
    trainer, engine, checkpoints, outcome = segment(tmp_path, to_step=10, every=2, val=val,
                                                    batches=batches, **{"train.eval_every": 2})
    state = trainer.train(fresh(trainer))
    (rb,) = outcome.rollbacks
    assert (rb["at_step"], rb["onset"], rb["to_step"]) == (8, 7, 4)  # before onset - 1
    assert rb["skip"] == [6, 8] and rb["discarded"] == [6]
    lines = step_lines(trainer)
    assert [x.step for x in lines] == [*range(1, 9), *range(5, 11)]  # 5..8 replayed
    assert [x.verdict for x in lines][6:8] == ["skip", "rollback"]
    assert batches.read == [*range(0, 8), 4, 5, 8, 9, 10, 11]  # the spike's data skipped
    assert state.step == 10 and state.skip_ranges == [(6, 8)]
    assert engine.weights[6] == engine.weights[7] == engine.weights[5]  # 7, 8 vetoed
    assert engine.weights[8] == engine.weights[4]  # step 5 replayed from step 4's state
    assert checkpoints.commits == [0, 2, 4, 6, 6, 8, 10]  # 6 again after the rollback
    # the owners after the rollback step: no fault injection, no evaluation of step 4 again
    assert trainer.faults.steps == [*range(1, 8), *range(5, 11)]
    assert [e[0] for e in outcome.evals] == [2, 4, 6, 6, 8, 10]
    assert [e["payload"]["to_step"] for e in events(trainer, "rollback")] == [4]


def test_an_fp16_overflow_at_the_minimum_scale_is_logged_as_the_rollback_it_makes(tmp_path):
    engine = FakeEngine(overflow=(6,), scale=1.0)
    trainer, _, checkpoints, outcome = segment(
        tmp_path, to_step=8, every=2, engine=engine,
        **{"train.precision": "fp16", "train.fp16_min_loss_scale": 1.0})
    trainer.train(fresh(trainer))
    lines = step_lines(trainer)
    assert [x.verdict for x in lines][:6] == ["ok"] * 5 + ["rollback"]
    assert outcome.overflow_steps == 1
    (rb,) = outcome.rollbacks
    assert (rb["at_step"], rb["onset"], rb["to_step"]) == (6, 6, 4)
    assert [e["payload"]["reason"] for e in events(trainer, "loss_spike")] == [
        "loss_scale_at_minimum"]
    assert checkpoints.commits == [0, 2, 4, 6, 8]


def test_a_spike_with_no_checkpoint_before_its_onset_fails_as_diverged(tmp_path):
    trainer, _, _, _ = segment(tmp_path, to_step=10, every=100,
                               batches=Batches({4: SPIKE, 5: SPIKE}))
    with pytest.raises(Diverged):
        trainer.train(TrainState())  # nothing committed: no step-0 rollback base


# ---- a loss that shakes -------------------------------------------------------------------
SHAKE = {"spikes.oscillation.enabled": True, "spikes.oscillation.warmup": 4,
         "spikes.oscillation.window": 8, "spikes.oscillation.references": 2}


def shaking(calm: float, shaky: float, start: int = 20, cursors: int = 64) -> Batches:
    """x alternates around 1 by `calm` before cursor `start` and by `shaky` from there: the
    loss (1 - x)^2-ish wobbles step to step, within the spike detector's threshold."""
    return Batches({c: 1.0 + (shaky if c >= start else calm) * (-1) ** c
                    for c in range(cursors)})


def test_a_loss_that_starts_to_shake_is_detected_and_the_lr_lowered_with_the_figures(tmp_path):
    trainer, _, _, outcome = segment(tmp_path, to_step=30, batches=shaking(0.005, 0.03), **SHAKE)
    trainer.train(fresh(trainer))
    lines = step_lines(trainer)
    assert {x.verdict for x in lines} == {"ok"}  # no spike: every wobble is within threshold
    (event,) = events(trainer, "oscillation_detected")
    p = event["payload"]
    assert event["step"] == 28 and p["window"] == [21, 28]  # the first block after the shaking
    assert p["variance_ratio"] >= 9 and p["variance"] > p["reference"] > 0
    assert p["action"] == "lower_lr" and p["lr_window"] == [28, 228, 0.5]
    assert p["b_simple"] is None and "one micro-batch per step" in p["noise_unmeasured"]
    assert p["batch"] == ROWS and p["b_simple_unit"] == "sequences" and "suspect" in p["why"]
    planned = LRSchedule(trainer.ctx.spec.train, ())
    assert lines[27].lr == pytest.approx(planned(28))  # the step that found it: as planned
    assert lines[28].lr == pytest.approx(planned(29) * 0.5)  # from the next step: halved
    assert outcome.rollbacks == []


def test_a_loss_that_keeps_its_wobble_is_not_an_oscillation(tmp_path):
    trainer, _, _, _ = segment(tmp_path, to_step=40, batches=shaking(0.005, 0.005), **SHAKE)
    trainer.train(fresh(trainer))
    assert events(trainer, "oscillation_detected") == []
    planned = LRSchedule(trainer.ctx.spec.train, ())
    assert [x.lr for x in step_lines(trainer)] == pytest.approx([planned(s) for s in range(1, 41)])


def test_a_noisy_gradient_asks_for_a_larger_batch_from_the_gradient_noise_scale(tmp_path):
    # two micro-batches a step, x = 1 + e +- 0.9: each one's gradient is far from their
    # mean's (a large tr(Sigma)); e wobbles the step's loss as above
    values = {}
    for step in range(40):
        e = (0.03 if step >= 20 else 0.005) * (-1) ** step
        values[2 * step] = 1.0 + e + 0.9 * (-1) ** step
        values[2 * step + 1] = 1.0 + e - 0.9 * (-1) ** step
    trainer, _, _, outcome = segment(
        tmp_path, to_step=30, batches=Batches(values), **SHAKE,
        **{"train.grad_accum": 2, "train.lr": 1e-4, "train.min_lr": 1e-5,
           "spikes.oscillation.noise_every": 3})  # both signs come first in turn
    state = trainer.train(fresh(trainer))
    (event,) = events(trainer, "oscillation_detected")
    p = event["payload"]
    assert p["action"] == "raise_batch" and p["grad_accum_asked"] == 8  # 2 x max_batch_factor
    assert p["batch"] == 2 * ROWS and p["b_simple"] > 2 * p["batch"]
    assert p["gradient_sq"] > 0 and p["noise_trace"] > 0 and p["noise_samples"] == 8
    assert p["noise_unmeasured"] == "" and p["lr_window"] is None
    planned = LRSchedule(trainer.ctx.spec.train, ())
    assert step_lines(trainer)[-1].lr == pytest.approx(planned(event["step"]))  # LR alone
    # the engine cannot change its accumulation: the segment ends on that step, committed,
    # for the workflow to launch the next with the larger batch
    assert outcome.stopped == "raise_batch" and outcome.grad_accum_asked == 8
    assert state.step == event["step"] < 30 and len(step_lines(trainer)) == event["step"]


def test_a_loss_that_shakes_again_under_the_lowered_lr_takes_the_data_path(tmp_path):
    trainer, _, checkpoints, outcome = segment(
        tmp_path, to_step=40, max_rollbacks=0, batches=shaking(0.005, 0.03), **SHAKE)
    state = trainer.train(fresh(trainer))
    actions = [e["payload"]["action"] for e in events(trainer, "oscillation_detected")]
    assert actions == ["lower_lr", "data"]  # steps 28, then 36 at the lowered LR
    (rb,) = outcome.rollbacks
    assert (rb["at_step"], rb["onset"], rb["skipped"]) == (36, 29, "window")
    assert events(trainer, "rollback")[0]["payload"]["reason"] == "oscillation"
    assert rb["to_step"] <= 27 and outcome.stopped == "rollback_budget"
    assert state.step == rb["to_step"]


def test_the_data_path_is_taken_once_per_lowered_lr_then_the_shaking_is_only_recorded(tmp_path):
    trainer, _, _, outcome = segment(tmp_path, to_step=60, batches=shaking(0.005, 0.03),
                                     **SHAKE)
    state = trainer.train(fresh(trainer))
    actions = [e["payload"]["action"] for e in events(trainer, "oscillation_detected")]
    assert actions[:2] == ["lower_lr", "data"] and set(actions[2:]) == {"none"}
    assert len(outcome.rollbacks) == 1 and state.step == 60  # no rollback after rollback


# ---- the commit cadence ------------------------------------------------------------------
def test_commits_fall_every_n_steps_and_on_the_last_one_never_twice(tmp_path):
    trainer, _, checkpoints, outcome = segment(tmp_path, to_step=10, every=3)
    state = trainer.train(fresh(trainer))
    assert checkpoints.commits == [0, 3, 6, 9, 10]
    assert state.step == 10 and outcome.stopped == ""
    assert checkpoints.last_committed_step == 10


def test_a_segment_resumed_at_its_target_runs_no_step_and_commits_nothing(tmp_path):
    trainer, engine, checkpoints, _ = segment(tmp_path, to_step=4, every=4)
    trainer.train(fresh(trainer))
    again, engine2, checkpoints2, _ = segment(tmp_path / "again", to_step=4, every=4)
    checkpoints2.kept = checkpoints.kept
    state = again.train(checkpoints2.restore())
    assert state.step == 4 and engine2.calls == 0 and checkpoints2.commits == []


def test_save_due_is_every_n_steps_or_the_last_never_the_step_saved_or_restored():
    assert [s for s in range(1, 11) if save_due(s, None, 4, last=s == 10)] == [4, 8, 10]
    assert not save_due(8, 8, 4, last=True)
    assert save_due(7, 4, 4, last=True)


# ---- the stop reasons --------------------------------------------------------------------
def test_a_stop_request_ends_the_segment_after_that_step_on_a_committed_step(tmp_path):
    def request_stop(step):
        if step == 3:
            Path(trainer.ctx.workdir, STOP_FILE).write_text("operator stop")

    faults = Faults(request_stop)
    trainer, _, checkpoints, outcome = segment(tmp_path, to_step=10, every=5, faults=faults)
    state = trainer.train(fresh(trainer))
    assert state.step == 4 and outcome.stopped == "interrupted"  # seen in step 4's collective
    assert checkpoints.commits == [0, 4] and faults.steps == [1, 2, 3, 4]


def test_a_spent_rollback_budget_ends_the_segment_on_the_restored_step(tmp_path):
    trainer, _, checkpoints, outcome = segment(
        tmp_path, to_step=20, every=2, max_rollbacks=0, batches=Batches({6: SPIKE, 7: SPIKE}))
    state = trainer.train(fresh(trainer))
    assert outcome.stopped == "rollback_budget" and len(outcome.rollbacks) == 1
    assert state.step == 4 and checkpoints.commits == [0, 2, 4, 6]  # 4 not committed again


def test_overfitting_stops_the_segment_when_early_stop_is_on(tmp_path):
    # train batches pull w towards 1, the validation batch sits at -1: train loss falls
    # while validation loss rises at every evaluation
    val = [(torch.full((ROWS,), -1.0), torch.zeros(ROWS, dtype=torch.long))]
    over = {"train.eval_every": 2, "train.overfit_evals": 2, "spikes.enabled": False}
    trainer, _, checkpoints, outcome = segment(
        tmp_path, to_step=20, every=4, val=val, **over, **{"train.early_stop_on_overfit": True})
    state = trainer.train(fresh(trainer))
    assert outcome.stopped == "overfitting" and state.step == 6
    assert [e[0] for e in outcome.evals] == [2, 4, 6]
    assert checkpoints.commits == [0, 4, 6]
    quiet, _, _, quiet_outcome = segment(tmp_path / "off", to_step=8, every=4, val=val, **over)
    assert quiet.train(fresh(quiet)).step == 8 and quiet_outcome.stopped == ""
    assert events(quiet, "overfitting")  # reported, without stopping


def test_stop_reason_puts_the_rollback_budget_first_and_the_target_last():
    rules = StopRules(target=10, max_rollbacks=1, early_stop_on_overfit=True)
    assert stop_reason(rules, step=10, rollbacks=2, signal="SIGTERM",
                       overfitting=True) == "rollback_budget"
    assert stop_reason(rules, step=10, rollbacks=1, signal="SIGTERM",
                       overfitting=True) == "interrupted"
    assert stop_reason(rules, step=10, rollbacks=0, overfitting=True) == "overfitting"
    assert stop_reason(rules, step=10, rollbacks=0) == TARGET
    assert stop_reason(rules, step=9, rollbacks=1) == ""
    assert stop_reason(StopRules(target=10), step=5, rollbacks=0, overfitting=True) == ""
    assert stop_reason(rules, step=5, rollbacks=0, batch_asked=True) == "raise_batch"
    assert stop_reason(rules, step=10, rollbacks=0, batch_asked=True) == TARGET  # done anyway
