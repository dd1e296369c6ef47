"""RunCarry: what a TrainingRun carries across continue-as-new — what is done, never how it
was computed — as a few typed records: the spike escalation, the operator queue, the hold,
the gang and the checkpoint interval's measurements, beside the run's progress.

On the wire (the continue-as-new input, so in every recorded history) the carry is one flat
JSON object, as it was before the records: `to_json` writes each record's fields side by
side under their flat keys and `from_json` reads them back (docs/decisions.md, record 75).
A carry written by older code reads the same, and so does one written by this code on a
worker still running the older code (a rolling deploy): the shape never changed.

Deterministic and I/O-free; stdlib only (with common/protocol.py and common/faults.py): the
sandbox imports it.
The pure views and updates of a carry are workflows/carry_updates.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from common.faults import Fault
from common.protocol import OperatorRollback

# keys older code wrote, and their names now (the rollback has one name everywhere)
LEGACY_CARRY_KEYS = {"rewind": "pending_rollback", "rewind_pins": "rollback_pins"}


def wire(key: str, **kw: Any) -> Any:
    """A record's field stored under the flat key `key` (its own name would stutter)."""
    return field(metadata={"wire": key}, **kw)


@dataclass
class Escalation:
    """Spike escalation (workflows/escalation.py:escalate). Only what it can still count is
    kept (escalation.still_counted); the total is in rollbacks_total."""

    rollback_steps: list[int] = field(default_factory=list)  # steps where the trainer rolled back
    lowered_at: list[int] = field(default_factory=list)  # steps where the LR was lowered
    rollbacks_total: int = 0  # trainer rollbacks over the whole run
    # disjoint [start, end, factor] pieces (workflows/lr_windows.py:compose_windows), bounded
    lr_windows: list[list[float]] = field(default_factory=list)
    budget_from: int = 0  # rollbacks before this step no longer count (set by a resume)


@dataclass
class OperatorQueue:
    """Operator commands (workflows/operator_queue.py): accepted, not yet applied, and the
    rollback applied but not yet trained from."""

    # {id, name, raw: the update's input as sent, accepted_at_step, pin?}
    queue: list[dict[str, Any]] = wire("operator_queue", default_factory=list)
    actions: int = wire("operator_actions", default=0)  # commands accepted so far (their ids)
    pending_rollback: OperatorRollback | None = None  # an operator rollback no segment has applied
    rollback_pins: list[str] = field(default_factory=list)  # its target's pins (storage/rollback)


@dataclass
class Hold:
    """paused / needs_attention: {"stage", "reason", "who"} while the run waits for
    `resume`, so a run continued-as-new while held goes on holding
    (workflows/operator_handlers.py:_hold); and how many holds so far."""

    held: dict[str, Any] | None = None
    pauses: int = 0


@dataclass
class Gang:
    """Multi-node runs (workflows/gang.py): nodes the segments run on now (0: train.nodes;
    fewer once elastic), each node's gang failures in a row, the nodes set aside (name ->
    evidence), gang launches so far (their sessions), why the run waits for nodes, and the
    repeated failure ({fingerprint, repeats})."""

    nodes_used: int = 0
    node_failures: dict[str, int] = field(default_factory=dict)
    set_aside: dict[str, str] = field(default_factory=dict)
    launches: int = wire("gang_launches", default=0)
    waiting: dict[str, Any] | None = None
    repeat: dict[str, Any] = wire("gang_repeat", default_factory=dict)


@dataclass
class IntervalInputs:
    """What train.checkpoint_every "auto" is chosen from (workflows/interval.py): the wall
    time of the run's segments (workflow.now() around each, retries and recoveries included:
    the time faults can strike in), the faults seen in it (retried attempts, restarts in
    place, decisions, failed gang launches), the checkpoint stall summed over
    `checkpoints_measured` checkpoints, the last segment's mean step time, how many
    intervals were chosen (their event ids) and the last chosen (0: none, the spec's)."""

    train_wall_s: float = 0.0
    faults_seen: int = 0
    checkpoint_stall_s: float = 0.0
    checkpoints_measured: int = 0
    step_time_s: float = 0.0
    chosen: int = wire("intervals_chosen", default=0)
    checkpoint_every: int = 0


@dataclass
class RunCarry:
    """State carried across continue-as-new: the run's progress and its records."""

    RECORDS: ClassVar[dict[str, type]] = {"escalation": Escalation, "operator": OperatorQueue,
                                          "hold": Hold, "gang": Gang, "interval": IntervalInputs}

    dataset_uri: str = ""
    best_params: dict[str, float] = field(default_factory=dict)
    next_step: int = 0
    train_loss: float | None = None
    segments_total: int = 0
    runs: int = 1  # workflow runs so far (continue-as-new count + 1)
    stages_done: list[str] = field(default_factory=list)
    oldest_step: int = 0  # the oldest committed checkpoint's step (from the last segment)
    early_stopped: str = ""
    # the run's trace: its id and the root and open stage spans' ids and start times, so
    # every workflow run of the chain is one trace (workflows/tracing.py)
    trace: dict[str, Any] = field(default_factory=dict)
    # after out-of-memory failures: each micro-batch runs as this many chunks from then on
    # (workflows/adapt.py), with the oom_adapted events saying why
    micro_split: int = 1
    # after a loss that shook with a gradient noise scale well above the batch: the
    # gradient accumulation segments run with from then on (0: the spec's; carry_updates.py
    # raise_batch), with the batch_raised events saying why
    grad_accum: int = 0
    # the fault the next segment's `recovered` answers, until it ran (TrainSegmentInput
    # .after_fault); on the wire its JSON object (common/faults.py, a superset of the
    # {event_id, fault_ts, detected_ts, last_step, also} older code wrote and reads)
    after_fault: Fault | None = None
    escalation: Escalation = field(default_factory=Escalation)
    operator: OperatorQueue = field(default_factory=OperatorQueue)
    hold: Hold = field(default_factory=Hold)
    gang: Gang = field(default_factory=Gang)
    interval: IntervalInputs = field(default_factory=IntervalInputs)

    def to_json(self) -> dict[str, Any]:
        """The flat JSON object continue-as-new carries: the keys of WIRE_KEYS, each
        record's fields side by side with the progress fields."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in self.RECORDS}
        flat["after_fault"] = self.after_fault.to_json() if self.after_fault else None
        for name in self.RECORDS:
            record = getattr(self, name)
            flat |= {_key(f): getattr(record, f.name) for f in dataclasses.fields(record)}
        return dataclasses.asdict(_Flat(flat))["values"]

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> RunCarry:
        """The carry a continued run gets, from its flat JSON object (None: the chain's
        first run). A carry written by older code still reads: its legacy keys are renamed,
        and keys this code does not know are ignored."""
        d = dict(raw or {})
        for old, new in LEGACY_CARRY_KEYS.items():
            if old in d:
                d.setdefault(new, d.pop(old))
        if d.get("pending_rollback") is not None:
            d["pending_rollback"] = OperatorRollback.from_json(d["pending_rollback"])
        if d.get("after_fault") is not None:
            d["after_fault"] = Fault.from_json(d["after_fault"])
        records = {name: _record(kind, d) for name, kind in cls.RECORDS.items()}
        own = {f.name for f in dataclasses.fields(cls)} - set(cls.RECORDS)
        return cls(**{k: v for k, v in d.items() if k in own}, **records)


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("wire", f.name)


def _record(kind: type, d: dict[str, Any]) -> Any:
    """One record from the flat object: its fields under their flat keys."""
    return kind(**{f.name: d[_key(f)] for f in dataclasses.fields(kind) if _key(f) in d})


@dataclass
class _Flat:
    """dataclasses.asdict of the flat mapping: the pending rollback (a dataclass) becomes a
    JSON object as Temporal's converter wrote it when the carry itself was the input."""

    values: dict[str, Any]


# Every flat key: the carry's fields before the records, each still one key on the wire
# (tests/workflows/test_carry.py holds to_json to them).
WIRE_KEYS = (
    "dataset_uri", "best_params", "next_step", "train_loss", "segments_total", "runs",
    "stages_done", "rollback_steps", "lowered_at", "rollbacks_total", "lr_windows",
    "oldest_step", "budget_from", "pauses", "early_stopped", "operator_queue",
    "operator_actions", "pending_rollback", "rollback_pins", "held", "trace", "micro_split",
    "grad_accum", "after_fault", "nodes_used", "node_failures", "set_aside", "gang_launches", "waiting",
    "gang_repeat", "train_wall_s", "faults_seen", "checkpoint_stall_s", "checkpoints_measured",
    "step_time_s", "intervals_chosen", "checkpoint_every")
