"""The spike detector driven by literal loss sequences (issue 6, acceptance 1)."""

import math

from ops.spec import SpikeConfig
from trainer.spikes import DetectorState, observe, reset_window, robust_stats, skip_range

CFG = SpikeConfig(window=10, warmup=5, skip_threshold=6.0, patience=3, skip_before=2,
                  skip_window=8)
# A gently noisy, slowly falling loss: what a healthy run looks like.
CLEAN = [3.0 - 0.01 * i + (0.02 if i % 2 else -0.02) for i in range(30)]


def feed(losses, state=None, start=0):
    state = state or DetectorState()
    verdicts = []
    for i, loss in enumerate(losses):
        state, v = observe(state, start + i, loss, CFG)
        verdicts.append(v)
    return state, verdicts


def test_warm_up_judges_nothing_even_a_huge_loss():
    _, verdicts = feed([3.0, 3.1, 50.0, 3.0, 2.9])
    assert [v.action for v in verdicts] == ["ok"] * 5
    assert all(v.reason == "warming_up" for v in verdicts)


def test_clean_run_has_no_false_positives():
    _, verdicts = feed(CLEAN)
    assert {v.action for v in verdicts} == {"ok"}


def test_single_outlier_is_skipped_with_its_evidence():
    state, _ = feed(CLEAN)
    state, v = observe(state, 30, 9.0, CFG)
    assert v.action == "skip" and v.reason == "outlier"
    assert v.baseline is not None and v.loss > v.threshold > v.baseline
    assert math.isclose(v.threshold, v.baseline + CFG.skip_threshold * v.spread)
    # The outlier did not enter the baseline: the next normal loss is fine.
    state, v2 = observe(state, 31, 2.7, CFG)
    assert v2.action == "ok" and 9.0 not in state.history


def test_sustained_spike_rolls_back_to_its_onset():
    state, _ = feed(CLEAN)
    actions = []
    for i, loss in enumerate([8.0, 8.5, 9.0]):
        state, v = observe(state, 30 + i, loss, CFG)
        actions.append(v.action)
    assert actions == ["skip", "skip", "rollback"]
    assert v.onset == 30 and v.reason == "sustained_spike"
    assert v.evidence["outlier_steps"] == [30, 31, 32]


def test_outliers_far_apart_never_add_up_to_a_rollback():
    state, _ = feed(CLEAN)
    actions = []
    for k in range(4):  # one outlier every 12 steps, window is 10
        state, _ = feed(CLEAN[:11], state, start=30 + 12 * k)
        state, v = observe(state, 41 + 12 * k, 9.0, CFG)
        actions.append(v.action)
    assert actions == ["skip"] * 4


def test_slow_drift_upwards_is_ok():
    state, _ = feed(CLEAN)
    drift = [2.7 + 0.01 * i for i in range(40)]  # +0.4 over 40 steps: not a spike
    _, verdicts = feed(drift, state, start=30)
    assert {v.action for v in verdicts} == {"ok"}


def test_non_finite_loss_is_skipped_even_during_warm_up():
    _, verdicts = feed([3.0, float("nan"), float("inf")])
    assert [v.action for v in verdicts] == ["ok", "skip", "skip"]
    assert verdicts[1].reason == "non_finite_loss"


def test_reset_after_rollback_forgets_outliers_but_keeps_the_baseline():
    state, _ = feed(CLEAN)
    for i, loss in enumerate([8.0, 8.5, 9.0]):
        state, _ = observe(state, 30 + i, loss, CFG)
    reset = reset_window(state)
    assert reset.outliers == () and reset.history == state.history
    reset, v = observe(reset, 33, 9.5, CFG)
    assert v.action == "skip"  # one outlier again, not an immediate second rollback


def test_state_round_trips_through_a_checkpoint_dict():
    state, _ = feed(CLEAN[:12] + [9.0])
    assert DetectorState.from_dict(state.to_dict()) == state


def test_flat_history_cannot_make_every_wiggle_an_outlier():
    mid, spread = robust_stats((2.0, 2.0, 2.0, 2.0), CFG.min_spread)
    assert mid == 2.0 and spread == CFG.min_spread * 2.0
    state, _ = feed([2.0] * 12)
    _, v = observe(state, 12, 2.05, CFG)
    assert v.action == "ok"


def test_skip_range_starts_before_onset_and_widens_on_repeat():
    assert skip_range(100, CFG) == (98, 106)
    assert skip_range(100, CFG, times_in_region=2) == (98, 114)
    assert skip_range(1, CFG) == (0, 8)
