"""The spike detector driven by literal loss sequences: each verdict checked by hand."""

import math

import torch

from spec import FaultSpec, SpikeConfig
from trainer.faults import FaultInjector
from trainer.guard import loss_scale_verdict
from trainer.spikes import (
    DetectorState,
    maskable,
    merge_ranges,
    observe,
    overfitting,
    reset_window,
    robust_stats,
    skip_range,
    times_in_region,
    uncovered,
    what_to_skip,
)

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
    level = [CLEAN[-1] + (0.02 if i % 2 else -0.02) for i in range(11)]  # healthy, flat
    for k in range(4):  # one outlier every 12 steps, window is 10
        state, _ = feed(level, state, start=30 + 12 * k)
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


def test_skip_range_is_counted_in_batches_with_gradient_accumulation():
    assert skip_range(100, CFG, batches_per_step=4) == (92, 124)


def test_a_second_spike_near_an_existing_skip_range_is_in_the_same_region():
    ranges = [(98, 106)]
    assert times_in_region([], 100, CFG) == 1
    assert times_in_region(ranges, 107, CFG) == 2
    assert times_in_region(ranges, 106 + CFG.skip_window + 1, CFG) == 1


def test_merge_ranges_joins_overlapping_and_touching_ranges_only():
    assert merge_ranges([(10, 20), (0, 5), (15, 30), (30, 31), (40, 41)]) == [
        (0, 5), (10, 31), (40, 41)]


def test_overfitting_needs_k_evaluations_of_rising_val_and_falling_train():
    rising = [[10, 3.0, 2.0], [20, 2.9, 2.1], [30, 2.8, 2.2], [40, 2.7, 2.3]]
    assert overfitting(rising, 3)
    assert not overfitting(rising[:3], 3)  # only two rises so far
    flat_train = [[10, 3.0, 2.0], [20, 3.0, 2.1], [30, 2.8, 2.2], [40, 2.7, 2.3]]
    assert not overfitting(flat_train, 3)
    both_fall = [[10, 3.0, 2.4], [20, 2.9, 2.3], [30, 2.8, 2.2], [40, 2.7, 2.1]]
    assert not overfitting(both_fall, 3)


def test_overflow_at_the_minimum_loss_scale_is_a_sustained_spike():
    assert loss_scale_verdict(7, 3.0, 1.0, 1.0, overflowed=True).action == "rollback"
    assert loss_scale_verdict(7, 3.0, 4.0, 1.0, overflowed=True) is None
    assert loss_scale_verdict(7, 3.0, 1.0, 1.0, overflowed=False) is None


def test_injected_corruption_is_there_on_every_replay_but_transients_fire_once():
    faults = [FaultSpec(kind="corrupt_batches", at_step=5, steps=2),
              FaultSpec(kind="lr_burst", at_step=3, steps=2, factor=10.0),
              FaultSpec(kind="nan_loss", at_step=4)]
    inj = FaultInjector(faults, batches_per_step=2, vocab_size=50, seed=1)
    assert inj.corrupt == [(8, 12)]
    clean = (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    assert inj.batch(7, 4, clean) is clean
    first = inj.batch(8, 5, clean)
    assert not torch.equal(first[0], clean[0])
    assert torch.equal(inj.batch(8, 5, clean)[0], first[0])  # the same bad data on replay
    # the burst is a one-shot LR window over steps 3 and 4 (trainer/schedule.py)
    assert inj.lr_windows() == [[2, 4, 10.0]]
    inj.starting(4)
    assert inj.poisoned  # the forward hook makes step 4's first loss NaN
    inj.poisoned = False
    inj.starting(4)  # replayed after a rollback: a transient fault stays quiet
    assert not inj.poisoned


def test_the_nan_hook_poisons_one_forward_pass_of_the_armed_step_only():
    model = torch.nn.Linear(2, 1)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = model

        def forward(self, x):
            out = self.lin(x)
            return out, out.sum()

    net = Net()
    inj = FaultInjector([FaultSpec(kind="nan_loss", at_step=2)], batches_per_step=1,
                        vocab_size=50, seed=1)
    inj.attach(net)
    source = type("Source", (), {"get": lambda self, c: (torch.zeros(1, 2),)})()
    batches = inj.batches(source)
    x = torch.ones(1, 2)
    batches.get(0, 1)
    assert torch.isfinite(net(x)[1])
    batches.get(1, 2)  # the first batch of step 2 arms the hook
    loss = net(x)[1]
    assert torch.isnan(loss)
    loss.backward()
    assert torch.isnan(model.weight.grad).all()  # its gradients are NaN too
    assert torch.isfinite(net(x)[1])  # one forward pass only


def test_a_loss_that_stays_elevated_after_an_outlier_is_a_sustained_spike():
    # An LR burst: one loss far out, then losses that stay well above the baseline
    # without crossing the skip threshold again.
    state, _ = feed(CLEAN)
    state, v = observe(state, 30, 9.0, CFG)
    baseline, spread = v.baseline, v.spread
    elevated = baseline + 0.5 * (CFG.return_threshold + CFG.skip_threshold) * spread
    actions = []
    for i in range(2):
        state, v = observe(state, 31 + i, elevated, CFG)
        actions.append((v.action, v.reason))
    assert actions == [("skip", "no_return_to_baseline"), ("rollback", "sustained_spike")]
    assert v.onset == 30 and v.evidence["last_reason"] == "no_return_to_baseline"


def test_returning_to_the_baseline_forgets_an_isolated_skip():
    state, _ = feed(CLEAN)
    state, v = observe(state, 30, float("nan"), CFG)
    assert v.action == "skip"
    level = [CLEAN[-1] + (0.02 if i % 2 else -0.02) for i in range(CFG.patience)]
    state, verdicts = feed(level, state, start=31)
    assert {x.action for x in verdicts} == {"ok"} and state.outliers == ()
    for i, loss in enumerate([9.0, 9.0]):  # a later, unrelated spike starts afresh
        state, v = observe(state, 40 + i, loss, CFG)
    assert v.action == "skip"


def test_repeated_non_finite_losses_are_a_sustained_spike():
    state, _ = feed(CLEAN)
    for i in range(CFG.patience):
        state, v = observe(state, 30 + i, float("nan"), CFG)
    assert v.action == "rollback" and v.onset == 30


def test_what_a_rollback_skips_follows_its_diagnosis():
    assert what_to_skip("data", (7, 9), maskable=True, repeat=False) == "documents"
    assert what_to_skip("data", (7, 9), maskable=False, repeat=False) == "window"  # too long
    assert what_to_skip("data", (), maskable=False, repeat=False) == "window"  # bad batches
    assert what_to_skip("optimisation", (), maskable=False, repeat=False) == "nothing"
    # the arithmetic was bad, not the data
    assert what_to_skip("numerics", (), maskable=False, repeat=False) == "nothing"
    for verdict in ("unclear", None):  # None: no diagnosis was possible
        assert what_to_skip(verdict, (), maskable=False, repeat=False) == "window"


def test_documents_are_masked_while_each_micro_batch_keeps_a_sequence_of_other_tokens():
    assert maskable(448, 512, 64) and maskable(1, 512, 64)
    assert not maskable(449, 512, 64)  # a micro-batch could be left with no target
    assert not maskable(0, 512, 64)  # nothing to mask


def test_a_spike_back_in_the_region_of_a_rollback_that_skipped_no_window_skips_it():
    assert what_to_skip("optimisation", (), maskable=False, repeat=True) == "window"
    assert what_to_skip("data", (7,), maskable=True, repeat=True) == "window"


def test_uncovered_counts_the_cursors_of_a_window_no_range_skips_yet():
    assert uncovered((10, 20), []) == 10
    assert uncovered((10, 20), [(5, 12), (11, 14), (18, 30)]) == 4  # 14..17
    assert uncovered((10, 20), [(0, 40)]) == 0
