"""Fault injection for tests, benchmarks and the demo (`RunSpec.faults`). Never active
unless the spec asks for it. Every fault is the real failure, not a simulation of its
symptoms downstream:

- `kill_worker` SIGKILLs the supervising worker process — what a lost node produces —
  after flushing a `fault` event with its evidence;
- `corrupt_batches` replaces the batches that given steps read (in the original data order)
  with random tokens — bad data: it is there again on every replay and retry, so only
  skipping that data window gets past it;
- `lr_burst` multiplies the LR for a few steps, once per process (a transient bad update);
- `nan_loss` makes one step's loss (and so its gradients) NaN, once per process.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable

import structlog
import torch

from common.procs import WORKER_PID_ENV
from spec import FaultSpec

log = structlog.get_logger(__name__)



def due_faults(faults: Iterable[FaultSpec], step: int, attempt: int) -> list[FaultSpec]:
    """kill_worker faults that fire right after `step` completes on this activity attempt."""
    return [f for f in faults
            if f.kind == "kill_worker" and f.at_step == step and f.attempt == attempt]


def corrupt_cursors(faults: Iterable[FaultSpec], batches_per_step: int) -> list[tuple[int, int]]:
    """[start, end) data cursors holding corrupted batches: the batches steps at_step ..
    at_step+steps-1 read when nothing is skipped (step s reads cursors s*b .. s*b+b-1)."""
    return [((f.at_step - 1) * batches_per_step, (f.at_step - 1 + f.steps) * batches_per_step)
            for f in faults if f.kind == "corrupt_batches"]


def random_tokens(cursor: int, shape: torch.Size, vocab_size: int, seed: int) -> torch.Tensor:
    """The corrupted content of batch `cursor`: uniform random tokens, the same on replay."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + cursor)
    return torch.randint(0, vocab_size, tuple(shape), generator=g)


class Injector:
    """Per-process fault state. One-shot faults (lr_burst, nan_loss) remember that they
    fired: a rollback inside the segment replays their steps and they stay quiet, as a
    transient fault would. Each fault's first firing is recorded as a `fault` event."""

    def __init__(self, faults: Iterable[FaultSpec], *, batches_per_step: int, vocab_size: int,
                 seed: int, events=None) -> None:
        self.faults = tuple(f for f in faults if f.kind != "kill_worker")
        self.batches_per_step = batches_per_step
        self.corrupt = corrupt_cursors(self.faults, batches_per_step)
        self._corrupting = [f for f in self.faults if f.kind == "corrupt_batches"]  # same order
        self.vocab_size, self.seed, self.events = vocab_size, seed, events
        self.fired: set[tuple[str, int]] = set()
        self.burning: dict[int, bool] = {}

    def _announce(self, fault: FaultSpec, step: int, **evidence) -> None:
        key = (fault.kind, fault.at_step)
        if key in self.fired:
            return
        self.fired.add(key)
        log.warning("injecting_fault", kind=fault.kind, step=step, **evidence)
        if self.events is not None:
            self.events.record("fault", step, f"fault/{fault.kind}/{fault.at_step}",
                               {"kind": fault.kind, "injected": True, "at_step": fault.at_step,
                                "steps": fault.steps, **evidence})

    def batch(self, cursor: int, step: int,
              tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The batch as read, or random inputs and targets if batch `cursor` is corrupted."""
        for f, (a, b) in zip(self._corrupting, self.corrupt):
            if a <= cursor < b:
                self._announce(f, step, cursors=[a, b])
                x, y, *rest = tensors
                bad_y = torch.where(y >= 0, random_tokens(-cursor - 1, y.shape, self.vocab_size,
                                                          self.seed), y)  # keep ignore slots
                return (random_tokens(cursor, x.shape, self.vocab_size, self.seed), bad_y, *rest)
        return tensors

    def lr_factor(self, step: int) -> float:
        """LR multiplier for step `step` (1-based: the step about to run). Call once per step."""
        factor = 1.0
        for f in self.faults:
            if f.kind != "lr_burst" or not f.at_step <= step < f.at_step + f.steps:
                continue
            if step == f.at_step:
                self.burning[f.at_step] = (f.kind, f.at_step) not in self.fired
                self._announce(f, step, factor=f.factor)
            if self.burning.get(f.at_step):
                factor *= f.factor
        return factor

    def poison(self, step: int) -> bool:
        """True, once, for the step whose loss an injected NaN replaces."""
        for f in self.faults:
            if f.kind == "nan_loss" and f.at_step == step and (f.kind, step) not in self.fired:
                self._announce(f, step)
                return True
        return False


def inject(fault: FaultSpec, events, step: int, last_committed: int | None) -> None:
    if fault.kind == "kill_worker":
        pid = int(os.environ.get(WORKER_PID_ENV, "0"))
        if pid <= 1:
            log.warning("fault_skipped", kind=fault.kind, reason=f"{WORKER_PID_ENV} not set")
            return
        events.record("fault", step, f"fault/kill_worker/{fault.at_step}/{fault.attempt}",
                      {"kind": "kill_worker", "injected": True,
                       "evidence": f"SIGKILL to trainer worker pid {pid} after step {step}; "
                                   f"last committed step {last_committed}"})
        events.flush()
        log.warning("injecting_fault", kind=fault.kind, step=step, worker_pid=pid)
        os.kill(pid, signal.SIGKILL)
