"""The Sweep child with sweep.pruning, on the real dev server, with the real pruner (optuna's
SuccessiveHalvingPruner in the `prune_trial` local activity) and stub trainers whose
held-out losses are scripted per trial and step: losing trials stop at their rung
boundary and never train a later rung, are recorded `pruned` with their rung losses and
told to the sampler as PRUNED, the winner is a trial that ran whole, and the history
replays on today's code.

With MAINSPRING_RECORD_HISTORIES=<label> the histories are written to
tests/workflows/histories/<label>/pruned.sweep.json and scored.sweep.json (trials scored by
their own segments), which test_replay.py replays too.
"""

from __future__ import annotations

import asyncio
import uuid

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Replayer

from activities.contracts import (
    EVALUATE,
    SUGGEST_TRIALS,
    SWEEP_WORKFLOW_TYPE,
    TRAIN_SEGMENT,
    EvalPoint,
    EvaluateInput,
    EvaluateResult,
    SuggestInput,
    SuggestResult,
    SweepInput,
    TrainSegmentInput,
    TrainSegmentResult,
)
from tests.workflows.stub_run import HISTORIES, RECORD, Harness, Stubs, spec_for
from workflows.sweep import Sweep
from workflows.training_run import TrainingRun

# trial_steps 9 in three rungs at reduction factor 3: boundaries at steps 1 and 3, end at 9.
# Each trial's lr and its held-out loss at each step it may reach. Successive halving keeps
# the best third of each rung, and a newcomer among fewer than three only if it leads:
# trial 1 (5.3 at step 1 against 5.0) stops at step 1; trial 3 leads step 1 and then loses
# step 3 to trial 2 (4.7 against 4.5); at step 1 trial 4 is not the best of five, nor trial
# 5 among the best two of six; trials 0 and 2 run whole and trial 2 wins, though trials 1, 4
# and 5 would have ended lower had they gone on. The two that ran whole end above their
# step-3 loss (as a too-high learning rate can), so trial 3's 4.7 where it stopped is below
# the winner's 4.8: a pruned trial's loss must not win.
SCRIPT = [(5e-3, {1: 5.0, 3: 4.6, 9: 4.9}), (2e-2, {1: 5.3, 3: 4.0, 9: 3.0}),
          (1e-2, {1: 4.9, 3: 4.5, 9: 4.8}), (8e-3, {1: 4.8, 3: 4.7, 9: 3.5}),
          (3e-3, {1: 5.5, 3: 3.0, 9: 2.0}), (1.2e-2, {1: 5.1, 3: 3.0, 9: 2.0})]
LOSS = {lr: losses for lr, losses in SCRIPT}
COMPLETED, PRUNED_AT = {0: 9, 2: 9}, {1: 1, 3: 3, 4: 1, 5: 1}  # trial -> steps trained


class ScriptedStubs(Stubs):
    """The stubs, with scripted points and losses, and every trial segment kept."""

    def __init__(self) -> None:
        super().__init__()
        self.trial_segments: list[TrainSegmentInput] = []
        self.suggested: list[SuggestInput] = []

    @activity.defn(name=SUGGEST_TRIALS)
    async def suggest_trials(self, inp: SuggestInput) -> SuggestResult:
        self.suggested.append(inp)
        start = len(inp.observed)
        return SuggestResult([{"lr": lr} for lr, _ in SCRIPT[start:start + inp.count]], "tpe")

    @activity.defn(name=TRAIN_SEGMENT)
    async def train_segment(self, inp: TrainSegmentInput) -> TrainSegmentResult:
        self.trial_segments.append(inp)
        return await Stubs.train_segment(self, inp)

    @activity.defn(name=EVALUATE)
    async def evaluate(self, inp: EvaluateInput) -> EvaluateResult:
        losses = LOSS[inp.spec["train"]["lr"]]
        return EvaluateResult([EvalPoint(s, losses[s], 0.0) for s in inp.steps])


def run_sweep(address: str, stubs: ScriptedStubs, name: str):
    """The scripted six-trial sweep in three rungs on the stubs: (its result, its history,
    the history's replay on today's code)."""
    spec = spec_for(f"{name}-{uuid.uuid4().hex[:6]}", **{
        "sweep.enabled": True, "sweep.trials": 6, "sweep.parallel": 1, "sweep.trial_steps": 9,
        "sweep.space": {"lr": {"low": 1e-3, "high": 3e-2}},
        "sweep.pruning": {"rungs": 3, "reduction_factor": 3}})

    async def go():
        client = await Client.connect(address)
        async with Harness(client, stubs) as h:
            handle = await h.client.start_workflow(
                SWEEP_WORKFLOW_TYPE, SweepInput(spec.to_dict(), "file:///stub/data"),
                id=f"{spec.run_id}-sweep", task_queue=h.queue)
            result = await handle.result()
            history = await handle.fetch_history()
        replayed = await Replayer(workflows=[TrainingRun, Sweep]).replay_workflow(history)
        return spec, result, history, replayed

    return asyncio.run(asyncio.wait_for(go(), 60))


def test_losing_trials_stop_at_their_rung_and_the_winner_ran_whole(temporal_server):
    stubs = ScriptedStubs()
    _, result, history, replayed = run_sweep(temporal_server.address, stubs, "stub-pruned")

    # each trial trained its rungs in order, from one boundary to the next, and stopped
    segments: dict[int, list[tuple[int, int]]] = {}
    for s in stubs.trial_segments:
        segments.setdefault(int(s.spec["run_id"].rsplit("-", 1)[1]), []).append(
            (s.from_step, s.to_step))
    for trial in COMPLETED:
        assert segments[trial] == [(0, 1), (1, 3), (3, 9)], trial
    assert {t: segs[-1][1] for t, segs in segments.items() if t in PRUNED_AT} == PRUNED_AT
    assert segments[3] == [(0, 1), (1, 3)]  # passed step 1, stopped at step 3

    # the pruner was asked at every boundary reached but the last, and decided each
    asked = [(inp.index, out.step, out.prune) for inp, out in stubs.prunes]
    assert asked == [(0, 1, False), (0, 3, False), (1, 1, True), (2, 1, False),
                     (2, 3, False), (3, 1, False), (3, 3, True), (4, 1, True), (5, 1, True)]

    events = {int(e.event_id.split("/")[1]): e.payload
              for e in stubs.events if e.kind == "sweep_trial"}
    assert {i for i, p in events.items() if p["status"] == "pruned"} == set(PRUNED_AT)
    assert {i for i, p in events.items() if p["status"] == "complete"} == set(COMPLETED)
    assert events[3]["rungs"] == [[1, 4.8], [3, 4.7]] and events[3]["steps"] == 3
    assert events[3]["pruned_at"] == {"rung": 1, "step": 3, "competing": 3, "better": 2}
    assert events[2]["rungs"] == [[1, 4.9], [3, 4.5]] and events[2]["result"] == 4.8

    # pruned trials reach the sampler as PRUNED, with their rung losses
    last = stubs.suggested[-1].observed
    assert [o.pruned for o in last] == [False, True, False, True, True]
    assert last[1].rungs == [[1, 5.3]]

    # the winner is a trial that ran whole, not trial 3 with its lower loss at step 3
    assert result["trials"][3]["val_loss"] == 4.7 < result["trials"][2]["val_loss"] == 4.8
    assert result["best_params"] == {"lr": 1e-2}
    assert [t["status"] for t in result["trials"]] == [
        "complete", "pruned", "complete", "pruned", "pruned", "pruned"]
    assert replayed.replay_failure is None
    if RECORD:
        out = HISTORIES / RECORD
        out.mkdir(parents=True, exist_ok=True)
        (out / "pruned.sweep.json").write_text(history.to_json())


class SelfScoringStubs(ScriptedStubs):
    """Trial segments that score themselves, as the real one does with the trial's
    train.eval_every: an online evaluation at each multiple of it they train through —
    except trial 1's, which returns none (a retried segment that had already finished):
    the evaluate activity scores that one."""

    def __init__(self) -> None:
        super().__init__()
        self.evaluated: list[tuple[str, list[int]]] = []

    @activity.defn(name=TRAIN_SEGMENT)
    async def train_segment(self, inp: TrainSegmentInput) -> TrainSegmentResult:
        result = await ScriptedStubs.train_segment(self, inp)
        every, losses = inp.spec["train"]["eval_every"], LOSS[inp.spec["train"]["lr"]]
        if not inp.spec["run_id"].endswith("-trial-1"):
            result.evals = [[s, 0.0, losses[s]] for s in range(inp.from_step + 1, inp.to_step + 1)
                            if s % every == 0 and s in losses]
        return result

    @activity.defn(name=EVALUATE)
    async def evaluate(self, inp: EvaluateInput) -> EvaluateResult:
        self.evaluated.append((inp.spec["run_id"], inp.steps))
        return await ScriptedStubs.evaluate(self, inp)


def test_a_trial_is_scored_by_its_own_segments_evaluation_and_the_sweep_ends_the_same(
        temporal_server):
    stubs = SelfScoringStubs()
    spec, result, history, replayed = run_sweep(temporal_server.address, stubs, "stub-scored")
    # every boundary (steps 1, 3, 9) is a multiple of the trials' eval_every
    assert {s.spec["train"]["eval_every"] for s in stubs.trial_segments} == {1}
    # only the trial whose segment gave no score was evaluated by the activity (it was
    # pruned at its first boundary, step 1)
    assert stubs.evaluated == [(f"{spec.run_id}-trial-1", [1])]
    # the same sweep as the one scored by evaluations alone
    assert result["best_params"] == {"lr": 1e-2}
    assert [t["status"] for t in result["trials"]] == [
        "complete", "pruned", "complete", "pruned", "pruned", "pruned"]
    assert [t["val_loss"] for t in result["trials"]] == [4.9, 5.3, 4.8, 4.7, 5.5, 5.1]
    assert replayed.replay_failure is None
    if RECORD:
        out = HISTORIES / RECORD
        out.mkdir(parents=True, exist_ok=True)
        (out / "scored.sweep.json").write_text(history.to_json())
