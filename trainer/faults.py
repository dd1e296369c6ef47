"""Fault injection for tests and the demo (`RunSpec.faults`). Never active unless the spec
asks for it. `kill_worker` SIGKILLs the supervising worker process — the real failure a
lost node produces — after flushing a `fault` event with its evidence."""

from __future__ import annotations

import os
import signal
from typing import Iterable

import structlog

from ops.spec import FaultSpec

log = structlog.get_logger(__name__)

WORKER_PID_ENV = "MAINSPRING_WORKER_PID"  # set by the supervisor for its children


def due_faults(faults: Iterable[FaultSpec], step: int, attempt: int) -> list[FaultSpec]:
    """Faults that fire right after `step` completes on this activity attempt."""
    return [f for f in faults if f.at_step == step and f.attempt == attempt]


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
