"""benchmarks/sweep.py's pruned sweep, replayed on literal loss curves: the real pruner judges
each trial at its rung boundary from the trials before it, and the figure counts the steps
the pruned ones did not train."""

from __future__ import annotations

from benchmarks.sweep import gain_figure, main_spec, prune_in_order
from sweep.saving import pruning_figure

# 54-step trials in 2 rungs at reduction factor 3: one boundary, at step 18
CURVES = [{18: 6.9, 54: 6.60}, {18: 7.2, 54: 6.70}, {18: 6.8, 54: 6.59},
          {18: 6.85, 54: 6.58}, {18: 7.4, 54: 6.75}]


def test_trials_behind_at_the_boundary_stop_there_and_the_saving_counts_their_steps():
    spec = main_spec(len(CURVES), 54, rungs=2, eta=3)
    trials = prune_in_order(spec, CURVES)
    # trial 1 trails trial 0 at step 18; trial 2 leads; trials 3 and 4 do not lead
    assert [t.status for t in trials] == ["complete", "pruned", "complete", "pruned", "pruned"]
    assert [t.rungs for t in trials][1] == ((18, 7.2),)
    pruned = [{"steps": 18 if t.status == "pruned" else 54, "status": t.status,
               "result": t.val_loss if t.val_loss is not None else t.rungs[-1][1]}
              for t in trials]
    unpruned = [{"steps": 54, "status": "complete", "result": c[54]} for c in CURVES]
    fig = pruning_figure(pruned, unpruned, 54)
    assert fig.saving == 1 - (3 * 18 + 2 * 54) / (5 * 54)
    # trial 3 (6.58) would have won: pruning cost 0.15 % of held-out loss here
    assert (fig.winner_loss, fig.reference_loss) == (6.59, 6.58)


def test_the_sweep_gain_is_the_winners_final_loss_over_the_priors_and_its_cost_in_main_steps():
    runs = {"winner": {"evals": {100: 4.0, 2000: 3.0}}, "prior": {"evals": {2000: 3.2}}}
    out = gain_figure(runs, 2000, trained_steps=360)
    assert out["sweep_gain"] == round(3.0 / 3.2, 4) and out["sweep_cost_fraction"] == 0.18
    diverged = {"winner": {"evals": {2000: float("nan")}}, "prior": {"evals": {2000: 3.2}}}
    assert gain_figure(diverged, 2000, 360)["sweep_gain"] is None
    assert gain_figure({"winner": {"evals": {}}, "prior": {"evals": {}}}, 2000, 0)[
        "sweep_gain"] is None
