"""The typed data that crosses the supervisor ↔ trainer-child process boundary.

`activities/contracts.py` types the Temporal boundary (workflow ↔ activity); this module
types the one below it, between an activity's supervisor and the `trainer/` child it
launches. Each record is a frozen stdlib dataclass with one `to_json` and one `from_json`,
so the writer and every reader agree on the field names by construction:

- `OperatorRollback`: an operator's `rollback` update, from the workflow's state through
  the activity input to the trainer's `--rollback` argument (applied once per `id`);
- `SegmentResult`: the segment's `result.json`, with its spike/eval `SegmentOutcome`;
- `ErrorReport`: the `error.json` of a classified failure (kind, message, retryability);
- `LaunchRequest`: what a warm trainer launcher (trainer/standby.py) is asked to start;
- the `progress.jsonl` lines rank 0 appends and the supervisor tails: `StartLine`,
  `StepLine`, `CommitLine`, `EvalLine` (`parse_line` reads any of them back).

Stdlib only: the workflow sandbox imports `OperatorRollback` through the contracts.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar


def _from_dict(cls: type, raw: dict[str, Any]) -> Any:
    """Build `cls` from a dict, ignoring keys it does not know (a newer writer's extras)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in raw.items() if k in names})


class _Json:
    """One `to_json` / `from_json` pair for every record of this module."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, raw: str | dict[str, Any]):
        return _from_dict(cls, json.loads(raw) if isinstance(raw, str) else raw)


def launch_tag(attempt: int, restart: int = 0) -> str:
    """Pure: a segment launch in event ids — the activity attempt `N`, then `N.k` for the
    k-th restart in place of that attempt (activities/launch.py)."""
    return f"{attempt}.{restart}" if restart else str(attempt)


# ---- a warm launch ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchRequest(_Json):
    """Start `procs` ranks of `python -m <module> <args>` on this node from an already
    imported interpreter (trainer/standby.py): the node's share of `nnodes` x `procs` ranks
    meeting at `master_addr:master_port` (port 0 on one node: a free loopback port), in
    `cwd`, with exactly `env`, output appended to `log`."""

    module: str
    args: list[str]
    procs: int
    cwd: str
    log: str
    env: dict[str, str]
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0


# ---- an operator's rollback ----------------------------------------------------------------
@dataclass(frozen=True)
class OperatorRollback(_Json):
    """Roll back to the newest checkpoint at or before `to_step`; the abandoned trajectory
    ran to `through_step`. With `skip_data`, the data those steps read is skipped."""

    id: str  # "<run_id>/<command id>": its `rollback` event makes a retry apply it once
    to_step: int
    through_step: int
    skip_data: bool = False
    note: str = ""
    who: str = ""

    @property
    def event_id(self) -> str:
        return f"operator_rollback/{self.id}"


# ---- result.json and error.json --------------------------------------------------------------
@dataclass
class SegmentOutcome(_Json):
    """What the segment reports about spikes and evaluation (trainer/guard.py)."""

    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    overflow_steps: int = 0
    evals: list[list[float]] = field(default_factory=list)  # online: [step, train, val]
    # "" | rollback_budget | overfitting | interrupted (a graceful stop) | rollback_refused
    stopped: str = ""
    # silent data corruption suspected: {"step", "ranks", "node_ranks"} per rollback whose
    # ranks' copies of the weights disagreed (trainer/replicas.py)
    suspects: list[dict[str, Any]] = field(default_factory=list)
    # a loss that shakes with a gradient noise scale well above the batch: the gradient
    # accumulation the trainer asks the workflow to go on with (trainer/oscillation_watch.py)
    grad_accum_asked: int | None = None


@dataclass(frozen=True)
class SegmentResult(_Json):
    """`result.json`: where the segment ended and what it saw (written by rank 0 on exit 0)."""

    final_step: int
    last_committed_step: int | None
    last_committed_uri: str | None
    train_loss: float | None  # None when nothing was trained (an idempotent retry)
    tokens_seen: int
    steps_run: int
    resumed_from: int | None
    outcome: SegmentOutcome = field(default_factory=SegmentOutcome)
    throughput: dict[str, Any] = field(default_factory=dict)  # trainer/throughput.py summary
    # the step loop's pause for its checkpoints (the `checkpoint_saved` events' pause_s),
    # summed, and how many: the checkpoint cost of train.checkpoint_every "auto"
    checkpoint_stall_s: float = 0.0
    checkpoints: int = 0

    @classmethod
    def from_json(cls, raw: str | dict[str, Any]) -> SegmentResult:
        d = json.loads(raw) if isinstance(raw, str) else dict(raw)
        d["outcome"] = SegmentOutcome.from_json(d.get("outcome") or {})
        return _from_dict(cls, d)


@dataclass(frozen=True)
class ErrorReport(_Json):
    """`error.json`: a classified failure — its kind, message and whether it will repeat."""

    type: str
    message: str
    retryable: bool = True  # the type's own class decides too (common/errors.NON_RETRYABLE)
    # an exception outside the MainspringError classes (a bug, an OOM): where it was raised,
    # `file.py:LINE in func` of the innermost frame — with the type, the signature of a
    # failure that repeats (activities/recovery.py)
    frame: str = ""


# ---- progress.jsonl ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class _Line(_Json):
    kind: ClassVar[str]
    ts: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        # Shallow: a line holds plain values only, and the step loop writes one a step
        # (dataclasses.asdict's deep copy cost more than the JSON encoding).
        return {"type": self.kind, **{f.name: getattr(self, f.name)
                                      for f in dataclasses.fields(self)}}


@dataclass(frozen=True, kw_only=True)
class StartLine(_Line):
    """The child is up and restored: where it resumed (None: a fresh start at step 0)."""

    kind: ClassVar[str] = "start"
    resumed_from: int | None
    world_size: int
    to_step: int
    attempt: int
    restart: int = 0  # the attempt's restarts in place before this launch
    params: int = 0
    packing: bool = False
    flops_per_token: float = 0.0
    peak_tflops: float = 0.0
    peak_source: str = ""
    restore_s: float = 0.0  # reading the checkpoint it resumed from (0: a fresh start)
    restore_tier: str = ""  # where it came from: fast | durable ("" on a fresh start)
    checkpoint_every: int = 0  # the steps between its checkpoints (the hang watch's phases)


@dataclass(frozen=True, kw_only=True)
class StepLine(_Line):
    """One optimizer step (1-based), with its verdict: ok | skip | rollback."""

    kind: ClassVar[str] = "step"
    step: int
    loss: float | None  # None: not finite
    lr: float
    verdict: str = "ok"
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    mfu: float | None = None
    peak_mem_bytes: int | None = None
    # Added for the worker's Prometheus series; absent (None) in older lines and
    # in steps that did not sample them (trainer/step_metrics.py).
    grad_norm: float | None = None  # 2-norm of the step's gradients, before clipping
    # every ops.metrics_every steps, for each rank of the node: [rank, peak allocated, peak
    # reserved] bytes (CPU: [rank, peak RSS, current RSS])
    mem_by_rank: list[list[int]] | None = None
    # every ops.profile_every steps: the profiled step's exposed communication time, and
    # that time / the step's time (trainer/overlap.py)
    comm_exposed_s: float | None = None
    comm_exposed_frac: float | None = None
    SAMPLED: ClassVar[tuple[str, ...]] = ("mem_by_rank", "comm_exposed_s", "comm_exposed_frac")

    def to_dict(self) -> dict[str, Any]:
        """A step that did not sample them leaves the sampled fields out of its line."""
        return {k: v for k, v in super().to_dict().items()
                if v is not None or k not in self.SAMPLED}


@dataclass(frozen=True, kw_only=True)
class CommitLine(_Line):
    """A checkpoint is durably committed (its manifest is written): heartbeat material."""

    kind: ClassVar[str] = "commit"
    step: int
    uri: str
    bytes: int = 0
    # the loop's pause to save this checkpoint, and its snapshot -> durable commit time;
    # None for a commit announced again at a restore
    stall_s: float | None = None
    upload_lag_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class EvalLine(_Line):
    """An online evaluation (train.eval_every)."""

    kind: ClassVar[str] = "eval"
    step: int
    val_loss: float
    train_loss: float | None = None


ProgressLine = StartLine | StepLine | CommitLine | EvalLine
LINE_KINDS: dict[str, type] = {c.kind: c for c in (StartLine, StepLine, CommitLine, EvalLine)}


def parse_line(text: str) -> ProgressLine | None:
    """One progress.jsonl line back as its record; None for a blank or unknown line (a
    newer writer's kind) — a torn last line raises json.JSONDecodeError."""
    if not text.strip():
        return None
    raw = json.loads(text)
    cls = LINE_KINDS.get(raw.get("type"))
    return _from_dict(cls, raw) if cls else None
