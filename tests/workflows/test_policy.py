
from spec import SpikeBudget, SpikeConfig, preset
from sweep.suggest import Dim, sweep_space
from workflows.escalation import rollback_allowance
from workflows.steps import segment_bounds
from workflows.sweep_plan import sweep_rounds, trial_spec, with_params


def test_sweep_space_is_name_ordered_and_steps_warmup_in_whole_steps():
    spec = preset("demo").replace(**{"sweep.space": {
        "warmup_steps": {"low": 2, "high": 10, "log": False},
        "lr": {"low": 1e-3, "high": 1e-2, "log": True}}})
    assert sweep_space(spec.sweep) == [Dim("lr", 1e-3, 1e-2, log=True),
                                       Dim("warmup_steps", 2.0, 10.0, log=False, integer=True)]


def test_sweep_rounds_start_with_the_startup_points_then_parallel_rounds():
    def rounds(trials: int, parallel: int, dims: int) -> list[int]:
        space = dict(list({"lr": {"low": 1e-3, "high": 1e-2, "log": True},
                           "weight_decay": {"low": 0.0, "high": 0.2, "log": False},
                           "warmup_steps": {"low": 0, "high": 9, "log": False}}.items())[:dims])
        return sweep_rounds(preset("demo").replace(**{
            "sweep.trials": trials, "sweep.parallel": parallel, "sweep.space": space}).sweep)

    assert rounds(2, 1, 1) == [2]  # the demo: both ends of the lr range, nothing else
    assert rounds(5, 1, 1) == [2, 1, 1, 1]
    assert rounds(7, 2, 2) == [3, 2, 2]  # initial design: dims + 1 points
    assert rounds(8, 2, 3) == [4, 2, 2]
    assert rounds(6, 4, 1) == [4, 2]  # one full parallel round first
    assert rounds(3, 1, 3) == [3]  # never more trials than asked for


def test_trial_spec_is_a_short_faultless_run_of_its_own():
    spec = preset("demo")
    t = trial_spec(spec, 1, {"lr": 5e-3})
    assert t.run_id != spec.run_id and t.run_id.endswith("-trial-1")
    assert t.train.total_steps == spec.sweep.trial_steps and t.faults == ()
    assert t.train.lr == 5e-3 and t.train.warmup_steps < t.train.total_steps


def test_segments_cover_the_run_without_gaps():
    spec = preset("demo").replace(**{"train.total_steps": 170, "train.segment_steps": 80})
    bounds, step = [], 0
    while step < spec.train.total_steps:
        lo, hi = segment_bounds(step, spec)
        bounds.append((lo, hi))
        step = hi
    assert bounds == [(0, 80), (80, 160), (160, 170)]


def test_with_params_sets_the_swept_values():
    assert with_params(preset("demo"), {"lr": 2e-3}).train.lr == 2e-3


def test_escalation_continues_then_lowers_lr_then_pauses():
    from spec import SpikeBudget, SpikeConfig
    from workflows.escalation import escalate

    cfg = SpikeConfig(budget=SpikeBudget(rollbacks=2, per_steps=100))
    assert escalate((10, 20), 50, (), cfg)[0] == "continue"
    assert escalate((10, 20, 30), 50, (), cfg)[0] == "lower_lr"
    action, reason = escalate((10, 20, 30, 40), 60, (35,), cfg)
    assert action == "pause" and "after lowering the LR at step 35" in reason
    # Old rollbacks and an old LR change fall out of the window: back to normal.
    assert escalate((10, 20, 30), 250, (35,), cfg)[0] == "continue"
    assert escalate((210, 220, 230), 250, (35,), cfg)[0] == "lower_lr"


def test_rollback_allowance_is_what_is_left_of_the_budget_in_its_window():
    cfg = SpikeConfig(budget=SpikeBudget(rollbacks=2, per_steps=100))
    assert rollback_allowance([], 0, 50, cfg) == 2
    assert rollback_allowance([40], 0, 50, cfg) == 1
    assert rollback_allowance([40, 45, 48], 0, 50, cfg) == 0  # never negative
    assert rollback_allowance([40, 45], 0, 150, cfg) == 2  # both left the window
    assert rollback_allowance([40, 45], 46, 50, cfg) == 2  # forgiven by a resume at 46
    assert rollback_allowance([40], 0, 50, SpikeConfig(enabled=False)) == -1


def test_the_carry_keeps_only_rollbacks_the_budget_can_still_count():
    from workflows.escalation import escalate, still_counted

    cfg = SpikeConfig(budget=SpikeBudget(rollbacks=2, per_steps=100))
    steps = [10, 150, 260, 290, 305, 340]
    assert still_counted(steps, 0, 400, cfg) == [305, 340]  # the run never goes below 400
    assert still_counted(steps, 300, 250, cfg) == [305, 340]  # forgiven by a resume at 300
    assert still_counted(steps, 0, 250, cfg) == [260, 290, 305, 340]
    # the same answers at every step the run can still be at (>= the floor)
    for floor, budget_from in ((250, 0), (320, 0), (320, 300), (400, 150)):
        kept = still_counted(steps, budget_from, floor, cfg)
        for step in range(floor, 700, 7):
            assert rollback_allowance(kept, budget_from, step, cfg) == \
                rollback_allowance(steps, budget_from, step, cfg)
            counted = tuple(s for s in steps if s >= budget_from)
            assert escalate(tuple(kept), step, (), cfg) == escalate(counted, step, (), cfg)


def test_the_carry_forgets_windows_and_rollbacks_before_the_oldest_checkpoint():
    from workflows.carry import RunCarry
    from workflows.carry_updates import bounded

    cfg = SpikeConfig(budget=SpikeBudget(rollbacks=2, per_steps=100))
    carry = RunCarry.from_json(dict(
        next_step=500, oldest_step=300, rollback_steps=[50, 150, 250], lowered_at=[150, 250],
        rollbacks_total=3, lr_windows=[[100, 200, 0.5], [250, 400, 0.5], [300, 600, 0.5]]))
    # no step up to 300 runs again; rollbacks before 300 - 100 never count again
    assert bounded(carry, cfg) == ([250], [250], [[300, 400, 0.25], [400, 600, 0.5]])
    # a rollback that went further back than the oldest checkpoint keeps what it may need
    carry.next_step = 120
    assert bounded(carry, cfg)[0] == [50, 150, 250]
    assert bounded(carry, cfg)[2][0] == [100, 200, 0.5]
