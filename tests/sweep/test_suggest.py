"""The sweep's suggester (sweep/suggest.py): optuna studies rebuilt from the workflow's records."""

import math

from optuna.trial import TrialState

from activities.contracts import SOURCE_PRIOR, SuggestInput, SweepObservation
from activities.suggest import suggest_trials
from spec import preset
from sweep.prior import prior_lr
from sweep.suggest import Dim, Record, distributions_json, rebuild, suggest

SPACE = [Dim("lr", 1e-4, 1e-1, log=True), Dim("warmup_steps", 0.0, 10.0, integer=True),
         Dim("weight_decay", 0.0, 0.3)]
DISTS = distributions_json(SPACE)


def bowl(p: dict) -> float:
    """Lowest (0) at lr = 10^-2.3, weight_decay 0.15."""
    return (math.log10(p["lr"]) + 2.3) ** 2 + 10.0 * (p["weight_decay"] - 0.15) ** 2


def records_of(points: list[dict], losses: list[float | None]) -> list[Record]:
    return [Record(p, DISTS, v) for p, v in zip(points, losses)]


def sweep(seed: int, trials: int, kind: str = "tpe") -> list[Record]:
    """A sequential sweep of the bowl, one point a round, a dead trial at index 2."""
    records: list[Record] = []
    for i in range(trials):
        [p] = suggest(SPACE, records, 1, seed=seed, kind=kind, prior={"lr": 3e-3})
        records.append(Record(p, DISTS, None if i == 2 else bowl(p)))
    return records


def test_the_same_records_and_seed_suggest_the_same_points_a_replay_or_retry_would():
    records = sweep(seed=7, trials=6)
    again = sweep(seed=7, trials=6)
    assert [r.params for r in records] == [r.params for r in again]
    nxt = suggest(SPACE, records, 2, seed=7)
    assert nxt == suggest(SPACE, records, 2, seed=7)  # a retry of the same call
    assert nxt != suggest(SPACE, records, 2, seed=8)  # the seed matters


def test_a_dead_trial_is_rebuilt_as_fail_never_running_and_a_diverged_one_as_the_worst():
    points = [{"lr": 1e-3, "warmup_steps": 2.0, "weight_decay": 0.1},
              {"lr": 1e-2, "warmup_steps": 5.0, "weight_decay": 0.2},
              {"lr": 1e-1, "warmup_steps": 1.0, "weight_decay": 0.0},
              {"lr": 3e-2, "warmup_steps": 1.0, "weight_decay": 0.0}]
    records = records_of(points, [2.5, 3.0, None, math.inf])
    records[1] = Record(points[1], DISTS, None, dead=True)
    study = rebuild(records, "tpe", seed=1, startup=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.FAIL,
                                               TrialState.COMPLETE, TrialState.COMPLETE]
    # diverged: the worst finite loss of a live trial (2.5; the dead one's 3.0 is no result)
    assert [t.value for t in study.trials] == [2.5, None, 2.5, 2.5]
    assert study.trials[0].params["warmup_steps"] == 2
    only_diverged = rebuild(records_of(points[:1], [None]), "tpe", seed=1, startup=2)
    assert only_diverged.trials[0].state == TrialState.FAIL  # no finite loss to stand for it


def test_the_prior_point_is_trial_zero_and_only_when_nothing_is_recorded():
    first = suggest(SPACE, [], 3, seed=1, prior={"lr": 3e-3})
    assert first[0]["lr"] == 3e-3 and all(p["lr"] != 3e-3 for p in first[1:])
    later = suggest(SPACE, records_of(first, [1.0, 2.0, 3.0]), 2, seed=1, prior={"lr": 3e-3})
    assert all(p["lr"] != 3e-3 for p in later)


def test_a_prior_outside_the_range_is_clipped_to_its_edge():
    assert suggest(SPACE, [], 1, seed=1, prior={"lr": 5.0})[0]["lr"] == 1e-1


def test_every_point_stays_in_bounds_and_warmup_in_whole_steps():
    for kind in ("tpe", "gp"):
        for r in sweep(seed=3, trials=5, kind=kind):
            p = r.params
            assert 1e-4 <= p["lr"] <= 1e-1 and 0.0 <= p["weight_decay"] <= 0.3, (kind, p)
            assert p["warmup_steps"] == int(p["warmup_steps"]) and 0 <= p["warmup_steps"] <= 10


def test_tpe_after_its_startup_points_beats_them_on_a_bowl():
    records = sweep(seed=11, trials=14)
    startup = min(r.val_loss for r in records[:4] if r.val_loss is not None)
    assert min(r.val_loss for r in records[4:] if r.val_loss is not None) < startup


def test_the_activity_puts_the_step_law_prior_first_and_records_the_distributions():
    spec = preset("demo").replace(**{"sweep.trials": 3})
    d = spec.to_dict()
    out = suggest_trials(SuggestInput(d["sweep"], [], 3, spec.seed, d))
    assert out.points[0]["lr"] == prior_lr(spec)  # inside the demo's lr range
    assert out.sources == [SOURCE_PRIOR, "tpe", "tpe"] and set(out.distributions) == {"lr"}


def test_an_older_historys_input_without_spec_or_distributions_still_suggests():
    spec = preset("demo")
    sweep_dict = {k: v for k, v in spec.to_dict()["sweep"].items() if k != "sampler"}
    out = suggest_trials(SuggestInput(sweep_dict, [SweepObservation({"lr": 3e-3}, 4.0),
                                                   SweepObservation({"lr": 1e-2}, None)], 1, 0))
    assert out.sources == ["tpe"] and 1e-3 <= out.points[0]["lr"] <= 1e-2
