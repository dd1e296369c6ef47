"""benchmarks/layouts.py's arithmetic: a segment's steady step time taken from its progress
lines without the warm-up or the profiled steps (the bubble is ops/plan.py's, tested there)."""

from __future__ import annotations

import pytest

from benchmarks.layouts import WARMUP, figures


def test_the_step_time_leaves_out_the_warm_up_and_the_profiled_steps():
    lines = [{"type": "start"}]
    lines += [{"type": "step", "step": s, "step_time_s": 9.0} for s in range(1, WARMUP + 1)]
    lines += [{"type": "step", "step": WARMUP + 1, "step_time_s": 0.2},
              {"type": "step", "step": WARMUP + 2, "step_time_s": 0.4,
               "comm_exposed_frac": 0.25},  # under the profiler
              {"type": "step", "step": WARMUP + 3, "step_time_s": 0.3},
              {"type": "step", "step": WARMUP + 4, "step_time_s": 0.1,
               "comm_exposed_frac": 0.75},
              {"type": "eval", "step": WARMUP + 4}]
    out = figures(lines, tokens_per_step=1000)
    assert out["step_time_s"] == 0.25 and out["tokens_per_s"] == 4000.0
    assert out["comm_exposed_frac"] == 0.5 and out["profiled_steps"] == 2
    assert out["steady_steps"] == 2
    with pytest.raises(ValueError, match="no step after"):
        figures(lines[:WARMUP + 1], tokens_per_step=1000)
