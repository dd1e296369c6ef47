"""Hang detection from the measured step time: the pure timeout math and the
watch (activities/hang.py) fed literal progress lines and clock readings, then the real
supervisor with real child processes that go quiet."""

from __future__ import annotations

import json
import sys
import time

import pytest

from activities.hang import (
    HangLimits,
    HangWatch,
    checkpoint_io_s,
    hang_deadline,
    p99,
    startup_deadline,
)
from activities.supervise import child_env, supervise
from common.errors import HardwareFault
from common.faults import Fault
from common.protocol import CommitLine, EvalLine, StartLine, StepLine
from spec import preset

AUTO = HangLimits(floor_s=60.0, factor=10.0, startup_floor_s=600.0, mb_per_s=50.0,
                  checkpoint_every=10, to_step=40)


def step(n: int, dt: float = 0.5, verdict: str = "ok") -> StepLine:
    return StepLine(step=n, loss=2.0, lr=1e-3, verdict=verdict, step_time_s=dt)


def fed(limits: HangLimits, lines, every_s: float = 1.0) -> HangWatch:
    """A watch started at t=0 that saw `lines` one per `every_s` from t=every_s on."""
    watch = HangWatch(limits, started=0.0)
    for i, line in enumerate(lines, 1):
        watch.seen(line, i * every_s)
    return watch


# ---- the pure math ---------------------------------------------------------------------------
def test_p99_is_the_nearest_rank_percentile_and_the_max_of_fewer_than_100_values():
    assert p99([]) is None
    assert p99([0.3]) == 0.3
    assert p99([0.1, 0.9, 0.2]) == 0.9
    assert p99([float(i) for i in range(1, 101)]) == 99.0  # one slow step in 100 is not it
    assert p99([float(i) for i in range(1, 201)]) == 198.0


def test_the_auto_hang_timeout_is_the_floor_until_k_times_the_p99_step_passes_it():
    assert hang_deadline([], floor_s=60.0, k=10.0) == 60.0
    assert hang_deadline([0.5] * 50, floor_s=60.0, k=10.0) == 60.0
    assert hang_deadline([0.5] * 98 + [9.0], floor_s=60.0, k=10.0) == 90.0  # 99: the max
    assert hang_deadline([0.5] * 99 + [9.0], floor_s=60.0, k=10.0) == 60.0  # 1 in 100: not
    assert hang_deadline([8.0] * 300 + [100.0] * 2, floor_s=60.0, k=10.0) == 80.0  # p99


def test_the_auto_startup_timeout_is_the_floor_plus_twice_the_checkpoint_at_the_rate():
    assert checkpoint_io_s(0, 50.0) == 0.0
    assert checkpoint_io_s(10**9, 50.0) == pytest.approx(40.0)  # a read and one upload
    assert startup_deadline(10**9, floor_s=600.0, mb_per_s=50.0) == pytest.approx(640.0)
    assert startup_deadline(0, floor_s=600.0, mb_per_s=50.0) == 600.0


# ---- the watch: which timeout applies, from when --------------------------------------------------
def test_before_the_first_step_only_the_startup_timeout_applies_counted_from_the_start():
    limits = HangLimits(**{**AUTO.__dict__, "checkpoint_bytes": 10**9})
    watch = fed(limits, [StartLine(resumed_from=20, world_size=2, to_step=40, attempt=2)])
    now = watch.current()
    assert (now.name, now.limit_s, now.since, now.phase) == ("startup_timeout_s", 640.0, 0.0,
                                                             "startup")
    assert watch.overdue(640.0) is None
    timeout, waited = watch.overdue(641.5)  # the start line at t=1 did not restart the clock
    assert waited == 641.5 and "startup_floor_s 600s" in timeout.how


def test_once_steps_run_the_silence_counts_from_the_last_step_loop_line_not_a_commit():
    # the commit line of step 0 comes from the checkpointer's thread at t=4: an upload
    # landing while the loop hangs is no sign of life, so the clock still runs from step 2
    watch = fed(AUTO, [StartLine(resumed_from=None, world_size=2, to_step=40, attempt=1),
                       step(1), step(2), CommitLine(step=0, uri="u", bytes=1000)])
    now = watch.current()
    assert (now.name, now.limit_s, now.since, now.phase) == ("hang_timeout_s", 60.0, 3.0, "step")
    assert watch.overdue(63.0) is None
    timeout, waited = watch.overdue(63.5)
    assert waited == 60.5 and timeout.p99_step_s == 0.5 and timeout.steps_measured == 1
    watch.seen(EvalLine(step=2, val_loss=2.0), 70.0)  # the loop's own lines do restart it
    assert watch.current().since == 70.0


def test_in_the_segment_end_drain_each_commit_line_is_progress():
    # after the last step the loop waits for its uploads: each landing commit restarts the clock
    watch = fed(AUTO, [step(39), step(40)])
    watch.seen(CommitLine(step=30, uri="u", bytes=1000), 30.0)
    assert watch.current().since == 30.0
    stopping = fed(AUTO, [step(11)])
    stopping.stopping = True  # asked to stop: it commits at the end of its step and drains
    stopping.seen(CommitLine(step=10, uri="u", bytes=1000), 9.0)
    assert stopping.current().since == 9.0


def test_slow_steps_raise_the_hang_timeout_to_k_times_their_p99():
    watch = fed(AUTO, [step(n, dt=7.5) for n in range(1, 6)], every_s=8.0)
    assert watch.current().limit_s == 75.0
    assert "10 x p99 step 7.500s of 4" in watch.current().how


def test_a_restart_in_place_keeps_the_step_times_and_its_slow_first_step_does_not_count():
    limits = HangLimits(**{**AUTO.__dict__, "floor_s": 1.0})
    first = fed(limits, [step(n, dt=0.5) for n in range(1, 21)])
    assert first.current().limit_s == 5.0
    again = HangWatch(limits, started=30.0, times=first.times)  # the next launch
    again.seen(step(21, dt=4.0), 31.0)  # its warm-up step: allocations, first collective
    assert again.current().limit_s == 5.0  # not 10 x 4 s: the window it carried decides
    again.seen(step(22, dt=0.6), 32.0)
    assert again.current().limit_s == 6.0 and again.current().steps_measured == 20


def test_a_launch_with_nothing_measured_yet_counts_its_first_step():
    watch = fed(HangLimits(**{**AUTO.__dict__, "floor_s": 1.0}), [step(1, dt=4.0)])
    assert watch.current().limit_s == 40.0  # the floor alone would call a 2nd slow step hung


def test_a_launch_s_slow_first_step_stops_counting_once_its_second_step_is_measured():
    limits = HangLimits(**{**AUTO.__dict__, "floor_s": 1.0})
    watch = fed(limits, [step(1, dt=4.0), step(2, dt=0.5)])
    assert (watch.current().limit_s, watch.current().steps_measured) == (5.0, 1)
    watch.seen(step(3, dt=0.6), 10.0)
    assert (watch.current().limit_s, watch.current().steps_measured) == (6.0, 2)


def test_a_checkpoint_step_a_rollback_and_a_stop_get_the_checkpoint_io_time_on_top():
    limits = HangLimits(**{**AUTO.__dict__, "checkpoint_bytes": 500 * 10**6})  # 20 s of I/O
    assert fed(limits, [step(9)]).current().limit_s == 60.0
    saving = fed(limits, [step(10)]).current()
    assert (saving.limit_s, saving.phase) == (80.0, "checkpoint")
    assert fed(limits, [step(40)]).current().limit_s == 80.0  # the segment's end commits
    rolling = fed(limits, [step(13, verdict="rollback")]).current()
    assert (rolling.limit_s, rolling.phase) == (80.0, "rollback")
    stopping = fed(limits, [step(13)])
    stopping.stopping = True
    assert stopping.current().limit_s == 80.0


def test_with_auto_checkpoints_the_checkpoint_steps_are_the_ones_the_trainer_says_it_runs():
    spec = preset("demo", **{"train.checkpoint_every": "auto"})
    limits = HangLimits(**{**HangLimits.of(spec, to_step=40, checkpoint_bytes=500 * 10**6)
                           .__dict__, "floor_s": 60.0})
    assert limits.checkpoint_every == 0  # the workflow chooses it per segment
    start = StartLine(resumed_from=0, world_size=1, to_step=40, attempt=1, checkpoint_every=7)
    assert fed(limits, [start, step(14)]).current().phase == "checkpoint"
    assert fed(limits, [start, step(10)]).current().phase == "step"
    # before the start line says it, only the segment's end is known to commit
    assert fed(limits, [step(14)]).current().phase == "step"


def test_an_eval_step_gets_k_times_the_p99_per_grad_accum_of_eval_batches_until_its_line():
    limits = HangLimits(**{**AUTO.__dict__, "floor_s": 1.0, "eval_every": 5, "eval_batches": 8,
                           "grad_accum": 2})
    watch = fed(limits, [step(n, dt=0.5) for n in range(1, 6)])
    # 10 x 0.5 s for the step, 10 x 0.5 s x 8 / 2 for the evaluation
    assert (watch.current().limit_s, watch.current().phase) == (25.0, "eval")
    watch.seen(EvalLine(step=5, val_loss=2.0), 6.0)
    assert watch.current().limit_s == 5.0  # after it: an early stop may commit (0 bytes here)


def test_the_checkpoint_size_is_the_measured_one_else_estimated_from_the_parameters():
    watch = fed(AUTO, [StartLine(resumed_from=None, world_size=2, to_step=40, attempt=1,
                                 params=10**8)])
    assert watch.checkpoint_bytes == 16 * 10**8  # a fresh run: nothing measured yet
    assert watch.current().limit_s == pytest.approx(600.0 + 64.0)
    watch.seen(CommitLine(step=0, uri="u", bytes=10**9), 2.0)
    assert watch.checkpoint_bytes == 10**9


def test_a_fixed_hang_timeout_counts_from_the_start_and_each_line_with_nothing_added():
    limits = HangLimits(**{**AUTO.__dict__, "hang_s": 10.0, "checkpoint_bytes": 10**12})
    watch = fed(limits, [])
    assert (watch.current().name, watch.current().limit_s, watch.current().auto) == \
        ("hang_timeout_s", 10.0, False)
    watch = fed(limits, [StartLine(resumed_from=1, world_size=2, to_step=40, attempt=1),
                         step(10)])
    assert (watch.current().limit_s, watch.current().since) == (10.0, 2.0)


def test_a_fixed_startup_timeout_applies_until_the_first_step_then_the_auto_one():
    limits = HangLimits(**{**AUTO.__dict__, "startup_s": 30.0})
    watch = fed(limits, [StartLine(resumed_from=1, world_size=2, to_step=40, attempt=1)])
    assert (watch.current().name, watch.current().limit_s, watch.current().since) == \
        ("startup_timeout_s", 30.0, 0.0)
    watch.seen(step(2), 5.0)
    assert (watch.current().name, watch.current().limit_s) == ("hang_timeout_s", 60.0)


def test_limits_come_from_the_spec_auto_by_default_and_numbers_stay_fixed():
    spec = preset("demo")
    auto = HangLimits.of(spec, to_step=80, checkpoint_bytes=123)
    assert (auto.hang_s, auto.startup_s, auto.floor_s, auto.factor) == (None, None, 60.0, 10.0)
    assert (auto.checkpoint_bytes, auto.checkpoint_every, auto.to_step) == \
        (123, spec.train.checkpoint_every, 80)
    fixed = spec.replace(**{"ops.hang_timeout_s": 10.0, "ops.startup_timeout_s": 90})
    assert (HangLimits.of(fixed, 80).hang_s, HangLimits.of(fixed, 80).startup_s) == (10.0, 90.0)
    assert HangLimits.build_lock_s(spec.ops) == 600.0  # the start-up floor
    assert HangLimits.build_lock_s(spec.replace(**{"ops.hang_timeout_s": 10.0}).ops) == 10.0
    assert HangLimits.build_lock_s(fixed.ops) == 90.0


def test_the_fault_payload_names_the_timeout_its_value_and_the_measured_p99():
    watch = fed(AUTO, [step(1, dt=0.25), step(2, dt=0.5)])
    timeout, waited = watch.overdue(70.0)
    payload = Fault("hang", timeout.evidence(waited), facts=timeout.payload(waited),
                    fault_ts=1.0, detected_ts=2.0).to_json()
    assert payload["kind"] == "hang" and payload["timeout"] == "hang_timeout_s"
    assert (payload["timeout_s"], payload["auto"], payload["p99_step_s"]) == (60.0, True, 0.5)
    assert payload["waited_s"] == 68.0 and payload["steps_measured"] == 1
    assert "hang_timeout_s auto = 60.0s" in payload["evidence"]
    assert "after step 2" in payload["evidence"]


# ---- the real supervisor, real children ---------------------------------------------------------
QUIET_CHILD = """
import json, os, signal, sys, time
progress, steps, then = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(os.path.join(os.path.dirname(progress), "rank0.pid"), "w") as f:
    f.write(str(os.getpid()))
with open(progress, "a") as f:
    for n in range(1, steps + 1):
        time.sleep(0.05)
        f.write(json.dumps({"type": "step", "step": n, "loss": 2.0, "lr": 1e-3,
                            "step_time_s": 0.05, "ts": time.time()}) + "\\n")
        f.flush()
if then == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(60)
"""


def _run_quiet(tmp_path, steps: int, then: str, limits: HangLimits) -> tuple[dict, float]:
    progress = tmp_path / "progress.jsonl"
    seen: list[Fault] = []
    t0 = time.monotonic()
    with pytest.raises(HardwareFault):
        supervise([sys.executable, "-c", QUIET_CHILD, str(progress), str(steps), then],
                  workdir=str(tmp_path), env=child_env(), progress_file=str(progress),
                  hang=limits, poll_s=0.05, on_failure=seen.append)
    assert len(seen) == 1 and seen[0].kind == "hang"
    return json.loads(json.dumps(seen[0].to_json())), time.monotonic() - t0


@pytest.mark.process
def test_a_child_quiet_after_its_steps_is_hung_at_the_auto_timeout_from_its_last_line(tmp_path):
    limits = HangLimits(floor_s=1.5, factor=10.0, checkpoint_every=1000, to_step=1000)
    payload, took = _run_quiet(tmp_path, steps=5, then="stop", limits=limits)
    assert payload["timeout"] == "hang_timeout_s" and payload["timeout_s"] == 1.5
    assert payload["p99_step_s"] == 0.05 and payload["steps_measured"] == 4
    assert payload["rank"] == 0 and "rank 0 is stopped" in payload["evidence"]
    assert 1.5 <= payload["waited_s"] < 2.0 and 1.5 < payload["detection_s"] < 2.5
    assert took < 10.0


@pytest.mark.process
def test_a_child_that_never_steps_is_hung_at_the_startup_timeout_from_its_start(tmp_path):
    limits = HangLimits(floor_s=0.2, factor=10.0, startup_s=1.0)
    payload, took = _run_quiet(tmp_path, steps=0, then="sleep", limits=limits)
    assert payload["timeout"] == "startup_timeout_s" and payload["timeout_s"] == 1.0
    assert payload["p99_step_s"] is None and payload["rank"] is None
    assert "no step" in payload["evidence"] and 1.0 <= took < 10.0
