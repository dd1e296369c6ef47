"""Activity names, task queues and I/O dataclasses — the workflow/activity boundary.

Stdlib only: the workflow sandbox imports this. Payloads stay small (DESIGN §3): URIs,
steps and summaries, never tensors or per-step arrays. Specs travel as their JSON dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ORCHESTRATOR_QUEUE = "mainspring-orchestrator"
DATA_QUEUE = "mainspring-data"
TRAINER_QUEUE = "mainspring-trainer"

PREPARE_DATA = "prepare_data"
TRAIN_SEGMENT = "train_segment"
EVALUATE = "evaluate"
PROMOTE = "promote"
RECORD_EVENT = "record_event"

WORKFLOW_TYPE = "TrainingRun"
SWEEP_WORKFLOW_TYPE = "Sweep"
STAGES = ("prepare_data", "warmup_sweep", "train", "evaluate", "promote")


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
    # an operator's `rollback` update, applied once by this segment (trainer/guard.py):
    # {"id", "to_step", "through_step", "skip_data", "note", "who"}
    rewind: dict[str, Any] | None = None


@dataclass
class TrainSegmentResult:
    final_step: int
    last_committed_step: int
    last_committed_uri: str
    train_loss: float | None  # None when the segment had already finished (idempotent retry)
    resumed_from: int | None
    attempt: int
    lost_steps: int = 0
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
    # operator commands (workflows/operator.py): accepted, not yet applied ({id, name, raw})
    operator_queue: list[dict[str, Any]] = field(default_factory=list)
    operator_actions: int = 0  # commands accepted so far (their ids)
    rewind: dict[str, Any] | None = None  # an operator rollback no segment has applied yet
    rewind_pins: list[str] = field(default_factory=list)  # its targets' pins (storage/rollback.py)
    # paused / needs_attention: {"stage", "reason", "who"} while the run waits for `resume`,
    # so a run continued-as-new while held goes on holding (workflows/training_run.py:_hold)
    held: dict[str, Any] | None = None


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


# ---- pins: an admitted operator rollback's target, kept from retention until applied ----
PIN_ROLLBACK = "pin_rollback"


@dataclass
class PinInput:
    durable: str
    run_id: str
    pin_ids: list[str]
    to_step: int | None = None  # None: release the pins
