"""RunSpec's `faults[]` entries: faults injected on purpose (tests, benchmarks, the demo),
carried out by trainer/faults.py. Stdlib only; re-exported by spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from spec.codec import STEPS, num
from spec.codec import positive as _positive
from spec.codec import require as _require

FAULT_KINDS = ("kill_worker", "corrupt_batches", "lr_burst", "nan_loss", "crash",
               "memory_limit", "corrupt_grad")
MAX_FAULTS = 64  # entries in RunSpec.faults


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """An injected fault (tests, benchmarks and the demo only; trainer/faults.py).

    - kill_worker: SIGKILL the trainer worker right after `at_step` (on `attempt` only);
    - corrupt_batches: the data batches that steps at_step .. at_step+steps-1 read in the
      original order hold random tokens — bad data, there on every attempt and replay;
    - lr_burst: the LR is multiplied by `factor` for `steps` steps from `at_step`, once;
    - nan_loss: the loss of step `at_step` is NaN (its gradients too), once;
    - crash: step `at_step` raises RuntimeError on every attempt — a bug at a fixed step —
      while the file `path` exists (always, when `path` is empty): removing it is the fix;
      on the node named `node` only, when it names one (a bad host);
    - memory_limit: from step `at_step` on, every rank's data segment may grow by at most
      `mb` MiB over what it holds then (a real RLIMIT_DATA, on every attempt: an allocation
      past it fails like any out-of-memory);
    - corrupt_grad: on rank `rank` only, the first update at or after step `at_step`
      finds one gradient element NaN (its largest in magnitude), once: silent data
      corruption on one rank, after the gradients are reduced and clipped. With `bit`
      0-31 that element's bit `bit` is flipped instead (bit 10 of a float32 moves it by
      about 1e-4 of itself): a copy of the weights that differs while no loss shows it.
    """

    # added fields at their default: out of spec_hash (spec/run.py, OpsConfig.ADDED)
    ADDED: ClassVar[dict[str, Any]] = {"path": "", "mb": 256, "node": "", "rank": 0,
                                       "bit": -1}

    kind: str
    at_step: int = num(lo=1, hi=STEPS)
    # kill_worker fires only on this activity attempt, so the retry recovers
    attempt: int = num(1, 1, 10**6)
    steps: int = num(1, 1, STEPS)
    factor: float = num(30.0, 0, 1e6, lo_open=True)
    path: str = ""  # crash: fires while this file exists
    node: str = ""  # crash: fires on this node only (`mainspring worker --node`; "" any)
    mb: int = num(256, 1, 1 << 30)  # memory_limit: MiB of headroom
    rank: int = num(0, 0, 1 << 20)  # corrupt_grad: the one global rank it strikes
    bit: int = num(-1, -1, 31)  # corrupt_grad: -1 makes the element NaN; 0-31 flips that bit

    def __post_init__(self) -> None:
        _require(self.kind in FAULT_KINDS, "kind", f"unknown fault {self.kind!r}",
                 f"use one of {', '.join(FAULT_KINDS)}")
        _require(self.at_step > 0, "at_step", "must be > 0", "inject after step 0")
        _positive(self, "attempt", "steps", "factor", "mb")
