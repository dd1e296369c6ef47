"""Activity names, task queues and I/O dataclasses — the workflow/activity boundary — and
the operator commands TrainingRun's updates take (the client/workflow boundary, shared by
the workflow's validators and `mainspring run`).

Stdlib only (with common/protocol.py, stdlib too): the workflow sandbox imports this.
Payloads stay small (DESIGN §3): URIs, steps and summaries, never tensors or per-step
arrays. Specs travel as their JSON dict.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from common.limits import MAX_STEP
from common.protocol import OperatorRollback

ORCHESTRATOR_QUEUE = "mainspring-orchestrator"
DATA_QUEUE = "mainspring-data"
TRAINER_QUEUE = "mainspring-trainer"

PREPARE_DATA = "prepare_data"
TRAIN_SEGMENT = "train_segment"
EVALUATE = "evaluate"
PROMOTE = "promote"
SCRUB_CHECKPOINTS = "scrub_checkpoints"  # data queue: read back what a fallback would need
RECORD_EVENT = "record_event"

WORKFLOW_TYPE = "TrainingRun"
SWEEP_WORKFLOW_TYPE = "Sweep"
# TrainingRun's stages, in order (workflows/training_run.py runs them from this)
STAGES = ("prepare_data", "warmup_sweep", "train", "evaluate", "promote")

# ---- nodes: the trainer workers a multi-node segment is gang-scheduled on --------------
# (workflows/nodes.py: the registry; workflows/gang.py: the choice and the launch)
NODE_REGISTRY_TYPE = "NodeRegistry"
NODE_REGISTRY_ID = "mainspring-nodes"  # one long-lived registry workflow per namespace
ANNOUNCE = "announce"  # the registry's signal: a node's NodeInfo, every few seconds
LEAVE = "leave"  # ... and its name, when its worker stops
LIST_NODES = "list_nodes"  # local activity of the orchestrator: the registry's nodes, now
NODE_TTL_S = 15.0  # a node that has not announced itself for this long is not healthy


def node_queue(name: str) -> str:
    """The task queue of one node's trainer worker (it also polls TRAINER_QUEUE)."""
    return f"{TRAINER_QUEUE}@{name}"


@dataclass(frozen=True)
class NodeInfo:
    """A trainer worker as it announces itself (`mainspring worker --node ...`)."""

    name: str
    queue: str
    address: str  # where the other nodes reach it (the rendezvous store when it leads)
    rdzv_port: int
    procs: int  # ranks it runs (GPUs on a GPU node)
    gpus: int = 0
    busy: str = ""  # what it runs now ("" idle): a segment from another run keeps it
    seen: float = 0.0  # when the registry last heard from it (the registry's clock)
    worker: str = ""  # the worker process's identity (a restarted worker has a new one)


@dataclass
class ListNodesResult:
    nodes: list[NodeInfo]
    now: float  # the activity's clock, against which `seen` says how old an announcement is


@dataclass(frozen=True)
class GangMember:
    """One node's share of a multi-node segment: torchrun's static rendezvous (node ranks
    are the workflow's choice; docs/decisions.md) and the launch's id."""

    node: str
    node_rank: int
    nnodes: int
    master: str  # host:port of node 0's rendezvous store
    session: str  # unique per launch: a part left by an earlier launch is never merged


@dataclass
class PrepareDataInput:
    spec: dict[str, Any]


@dataclass
class PrepareDataResult:
    manifest_uri: str
    cache_hit: bool
    docs_out: int
    train_tokens: int
    val_tokens: int
    vocab_size: int


@dataclass
class TrainSegmentInput:
    spec: dict[str, Any]
    dataset_uri: str
    from_step: int
    to_step: int
    lr_windows: list[list[float]] = field(default_factory=list)  # [start, end, factor]
    max_rollbacks: int = -1  # end the segment after more rollbacks than this (-1: no limit)
    # an operator's `rollback` update, applied once by this segment (its id's event)
    rollback: OperatorRollback | None = None
    # The same under its old name, as a segment scheduled by earlier code carries it (the
    # converter would drop an unknown key, and a retry would train without the rollback):
    # moved into `rollback`. Remove once no run started before the rename is in flight.
    rewind: dict[str, Any] | None = None
    # each micro-batch as this many chunks: the run's answer to an out-of-memory
    # (workflows/adapt.py; the same global batch and data order)
    micro_split: int = 1
    # the fault a decision answered ({event_id, fault_ts, detected_ts, last_step}): this
    # segment's first attempt records the `recovered` naming it (activities/recovery.py)
    after_fault: dict[str, Any] | None = None
    # a multi-node segment: this node's share (None: one node, the shared trainer queue)
    gang: GangMember | None = None
    # steps between checkpoints as the workflow chose them for train.checkpoint_every
    # "auto" (workflows/interval.py); 0: the spec's number
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        if self.rewind and self.rollback is None:
            self.rollback = OperatorRollback.from_json(self.rewind)
        self.rewind = None


@dataclass
class TrainSegmentResult:
    final_step: int
    last_committed_step: int
    last_committed_uri: str
    train_loss: float | None  # None when the segment had already finished (idempotent retry)
    resumed_from: int | None
    attempt: int
    rollbacks: list[dict[str, Any]] = field(default_factory=list)  # trainer.guard records
    skipped_steps: list[int] = field(default_factory=list)
    # "" | rollback_budget | overfitting | interrupted (graceful stop) | rollback_refused (an
    # operator rollback whose target retention removed: final_step is the run's newest commit)
    stopped: str = ""
    evals: list[list[float]] = field(default_factory=list)  # online: [step, train, val]
    # the oldest step with a committed checkpoint left on the durable tier after the segment
    # (retention may have removed older ones); None: unknown. The workflow refuses an
    # operator rollback to before it (workflows/operator.py:admit).
    oldest_committed_step: int | None = None
    # What train.checkpoint_every "auto" is chosen from (workflows/interval.py): failures
    # the activity answered itself without a Temporal retry (restarts in place; a retry
    # shows in `attempt`), the loop's total pause for its `checkpoints` checkpoints (the
    # launch that finished), and its mean step time (None: no step run).
    faults: int = 0
    checkpoint_stall_s: float = 0.0
    checkpoints: int = 0
    step_time_s: float | None = None


@dataclass
class EvaluateInput:
    spec: dict[str, Any]
    dataset_uri: str
    steps: list[int]


@dataclass
class EvalPoint:
    step: int
    val_loss: float
    perplexity: float


@dataclass
class EvaluateResult:
    results: list[EvalPoint]


@dataclass
class PromoteInput:
    spec: dict[str, Any]
    step: int


@dataclass
class PromoteResult:
    step: int
    uri: str
    bytes: int


@dataclass
class ScrubInput:
    spec: dict[str, Any]


@dataclass
class ScrubResult:
    """What one scrub pass found (storage/scrub.py:ScrubReport): steps, never file data."""

    needed: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    uncommitted: list[int] = field(default_factory=list)
    needs_attention: list[int] = field(default_factory=list)
    promoted_corrupt: list[int] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0


@dataclass
class RecordEventInput:
    durable: str
    run_id: str
    kind: str
    event_id: str
    step: int | None = None
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass
class SweepInput:
    spec: dict[str, Any]
    dataset_uri: str


@dataclass
class TrialResult:
    params: dict[str, float]
    val_loss: float
    run_id: str


@dataclass
class SweepResult:
    best_params: dict[str, float]
    trials: list[TrialResult]


# ---- operator commands: TrainingRun's updates and its abort signal (DESIGN §6) ----------
# Their input as it arrives: a JSON object, or a bare string (or nothing) as the command's
# note. Temporal decodes it no further; `<Command>.from_json` does (docs/decisions.md).
CommandInput = dict[str, Any] | str | None
MAX_LR_SCALE = 10.0


class Refused(ValueError):
    """An operator command that cannot be accepted now; the message says why and what to do."""


def as_object(raw: CommandInput) -> dict[str, Any]:
    """The input as a JSON object: a bare string (or nothing) is the note."""
    return {"note": raw or ""} if raw is None or isinstance(raw, str) else raw


def field_means(means: str) -> Any:
    """A required field; `means` completes "<command>: <field> is required (...)"."""
    return field(metadata={"means": means})


def _require(cmd: Command, ok: bool, name: str, must: str) -> None:
    if not ok:
        raise Refused(f"{cmd.name}: {name} must be {must}, got {getattr(cmd, name)!r}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, kw_only=True)
class Command:
    """What every operator command has: who sent it and why (its `operator` event). Each
    subclass is one update (or the signal) and checks its own fields in __post_init__."""

    name: ClassVar[str]  # the update's (signal's) name
    who: str = ""
    note: str = ""  # "reason" on the wire too

    def to_dict(self) -> dict[str, Any]:
        """The JSON object the update takes (what `mainspring run` sends)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: CommandInput, *, strict: bool = True) -> Self:
        """The command from its input, or Refused naming the field that is wrong. The
        validators read `strict`ly. Not strict (a command already admitted, read again;
        the abort signal, which has no validator) a field another command takes is
        ignored, as the one untyped parser did: histories from then replay the same."""
        obj = as_object(raw)
        if not isinstance(obj, dict):
            raise Refused(f"{cls.name}: expected a JSON object, got {type(obj).__name__}")
        own = {f.name for f in dataclasses.fields(cls)} | {"reason"}
        if unknown := sorted(set(obj) - (own if strict else ANY_FIELD)):
            raise Refused(f"{cls.name}: unknown field(s) {unknown}; known: {sorted(own)}")
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING and f.name not in obj:
                raise Refused(f"{cls.name}: {f.name} is required ({f.metadata['means']})")
        given = {k: v for k, v in obj.items() if k in own - {"who", "note", "reason"}}
        return cls(who=str(obj.get("who") or ""),
                   note=str(obj.get("note") or obj.get("reason") or ""), **given)


@dataclass(frozen=True, kw_only=True)
class Pause(Command):
    name: ClassVar[str] = "pause"


@dataclass(frozen=True, kw_only=True)
class Resume(Command):
    name: ClassVar[str] = "resume"


@dataclass(frozen=True, kw_only=True)
class Abort(Command):
    name: ClassVar[str] = "abort"


@dataclass(frozen=True, kw_only=True)
class Rollback(Command):
    name: ClassVar[str] = "rollback"
    to_step: int = field_means("the step to go back to")
    skip_data: bool = True

    def __post_init__(self) -> None:
        _require(self, _is_int(self.to_step) and self.to_step >= 0, "to_step", "an integer >= 0")
        _require(self, self.to_step <= MAX_STEP, "to_step", f"at most {MAX_STEP} (MAX_STEP)")
        _require(self, isinstance(self.skip_data, bool), "skip_data", "true or false")


@dataclass(frozen=True, kw_only=True)
class SetLrScale(Command):
    name: ClassVar[str] = "set_lr_scale"
    scale: float = field_means(f"a number in (0, {MAX_LR_SCALE:g}]")
    steps: int = 0  # 0: to the end of the run

    def __post_init__(self) -> None:
        x = self.scale
        _require(self, isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
               and 0 < x <= MAX_LR_SCALE, "scale", f"a number in (0, {MAX_LR_SCALE:g}]")
        _require(self, _is_int(self.steps) and self.steps >= 0, "steps",
               "an integer >= 0 (0: to the end of the run)")
        _require(self, self.steps <= MAX_STEP, "steps", f"at most {MAX_STEP} (MAX_STEP)")
        object.__setattr__(self, "scale", float(x))


COMMANDS: dict[str, type[Command]] = {
    c.name: c for c in (Pause, Resume, Rollback, SetLrScale, Abort)}
ANY_FIELD = {f.name for c in COMMANDS.values() for f in dataclasses.fields(c)} | {"reason"}


def command(name: str, raw: CommandInput, *, strict: bool = True) -> Command:
    """The typed command `name` from its input (Command.from_json)."""
    if name not in COMMANDS:
        raise Refused(f"unknown command {name!r}; use one of {', '.join(COMMANDS)}")
    return COMMANDS[name].from_json(raw, strict=strict)


# RunCarry keys older code wrote, and their names now (the rollback has one name everywhere)
LEGACY_CARRY_KEYS = {"rewind": "pending_rollback", "rewind_pins": "rollback_pins"}


@dataclass
class RunCarry:
    """State carried across continue-as-new: what is done, never how it was computed."""

    dataset_uri: str = ""
    best_params: dict[str, float] = field(default_factory=dict)
    next_step: int = 0
    train_loss: float | None = None
    segments_total: int = 0
    runs: int = 1  # workflow runs so far (continue-as-new count + 1)
    stages_done: list[str] = field(default_factory=list)
    # spike escalation (workflows/policy.py:escalate); only what it can still count is kept
    # (policy.still_counted), the total in rollbacks_total
    rollback_steps: list[int] = field(default_factory=list)  # steps where the trainer rolled back
    lowered_at: list[int] = field(default_factory=list)  # steps where the LR was lowered
    rollbacks_total: int = 0  # trainer rollbacks over the whole run
    # disjoint [start, end, factor] pieces (workflows/operator.py:compose_windows), bounded
    lr_windows: list[list[float]] = field(default_factory=list)
    oldest_step: int = 0  # the oldest committed checkpoint's step (from the last segment)
    budget_from: int = 0  # rollbacks before this step no longer count (set by a resume)
    pauses: int = 0
    early_stopped: str = ""
    # operator commands (workflows/operator.py): accepted, not yet applied
    # ({id, name, raw: the update's input as sent, accepted_at_step, pin?})
    operator_queue: list[dict[str, Any]] = field(default_factory=list)
    operator_actions: int = 0  # commands accepted so far (their ids)
    pending_rollback: OperatorRollback | None = None  # an operator rollback no segment has applied
    rollback_pins: list[str] = field(default_factory=list)  # its target's pins (storage/rollback)
    # paused / needs_attention: {"stage", "reason", "who"} while the run waits for `resume`,
    # so a run continued-as-new while held goes on holding (workflows/commands.py:_hold)
    held: dict[str, Any] | None = None
    # the run's trace: its id and the root and open stage spans' ids and start times, so
    # every workflow run of the chain is one trace (workflows/tracing.py)
    trace: dict[str, Any] = field(default_factory=dict)
    # after out-of-memory failures: each micro-batch runs as this many chunks from then on
    # (workflows/adapt.py), with the oom_adapted events saying why
    micro_split: int = 1
    after_fault: dict[str, Any] | None = None  # TrainSegmentInput.after_fault, until it ran
    # multi-node runs (workflows/gang.py): nodes the segments run on now (0: train.nodes;
    # fewer once elastic), each node's gang failures in a row, the nodes set aside (name ->
    # evidence), gang launches so far (their sessions), and why the run waits for nodes
    nodes_used: int = 0
    node_failures: dict[str, int] = field(default_factory=dict)
    set_aside: dict[str, str] = field(default_factory=dict)
    gang_launches: int = 0
    waiting: dict[str, Any] | None = None
    gang_repeat: dict[str, Any] = field(default_factory=dict)  # {fingerprint, repeats}
    # the measurements train.checkpoint_every "auto" is chosen from (workflows/interval.py):
    # the wall time of the run's segments (workflow.now() around each, retries and
    # recoveries included: the time faults can strike in), the faults seen in it (retried
    # attempts, restarts in place, decisions, failed gang launches), the checkpoint stall
    # summed over `checkpoints_measured` checkpoints, the last segment's mean step time,
    # and how many intervals were chosen (their event ids)
    train_wall_s: float = 0.0
    faults_seen: int = 0
    checkpoint_stall_s: float = 0.0
    checkpoints_measured: int = 0
    step_time_s: float = 0.0
    intervals_chosen: int = 0
    checkpoint_every: int = 0  # the last chosen (0: none, the spec's number)

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> RunCarry:
        """The carry a continued run gets, from its JSON object (None: the chain's first
        run). A carry written by older code still reads: its legacy keys are renamed, and
        keys this code does not know are ignored."""
        d = dict(raw or {})
        for old, new in LEGACY_CARRY_KEYS.items():
            if old in d:
                d.setdefault(new, d.pop(old))
        if d.get("pending_rollback") is not None:
            d["pending_rollback"] = OperatorRollback.from_json(d["pending_rollback"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class RunResult:
    run_id: str
    status: str
    stages: list[str]
    initial_val_loss: float
    final_val_loss: float
    final_step: int
    promoted_checkpoint: str
    best_params: dict[str, float]
    workflow_runs: int


# ---- the sweep's Bayesian suggester (sweep/suggest.py), a local activity ----------
SUGGEST_TRIALS = "suggest_trials"
SOURCE_INITIAL, SOURCE_GP = "initial", "gp"


@dataclass
class SweepObservation:
    params: dict[str, float]
    val_loss: float | None  # None: the trial diverged (non-finite held-out loss)


@dataclass
class SuggestInput:
    sweep: dict[str, Any]  # the SweepConfig as its JSON dict (RunSpec.to_dict()["sweep"])
    observed: list[SweepObservation]  # every trial so far, in trial-index order
    count: int
    seed: int


@dataclass
class SuggestResult:
    points: list[dict[str, float]]
    source: str  # SOURCE_INITIAL (no observations yet: initial design) | SOURCE_GP


# ---- the run-id claim (storage/runs.py), a local activity of the orchestrator ----------
CLAIM_RUN = "claim_run"


@dataclass
class ClaimRunInput:
    durable: str
    run_id: str
    spec_hash: str  # RunSpec.spec_hash() of the workflow's input spec
    spec: dict[str, Any]  # recorded in runs/<run_id>/RUN.json for whoever finds the id taken


# ---- the root a spec's relative paths are anchored at (spec/paths.py): a local activity
# of the orchestrator, no input; answers `mainspring worker --spec-root` (ops/worker.py)
SPEC_ROOT = "spec_root"


# ---- pins: an admitted operator rollback's target, kept from retention until applied ----
PIN_ROLLBACK = "pin_rollback"


@dataclass
class PinInput:
    durable: str
    run_id: str
    pin_ids: list[str]
    to_step: int | None = None  # None: release the pins
