"""Activity names, task queues and I/O dataclasses: the workflow/activity boundary. (The
operator commands, the client/workflow boundary, are common/commands.py; what a run carries
across continue-as-new is workflows/carry.py.)

Stdlib only (with common/protocol.py, stdlib too): the workflow sandbox imports this.
Payloads stay small (DESIGN §3): URIs, steps and summaries, never tensors or per-step
arrays. Specs travel as their JSON dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    # the fault a decision answered, as its JSON object (common/faults.py Fault.to_json;
    # older code wrote {event_id, fault_ts, detected_ts, last_step, also}): this segment's
    # first attempt records the `recovered` naming it (activities/recovery.py)
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
    # operator rollback to before it (workflows/operator_queue.py:admit).
    oldest_committed_step: int | None = None
    # What train.checkpoint_every "auto" is chosen from (workflows/interval.py): failures
    # the activity answered itself without a Temporal retry (restarts in place; a retry
    # shows in `attempt`), the loop's total pause for its `checkpoints` checkpoints (the
    # launch that finished), and its mean step time (None: no step run).
    faults: int = 0
    checkpoint_stall_s: float = 0.0
    checkpoints: int = 0
    step_time_s: float | None = None
    # ranks whose copy of the weights disagreed with the others' ({"step", "ranks",
    # "node_ranks"}, trainer/replicas.py): the workflow counts their nodes as failing
    suspects: list[dict[str, Any]] = field(default_factory=list)
    # stopped="raise_batch": the gradient accumulation the trainer asks the next segments
    # to run with (a loss that shook, trainer/oscillation_watch.py)
    grad_accum_asked: int | None = None


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
    val_loss: float  # a pruned trial: its loss at the rung it stopped at
    run_id: str
    source: str = ""  # SOURCE_PRIOR for the scaling-law prior point (trial 0), else the sampler
    distributions: dict[str, str] = field(default_factory=dict)  # as SweepObservation's
    status: str = ""  # TRIAL_PRUNED when the pruner stopped it; "" in older histories
    rungs: list[list[float]] = field(default_factory=list)  # as SweepObservation's
    steps: int = 0  # steps it trained (0 in older histories: trial_steps)


@dataclass
class SweepResult:
    best_params: dict[str, float]
    trials: list[TrialResult]


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
    # the distill stage's record (workflows/distill.py), when the spec turned it on
    distilled: dict[str, Any] | None = None


# ---- the sweep's suggester (sweep/suggest.py: optuna), a local activity ----------
SUGGEST_TRIALS = "suggest_trials"
# where a point came from: the scaling-law prior (trial 0), optuna's sampler (spec
# sweep.sampler), or, in histories recorded before optuna, the initial design / the GP
SOURCE_PRIOR, SOURCE_TPE, SOURCE_GP, SOURCE_INITIAL = "prior", "tpe", "gp", "initial"


@dataclass
class SweepObservation:
    params: dict[str, float]
    val_loss: float | None  # None: the trial diverged (told at the worst finite loss seen)
    # optuna's distribution JSON per param, as suggested; empty in older histories: the
    # space's own distributions then
    distributions: dict[str, str] = field(default_factory=dict)
    dead: bool = False  # the trial ended without a result: told to optuna as FAIL
    pruned: bool = False  # stopped at a rung boundary by the pruner: told to optuna as PRUNED
    # [step, held-out loss] at each rung boundary the trial passed or stopped at (a sweep
    # with sweep.pruning): optuna's intermediate values
    rungs: list[list[float]] = field(default_factory=list)


@dataclass
class SuggestInput:
    sweep: dict[str, Any]  # the SweepConfig as its JSON dict (RunSpec.to_dict()["sweep"])
    observed: list[SweepObservation]  # every trial so far, in trial-index order
    count: int
    seed: int
    # the whole RunSpec's dict, for the scaling-law prior (sweep/prior.py); None in older
    # histories: no prior point
    spec: dict[str, Any] | None = None


@dataclass
class SuggestResult:
    points: list[dict[str, float]]
    source: str  # the sampler (SOURCE_TPE | SOURCE_GP); older histories: SOURCE_INITIAL too
    # per point: SOURCE_PRIOR for the scaling-law prior, else `source`; empty in older histories
    sources: list[str] = field(default_factory=list)
    # optuna's distribution JSON per param, the same for every point of the round
    distributions: dict[str, str] = field(default_factory=dict)


# ---- the sweep's pruner (sweep/prune.py: optuna's SuccessiveHalvingPruner), a local activity
PRUNE_TRIAL = "prune_trial"
# a trial's status as the Sweep workflow records it (sweep_trial events, PruneInput)
TRIAL_RUNNING, TRIAL_COMPLETE, TRIAL_DIVERGED, TRIAL_PRUNED = (
    "running", "complete", "diverged", "pruned")


@dataclass
class RungRecord:
    """One trial as the pruner sees it: its status and its held-out loss at each rung
    boundary it reached ([step, loss]; the last one, for the trial in question, the rung
    it just reached)."""

    status: str  # TRIAL_RUNNING | TRIAL_COMPLETE | TRIAL_DIVERGED | TRIAL_PRUNED
    rungs: list[list[float]] = field(default_factory=list)
    val_loss: float | None = None  # a complete trial's final held-out loss


@dataclass
class PruneInput:
    pruning: dict[str, Any]  # the PruningConfig as its JSON dict (spec sweep.pruning)
    trial_steps: int
    trials: list[RungRecord]  # every trial started so far, in trial-index order
    index: int  # the trial to decide on: running, its last rung value just measured


@dataclass
class PruneResult:
    prune: bool
    rung: int  # the rung whose boundary the trial reached (0: the first)
    step: int
    val_loss: float
    competing: int  # trials with a loss at this rung, this one included
    better: int  # of them, those with a lower loss


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
