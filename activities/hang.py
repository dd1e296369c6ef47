"""When a quiet trainer counts as hung: the supervisor's timeouts, from what this
segment measured (spec/ops.py documents the fields and why their defaults are what they are).

- Before the first step line only the start-up timeout applies, counted from the child's
  start: launch, imports, rendezvous, extension builds, restore, a fresh run's step-0
  checkpoint. "auto": startup_floor_s + the checkpoint's I/O time.
- From the first step line on, the hang timeout applies, counted from the last progress
  line of any kind. "auto": max(hang_floor_s, hang_step_factor x the p99 of this segment's
  step times), plus what the loop is known to do after that line without writing one — a
  checkpoint step saves (and may wait behind an upload), a rollback restores, a stop
  commits: the checkpoint's I/O time; an eval step runs eval_batches forward passes:
  k x p99 x eval_batches / grad_accum. (The NVIDIA resiliency extension's heartbeat docs
  make the same point: no heartbeat comes while a checkpoint is saved or loaded, so its
  timeout has to budget for that time.)
- A number for hang_timeout_s is the old fixed rule: that many seconds without a line,
  from the child's start too (unless startup_timeout_s is a number).

Pure: `HangWatch` is fed the progress lines and the supervisor's clock and answers which
timeout, if any, the silence has passed (activities/supervise.py acts on it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.protocol import CommitLine, EvalLine, ProgressLine, StartLine, StepLine

if TYPE_CHECKING:
    from spec import OpsConfig, RunSpec

STEP_WINDOW = 1000  # step times kept: the p99 follows the run (longer sequences, more load)
# A checkpoint's size before one is measured (a fresh run): bf16 weights, fp32 master
# weights and Adam's two fp32 moments are 14 bytes a parameter; 16 rounds up.
BYTES_PER_PARAM = 16


def p99(values: Sequence[float]) -> float | None:
    """The nearest-rank 99th percentile (the largest of fewer than 100 values); None if none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def hang_deadline(step_times: Sequence[float], floor_s: float, k: float) -> float:
    """The auto hang timeout between two steps: max(floor, k x p99 of the step times)."""
    q = p99(step_times)
    return floor_s if q is None else max(floor_s, k * q)


def checkpoint_io_s(nbytes: int, mb_per_s: float) -> float:
    """Time to allow for one checkpoint save or restore: twice its bytes at the conservative
    rate (the transfer, and one upload the loop may wait behind: storage.max_in_flight)."""
    return 2.0 * max(0, nbytes) / (mb_per_s * 1e6)


def startup_deadline(nbytes: int, floor_s: float, mb_per_s: float) -> float:
    """The auto start-up timeout: the floor plus the checkpoint's I/O time."""
    return floor_s + checkpoint_io_s(nbytes, mb_per_s)


def eval_allowance_s(step_times: Sequence[float], k: float, eval_batches: int,
                     grad_accum: int) -> float:
    """An online evaluation: eval_batches forward passes, each cheaper than one of a step's
    grad_accum forward+backward passes, at the same safety factor as a step."""
    return k * (p99(step_times) or 0.0) * eval_batches / max(1, grad_accum)


@dataclass(frozen=True, kw_only=True)
class HangLimits:
    """The timeouts of one segment, resolved from ops (numbers: fixed; None: auto)."""

    hang_s: float | None = None  # ops.hang_timeout_s as a number; None: auto
    startup_s: float | None = None  # ops.startup_timeout_s as a number; None: auto
    floor_s: float = 60.0
    factor: float = 10.0
    startup_floor_s: float = 600.0
    mb_per_s: float = 50.0
    checkpoint_bytes: int = 0  # the newest committed checkpoint's (0: none yet)
    checkpoint_every: int = 0  # 0: not known (yet: "auto" - the start line says it)
    to_step: int = 0
    eval_every: int = 0
    eval_batches: int = 0
    grad_accum: int = 1

    @classmethod
    def fixed(cls, seconds: float) -> HangLimits:
        """One number for every phase: the rule before the timeouts followed the step time."""
        return cls(hang_s=seconds)

    @classmethod
    def of(cls, spec: RunSpec, to_step: int, checkpoint_bytes: int = 0) -> HangLimits:
        """The limits of a segment of `spec` ending at `to_step`, whose newest
        committed checkpoint has `checkpoint_bytes` (CheckpointStore.manifest().total_bytes)."""
        ops, train = spec.ops, spec.train
        return cls(hang_s=_seconds(ops.hang_timeout_s), startup_s=_seconds(ops.startup_timeout_s),
                   floor_s=ops.hang_floor_s, factor=ops.hang_step_factor,
                   startup_floor_s=ops.startup_floor_s, mb_per_s=ops.checkpoint_mb_per_s,
                   checkpoint_bytes=checkpoint_bytes,
                   checkpoint_every=0 if train.auto_checkpoint else train.checkpoint_every,
                   to_step=to_step, eval_every=train.eval_every,
                   eval_batches=train.eval_batches, grad_accum=train.grad_accum)

    @staticmethod
    def build_lock_s(ops: OpsConfig) -> float:
        """How old an extension-build lock must be to be stale (trainer/extensions.py): the
        build runs at start-up before the restore, so the start-up timeout less its I/O."""
        return _seconds(ops.startup_timeout_s) or _seconds(ops.hang_timeout_s) \
            or ops.startup_floor_s


def _seconds(value: float | str) -> float | None:
    return None if isinstance(value, str) else float(value)


@dataclass(frozen=True)
class Timeout:
    """The timeout that applies now: its field, value, the clock it counts from, the phase
    the trainer is in, how the value came about, and the step times it came from."""

    name: str  # startup_timeout_s | hang_timeout_s
    limit_s: float
    since: float  # the supervisor's monotonic clock
    phase: str  # startup | step | checkpoint | rollback | eval (joined by +)
    auto: bool
    how: str
    p99_step_s: float | None
    steps_measured: int
    last_step: int | None
    checkpoint_bytes: int = 0  # the checkpoint size its I/O time came from

    def evidence(self, waited_s: float) -> str:
        what = f"no progress line for {waited_s:.1f}s after step {self.last_step}" \
            if self.last_step is not None else \
            f"no step {waited_s:.1f}s after the trainer started"
        return (f"{what} (hang): {self.name} {'auto' if self.auto else 'fixed'} = "
                f"{self.limit_s:.1f}s ({self.how}; phase {self.phase})")

    def payload(self, waited_s: float) -> dict:
        return {"timeout": self.name, "timeout_s": round(self.limit_s, 3), "auto": self.auto,
                "timeout_how": self.how, "phase": self.phase, "waited_s": round(waited_s, 3),
                "p99_step_s": None if self.p99_step_s is None else round(self.p99_step_s, 4),
                "steps_measured": self.steps_measured, "checkpoint_bytes": self.checkpoint_bytes}


class HangWatch:
    """The progress seen so far, and the timeout it implies (`current`, `overdue`)."""

    def __init__(self, limits: HangLimits, started: float,
                 times: deque[float] | None = None) -> None:
        """`times`: the step times of the attempt's earlier launches (a restart in place:
        activities/launch.py), carried on. A launch's first step (its warm-up:
        allocations, the first collective) counts only while there is nothing else to
        measure by, and leaves the window when the launch's second step comes: with a few
        dozen steps measured the p99 is their largest, and one warm-up step three times
        the others' length set a timeout three times too long (benchmarks/recovery.py)."""
        self.limits, self.started, self.last_at = limits, started, started
        self.times: deque[float] = times if times is not None else deque(maxlen=STEP_WINDOW)
        self.first = True  # the next step line is this launch's first
        self.warmup_counted = False  # its time is in `times` (the last one) for now
        self.step: StepLine | None = None  # the last step line
        self.evaluated = False  # the last step's eval line came
        self.measured, self.estimated = limits.checkpoint_bytes, 0
        self.stopping = False  # asked to stop: it commits at the end of its step
        # its checkpoint cadence: the spec's, or what the trainer says it runs (its start
        # line: the workflow's choice for train.checkpoint_every "auto")
        self.checkpoint_every = limits.checkpoint_every

    def seen(self, line: ProgressLine, now: float) -> None:
        if not isinstance(line, CommitLine) or self._draining():
            # a commit line comes from the checkpointer's thread: mid-segment it is no sign
            # that the step loop lives (a hang detected 1.2 s late because an upload landed
            # in it: benchmarks/recovery.py); at start-up and in the end's drain the loop
            # waits on those commits, so there each one is progress
            self.last_at = now
        if isinstance(line, StepLine):
            self.step, self.evaluated = line, False
            t, first = line.step_time_s, self.first
            self.first = False
            if t is None or not math.isfinite(t) or t < 0:
                return
            if first:
                self.warmup_counted = not self.times
                if self.warmup_counted:
                    self.times.append(t)
                return
            if self.warmup_counted:  # a real step measured: the warm-up no longer counts
                self.times.pop()
                self.warmup_counted = False
            self.times.append(t)
        elif isinstance(line, EvalLine):
            self.evaluated = True
        elif isinstance(line, CommitLine):
            self.measured = max(self.measured, line.bytes)
        elif isinstance(line, StartLine):
            self.estimated = BYTES_PER_PARAM * line.params
            self.checkpoint_every = line.checkpoint_every or self.checkpoint_every

    def _draining(self) -> bool:
        """No step yet (start-up: a restore announces its commit), or the loop's last step
        was the segment's last or a stop was asked: it now waits for the uploads."""
        return self.step is None or self.stopping or self.step.step >= self.limits.to_step

    @property
    def checkpoint_bytes(self) -> int:
        return self.measured or self.estimated

    def current(self) -> Timeout:
        lim, q, n = self.limits, p99(self.times), len(self.times)
        last = self.step.step if self.step else None

        def timeout(name: str, limit_s: float, since: float, phase: str, auto: bool,
                    how: str) -> Timeout:
            return Timeout(name, limit_s, since, phase, auto, how, q, n, last,
                           self.checkpoint_bytes)
        io = checkpoint_io_s(self.checkpoint_bytes, lim.mb_per_s)
        io_how = f"2 x {self.checkpoint_bytes / 1e6:.1f} MB at {lim.mb_per_s:g} MB/s"
        if self.step is None:  # start-up: only the start-up timeout
            if lim.startup_s is not None:
                return timeout("startup_timeout_s", lim.startup_s, self.started, "startup",
                               False, "set in the spec")
            if lim.hang_s is not None:
                return timeout("hang_timeout_s", lim.hang_s, self.last_at, "startup", False,
                               "set in the spec, from the trainer's start and each line")
            return timeout("startup_timeout_s",
                           startup_deadline(self.checkpoint_bytes, lim.startup_floor_s,
                                            lim.mb_per_s), self.started, "startup", True,
                           f"startup_floor_s {lim.startup_floor_s:g}s + {io_how}")
        if lim.hang_s is not None:
            return timeout("hang_timeout_s", lim.hang_s, self.last_at, "step", False,
                           "set in the spec")
        base = hang_deadline(self.times, lim.floor_s, lim.factor)
        how = (f"max(hang_floor_s {lim.floor_s:g}s, {lim.factor:g} x p99 step "
               f"{(q or 0.0):.3f}s of {n})")
        extra = self._after_step(io, io_how)
        for _, add, text in extra:
            base += add
            how += f" + {text}"
        return timeout("hang_timeout_s", base, self.last_at,
                       "+".join(phase for phase, _, _ in extra) or "step", True, how)

    def _after_step(self, io: float, io_how: str) -> list[tuple[str, float, str]]:
        """What the loop does after the last step line before it writes the next one."""
        lim, step, every = self.limits, self.step, self.checkpoint_every
        n = step.step
        extra: list[tuple[str, float, str]] = []
        if step.verdict == "rollback":
            extra.append(("rollback", io, f"restore ({io_how})"))
        elif self.stopping or self.evaluated or n == lim.to_step or (
                every and n % every == 0):
            # an eval may end the segment early (overfitting), which commits
            extra.append(("checkpoint", io, f"save ({io_how})"))
        if lim.eval_every and n % lim.eval_every == 0 and not self.evaluated:
            extra.append(("eval", eval_allowance_s(self.times, lim.factor, lim.eval_batches,
                                                   lim.grad_accum),
                          f"eval ({lim.eval_batches} batches)"))
        return extra

    def overdue(self, now: float) -> tuple[Timeout, float] | None:
        """The timeout the silence has passed, and how long it has lasted; None if none."""
        t = self.current()
        waited = now - t.since
        return (t, waited) if waited > t.limit_s else None
