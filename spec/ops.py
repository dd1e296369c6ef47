"""RunSpec's `ops` section: how the run is supervised and observed. Timeouts and budgets of
the training activity (workflows/policy.py), the supervisor's hang detection and stop grace
(activities/supervise.py), the `train_metrics` cadence (activities/metrics.py) and where the
run's spans go (common/telemetry.py). Stdlib only; re-exported by spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from spec.codec import DAY, num
from spec.codec import positive as _positive


@dataclass(frozen=True, kw_only=True)
class OpsConfig:
    # Removed fields, with their last default (spec/codec.py): accepted and ignored on input,
    # so stored specs and the inputs of runs in flight still parse, and kept in spec_hash,
    # so a run claimed before the removal resumes under its id. metrics_port was ignored:
    # a Prometheus port belongs to a worker (`mainspring worker --metrics-port`).
    RETIRED: ClassVar[dict[str, Any]] = {"metrics_port": 0}

    # >= 1 s: Temporal reads a timeout that rounds to 0 as "none" and refuses the activity
    heartbeat_timeout_s: float = num(30.0, 1, DAY)
    hang_timeout_s: float = num(600.0, 0, 7 * DAY)  # no progress for this long = hung trainer
    # a cancelled segment (operator pause/rollback/abort) may take this long to commit a
    # checkpoint at its current step and upload it before the trainer is killed
    stop_grace_s: float = num(300.0, 0, DAY)
    segment_budget_s: float = num(7 * DAY, 1, 365 * DAY)  # schedule-to-close, all retries
    # OTLP/HTTP collector for the spans of this run's own processes (common/telemetry.py):
    # host:port or http(s)://host:port[/path]; "/v1/traces" is added to a bare address
    otlp_endpoint: str = ""
    metrics_every: int = num(10, 1, 10**9)  # steps per durable train_metrics event (report)

    def __post_init__(self) -> None:
        _positive(self, "heartbeat_timeout_s", "hang_timeout_s", "segment_budget_s",
                  "stop_grace_s", "metrics_every")
