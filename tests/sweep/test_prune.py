"""The sweep's pruner (sweep/prune.py, the `prune_trial` activity): optuna's
SuccessiveHalvingPruner asked about one trial at a rung boundary, from a study rebuilt from
the Sweep workflow's records; and a pruned trial told to the sampler as PRUNED."""

import math

import pytest
from optuna.trial import TrialState

from activities.contracts import (
    TRIAL_COMPLETE,
    TRIAL_PRUNED,
    TRIAL_RUNNING,
    PruneInput,
    RungRecord,
    SuggestInput,
    SweepObservation,
)
from activities.prune import prune_trial
from activities.suggest import suggest_trials
from spec import preset
from spec.sweep import PruningConfig
from sweep.prune import Trial, decide
from sweep.suggest import Dim, Record, distributions_json, rebuild

# trial_steps 9 in 3 rungs at reduction factor 3: boundaries at steps 1 and 3, then 9
PRUNING = {"rungs": 3, "reduction_factor": 3}
CFG = PruningConfig(**PRUNING)


def ask(trials: list[RungRecord], index: int):
    return prune_trial(PruneInput(PRUNING, 9, trials, index))


# Five trials finished or stopped, their losses at step 1 (rung 0) and step 3 (rung 1).
HISTORY = [RungRecord(TRIAL_COMPLETE, [[1, 5.0], [3, 4.6]], 4.4),
           RungRecord(TRIAL_PRUNED, [[1, 5.3]]),
           RungRecord(TRIAL_COMPLETE, [[1, 4.9], [3, 4.5]], 4.2),
           RungRecord(TRIAL_PRUNED, [[1, 4.8], [3, 4.7]]),
           RungRecord(TRIAL_PRUNED, [[1, 5.5]])]


def test_a_clearly_losing_trial_is_pruned_at_its_rung():
    out = ask([*HISTORY, RungRecord(TRIAL_RUNNING, [[1, 5.4]])], 5)
    assert out.prune is True and (out.rung, out.step, out.val_loss) == (0, 1, 5.4)
    # six losses at step 1: only the best 6 // 3 = 2 go on; 4 of them are lower
    assert (out.competing, out.better) == (6, 4)


def test_a_leader_is_not_pruned_and_the_next_rung_judges_it_again():
    leader = ask([*HISTORY, RungRecord(TRIAL_RUNNING, [[1, 4.7]])], 5)
    assert leader.prune is False and (leader.competing, leader.better) == (6, 0)
    # at step 3 it meets the three trials that got there (4.6, 4.5, 4.7): best of four goes on
    behind = ask([*HISTORY, RungRecord(TRIAL_RUNNING, [[1, 4.7], [3, 4.55]])], 5)
    assert behind.prune is True and (behind.rung, behind.step, behind.better) == (1, 3, 1)
    ahead = ask([*HISTORY, RungRecord(TRIAL_RUNNING, [[1, 4.7], [3, 4.4]])], 5)
    assert ahead.prune is False and ahead.competing == 4


def test_the_first_trial_at_a_rung_goes_on_and_a_second_one_only_if_better():
    first = ask([RungRecord(TRIAL_RUNNING, [[1, 9.0]])], 0)
    assert first.prune is False and first.competing == 1
    running = [RungRecord(TRIAL_RUNNING, [[1, 5.0]]), RungRecord(TRIAL_RUNNING, [[1, 5.1]])]
    assert ask(running, 1).prune is True  # a trial still running counts with its rung loss
    assert ask(running, 0).prune is False


def test_the_same_records_give_the_same_decision():
    trials = [*HISTORY, RungRecord(TRIAL_RUNNING, [[1, 4.95]])]
    decisions = {ask(trials, 5).prune for _ in range(3)}
    plain = [Trial(t.status, [tuple(r) for r in t.rungs], t.val_loss) for t in trials]
    decisions.add(decide(CFG, 9, plain, 5).prune)
    assert decisions == {True}  # 4.95 is third of six at step 1: outside the best two


def test_a_trial_whose_rung_loss_is_nan_is_pruned_and_counts_for_no_one():
    nan = ask([RungRecord(TRIAL_COMPLETE, [[1, 5.0], [3, 4.6]], 4.4),
               RungRecord(TRIAL_RUNNING, [[1, math.nan]])], 1)
    assert nan.prune is True
    after = ask([RungRecord(TRIAL_COMPLETE, [[1, 5.0], [3, 4.6]], 4.4),
                 RungRecord(TRIAL_PRUNED, [[1, math.nan]]),
                 RungRecord(TRIAL_RUNNING, [[1, 4.9]])], 2)
    assert after.prune is False and after.competing == 2  # the NaN is not a competitor


def test_a_loss_measured_off_a_rung_boundary_is_refused():
    with pytest.raises(ValueError, match=r"not a rung boundary \[1, 3\]"):
        decide(CFG, 9, [Trial(TRIAL_RUNNING, [(2, 5.0)])], 0)


DIMS = [Dim("lr", 1e-3, 3e-2, log=True)]
DISTS = distributions_json(DIMS)


def test_a_pruned_trial_is_told_to_the_sampler_as_pruned_with_its_rung_losses():
    records = [Record({"lr": 1e-2}, DISTS, 4.2),
               Record({"lr": 2e-2}, DISTS, 5.3, pruned=True, rungs=[(1, 5.3)]),
               Record({"lr": 5e-3}, DISTS, math.inf)]
    study = rebuild(records, "tpe", seed=0, startup=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.PRUNED,
                                               TrialState.COMPLETE]
    assert study.trials[1].intermediate_values == {1: 5.3} and study.trials[1].value is None
    # a diverged trial stands at the worst loss of a trial that finished, not a pruned one's
    assert study.trials[2].value == 4.2


def test_the_suggest_activity_takes_pruned_observations_from_a_pruned_specs_records():
    spec = preset("demo", **{"sweep.trials": 4, "sweep.trial_steps": 9,
                             "sweep.pruning": PRUNING})
    d = spec.to_dict()
    observed = [SweepObservation({"lr": 5e-3}, 4.4),
                SweepObservation({"lr": 2e-3}, 5.3, pruned=True, rungs=[[1, 5.3]])]
    out = suggest_trials(SuggestInput(d["sweep"], observed, 1, spec.seed, d))
    assert len(out.points) == 1 and 1e-3 <= out.points[0]["lr"] <= 1e-2
