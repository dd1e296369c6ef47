"""`pruning_saving` (sweep/saving.py): the share of a sweep's trial steps pruning saved, and the
figure against an unpruned sweep, from `sweep_trial` records as workflows/sweep.py writes them."""

import math

from sweep.saving import pruning_figure, pruning_saving, trained_steps, winner_loss


def rec(steps: int, loss: float, status: str = "complete") -> dict:
    return {"steps": steps, "result": loss, "status": status}


# six trials of 9 steps: two ran whole, four stopped at step 1 or 3 (24 of 54 steps trained)
PRUNED = [rec(9, 4.4), rec(1, 5.3, "pruned"), rec(9, 4.2), rec(3, 4.7, "pruned"),
          rec(1, 5.5, "pruned"), rec(1, 5.1, "pruned")]
UNPRUNED = [rec(9, 4.4), rec(9, 5.0), rec(9, 4.2), rec(9, 4.21), rec(9, 5.2), rec(9, 4.9)]


def test_the_saving_is_the_share_of_planned_trial_steps_not_trained():
    assert trained_steps(PRUNED, 9) == 24
    assert pruning_saving(PRUNED, 9) == 1 - 24 / 54
    assert pruning_saving(UNPRUNED, 9) == 0.0
    assert pruning_saving([], 9) == 0.0
    # a record from before steps were recorded trained the whole trial
    assert pruning_saving([{"result": 4.0}, rec(3, 4.5, "pruned")], 9) == 1 - 12 / 18


def test_a_pruned_trials_loss_never_wins_and_a_diverged_one_neither():
    assert winner_loss([rec(1, 3.0, "pruned"), rec(9, 4.2), rec(9, math.nan, "diverged")]) == 4.2
    assert winner_loss([rec(1, 3.0, "pruned")]) is None


def test_the_figure_meets_its_target_with_a_third_saved_and_the_winner_within_a_percent():
    fig = pruning_figure(PRUNED, UNPRUNED, 9)
    assert (fig.trained_steps, fig.planned_steps, fig.trials_pruned) == (24, 54, 4)
    assert fig.loss_gap == 0.0 and fig.meets_target
    worse = pruning_figure(PRUNED, [*UNPRUNED, rec(9, 4.1)], 9)
    assert worse.loss_gap > 0.01 and not worse.meets_target  # 4.2 is 2.4 % above 4.1
    little = pruning_figure([rec(9, 4.2), rec(9, 4.3), rec(6, 4.5, "pruned")], UNPRUNED, 9)
    assert abs(little.saving - 1 / 9) < 1e-12 and not little.meets_target
