"""RunSpec's `ops` section: how the run is supervised and observed. Timeouts and budgets of
the training activity (workflows/policy.py), the supervisor's hang detection and stop grace
(activities/supervise.py), the `train_metrics` cadence (activities/metrics.py) and where the
run's spans go (common/telemetry.py). Stdlib only; re-exported by spec."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from spec.codec import DAY, check_seconds, num, seconds
from spec.codec import positive as _positive
from spec.codec import require as _require

# Why the durations below have the minimum they have (docs/runspec.md, "ops").
ROUNDS_TO_NONE = "Temporal reads a timeout that rounds to 0 s as none and refuses the activity"
NO_CHILD = "no trainer starts, or writes a progress line, faster: it would always be hung"


@dataclass(frozen=True, kw_only=True)
class OpsConfig:
    # Removed fields, with their last default (spec/codec.py): accepted and ignored on input,
    # so stored specs and the inputs of runs in flight still parse, and kept in spec_hash,
    # so a run claimed before the removal resumes under its id. metrics_port was ignored:
    # a Prometheus port belongs to a worker (`mainspring worker --metrics-port`).
    RETIRED: ClassVar[dict[str, Any]] = {"metrics_port": 0}
    # Added fields, with the default they came with: left out of spec_hash at that default,
    # so a run claimed before they existed keeps its hash (spec/run.py).
    ADDED: ClassVar[dict[str, Any]] = {
        "repeat_failure_limit": 3, "hang_floor_s": 60.0, "hang_step_factor": 10.0,
        "startup_timeout_s": "auto", "startup_floor_s": 600.0, "checkpoint_mb_per_s": 50.0,
        "node_wait_s": 300.0, "node_failure_limit": 2, "mtbf_s": 21600.0,
        "mtbf_prior_faults": 3, "accelerator_hour_price": 0.0, "profile_every": 0}

    heartbeat_timeout_s: float = seconds(30.0, 1, DAY, why=ROUNDS_TO_NONE)
    # Hang detection (activities/hang.py). A trainer that writes no progress line for this
    # long is hung: "auto" = max(hang_floor_s, hang_step_factor x the p99 step time measured
    # in this segment), plus the checkpoint I/O time after a checkpoint or rollback step and
    # the evaluation time after an eval step; or seconds, fixed (from the child's start too).
    # The NVIDIA resiliency extension derives its rank timeouts the same way (safety factor
    # 5 x the longest interval seen); k = 10 on the p99 keeps that margin, as the p99 of a
    # short sample sits below its max. The floor: torchft's default collective timeout
    # (60 s) - a step phase quieter than that is not a normal step on any machine.
    hang_timeout_s: float | str = seconds("auto", 1, 7 * DAY, why=NO_CHILD, words=("auto",))
    hang_floor_s: float = seconds(60.0, 1, DAY, why=NO_CHILD)
    # below 2 a step twice the p99 - ordinary jitter on a shared machine - would be a hang
    hang_step_factor: float = num(10.0, 2, 1000)
    # Before the first step line: launch, imports, rendezvous, extension builds, restore.
    # "auto" = startup_floor_s + the newest checkpoint's I/O time; seconds: fixed. With a
    # fixed hang_timeout_s, "auto" here means that number (the rule before start-up had a
    # timeout of its own). The floor is that rule's 600 s default: no start-up that passed
    # before is called a hang.
    startup_timeout_s: float | str = seconds("auto", 1, 7 * DAY, why=NO_CHILD, words=("auto",))
    startup_floor_s: float = seconds(600.0, 1, 7 * DAY, why=NO_CHILD)
    # the checkpoint I/O time is 2 x its bytes at this rate (a read or write, and one upload
    # the loop may wait behind): conservative for a single S3 stream or a spinning disk
    checkpoint_mb_per_s: float = num(50.0, 1, 10**6)
    # a cancelled segment (operator pause/rollback/abort) may take this long to commit a
    # checkpoint at its current step and upload it before the trainer is killed
    stop_grace_s: float = seconds(300.0, 1, DAY, why="below it no trainer finishes its step")
    # schedule-to-close, all retries
    segment_budget_s: float = seconds(7 * DAY, 1, 365 * DAY, why=ROUNDS_TO_NONE)
    # OTLP/HTTP collector for the spans of this run's own processes (common/telemetry.py):
    # host:port or http(s)://host:port[/path]; "/v1/traces" is added to a bare address
    otlp_endpoint: str = ""
    metrics_every: int = num(10, 1, 10**9)  # steps per durable train_metrics event (report)
    # the same failure (kind, step, exception type, top frame) this many times in a row stops
    # the retrying: the run pauses in needs_attention with the evidence (activities/
    # recovery.py); transient kinds (worker_lost, storage_outage, preempted) never count
    repeat_failure_limit: int = num(3, 1, 1000)
    # Multi-node segments (workflows/gang.py): a node whose failure ended this many gang
    # launches in a row is set aside for the rest of the run (a `node_set_aside` event);
    # with fewer healthy nodes than train.nodes the run waits this long for more to register
    # (stage waiting_for_nodes), then goes on with fewer when train.min_nodes allows.
    node_failure_limit: int = num(2, 1, 1000)
    node_wait_s: float = seconds(300.0, 0, 30 * DAY, why="0: go on with fewer at once")
    # train.checkpoint_every "auto" (workflows/interval.py): the mean time between faults
    # the run assumes before it has seen its own. It counts as mtbf_prior_faults faults at
    # this spacing, each fault the run sees replaces one, so from mtbf_prior_faults faults
    # on the MTBF is the run's own (its segments' wall time / its faults). 6 h: the order
    # large jobs see (Llama 3's pretraining: 466 interruptions in 54 days on 16k GPUs, one
    # per 2.8 h); a smaller job sees fewer, and its own faults soon replace the guess.
    mtbf_s: float = seconds(21600.0, 1, 365 * DAY, why="a fault a second is no run at all")
    mtbf_prior_faults: int = num(3, 1, 1000)
    # What one accelerator (GPU) costs for one hour, in the currency the report shows it in:
    # `mainspring report` prices the run's accelerator-hours (wall time x world size) at
    # this rate (your contract's). 0: unpriced, the report shows accelerator-hours only.
    accelerator_hour_price: float = num(0.0, 0, 10**6)
    # Every this many steps rank 0 runs one optimizer step under torch.profiler and reports
    # its compute/communication overlap: exposed communication time / step time
    # (trainer/overlap.py, the `mainspring_comm_exposed_fraction` series). 0: off. The
    # profiled step is slower by the profiler's overhead: sample sparsely (e.g. 100).
    profile_every: int = num(0, 0, 10**9)

    def __post_init__(self) -> None:
        check_seconds(self)
        _positive(self, "metrics_every", "repeat_failure_limit", "mtbf_prior_faults")
        every = self.profile_every
        _require(isinstance(every, int) and not isinstance(every, bool) and every >= 0,
                 "profile_every", f"must be a whole number of steps >= 0, got {every!r}",
                 "set ops.profile_every to how many steps apart to profile one (e.g. 100), "
                 "or 0 to leave profiling off")
        price = self.accelerator_hour_price
        _require(isinstance(price, (int, float)) and math.isfinite(price) and price >= 0,
                 "accelerator_hour_price", f"must be a finite price >= 0, got {price!r}",
                 "set ops.accelerator_hour_price to what one accelerator costs per hour "
                 "(e.g. 2.5), or 0 to leave the report's costs unpriced")
