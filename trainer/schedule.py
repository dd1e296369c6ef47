"""The learning rate of every optimizer step: pure functions of the (1-based) step.

One convention throughout: `step` is the optimizer step being run, 1-based — the step that
turns a state at `step - 1` into a state at `step`, the number the progress file and the
events print. The LR of a step is the base schedule (`lr_at`) times every factor whose
window holds it: the workflow's windows (spike escalation, the operator's `set_lr_scale`)
and, in tests and the demo, an injected `lr_burst` (trainer/faults.py). No DeepSpeed
scheduler: the step loop sets the LR before every step, so the schedule is a function of
the checkpointed step alone and a resume cannot drift from it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from spec import TrainConfig

Window = Sequence[float]  # [start, end, factor]: LR x factor for steps in (start, end]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Base LR of optimizer step `step` (1-based).

    Linear warmup from lr/warmup to lr over the first `warmup_steps` steps, then cosine
    decay to `min_lr` at step `total_steps + 1`, flat at `min_lr` afterwards (nanoGPT's
    `get_lr`, whose `it` is our `step - 1`).
    """
    done = step - 1  # optimizer steps completed before this one
    if done < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if done >= cfg.total_steps:
        return cfg.min_lr
    progress = (done - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def lr_scale(windows: Iterable[Window], step: int) -> float:
    """Product of the factors of the windows [start, end, factor] that hold `step`."""
    scale = 1.0
    for start, end, factor in windows:
        if start < step <= end:
            scale *= factor
    return scale


class LRSchedule:
    """The LR of each step: `lr_at` x the workflow's windows x one-shot windows.

    A one-shot window (an injected `lr_burst`, a transient fault) applies only the first
    time a step in it runs in this process: a rollback inside the segment replays those
    steps at the planned LR, as it would after a real transient fault.
    """

    def __init__(self, cfg: TrainConfig, windows: Iterable[Window],
                 one_shot: Iterable[Window] = ()) -> None:
        self.cfg, self.windows, self.one_shot = cfg, tuple(windows), tuple(one_shot)
        self.furthest = 0  # the furthest step this process has run

    def __call__(self, step: int) -> float:
        first_time = step > self.furthest
        self.furthest = max(self.furthest, step)
        burst = lr_scale(self.one_shot, step) if first_time else 1.0
        return lr_at(step, self.cfg) * lr_scale(self.windows, step) * burst
