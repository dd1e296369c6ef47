"""Pure recovery policy: timeouts and retry policies per activity, sweep rounds, trial specs.

Deterministic and I/O-free; imported by the workflows inside the sandbox.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

from common.errors import NON_RETRYABLE
from spec import RunSpec, SpikeConfig, SweepConfig

RETRYABLE_FOREVER = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                                maximum_interval=timedelta(seconds=30), maximum_attempts=0,
                                non_retryable_error_types=list(NON_RETRYABLE))


# A segment's retry follows a lost worker: the heartbeat timeout has already waited, so the
# first retry goes at once (0.2 s: a recovery counts in seconds). A failure that repeats is
# stopped by the repeat budget (activities/recovery.py), not by this backoff.
SEGMENT_RETRY = RetryPolicy(initial_interval=timedelta(seconds=0.2), backoff_coefficient=2.0,
                            maximum_interval=timedelta(seconds=30), maximum_attempts=0,
                            non_retryable_error_types=list(NON_RETRYABLE))


def segment_options(spec: RunSpec) -> dict:
    """train_segment: unlimited retries bounded by a schedule-to-close budget (DESIGN §3)."""
    return {"schedule_to_close_timeout": timedelta(seconds=spec.ops.segment_budget_s),
            "heartbeat_timeout": timedelta(seconds=spec.ops.heartbeat_timeout_s),
            "retry_policy": SEGMENT_RETRY}


def short_options(spec: RunSpec, hours: float = 6.0) -> dict:
    """Data prep, evaluation, promotion: heartbeating, retried, bounded to `hours`."""
    return {"schedule_to_close_timeout": timedelta(hours=hours),
            "heartbeat_timeout": timedelta(seconds=max(60.0, spec.ops.heartbeat_timeout_s)),
            "retry_policy": RETRYABLE_FOREVER}


def suggest_options() -> dict:
    """suggest_trials (a local activity): pure and deterministic, so a failure is a bug —
    a few attempts, then the sweep fails with it rather than retrying forever."""
    return {"start_to_close_timeout": timedelta(seconds=60),
            "retry_policy": RetryPolicy(maximum_attempts=3,
                                        non_retryable_error_types=list(NON_RETRYABLE))}


def initial_trials(cfg: SweepConfig) -> int:
    """Round 0's size: enough space-filling points for the GP to fit (>= 2, >= dims + 1)
    and to fill one parallel round. One dimension with 2 trials: both ends, as before."""
    return min(cfg.trials, max(2, len(cfg.space) + 1, cfg.parallel))


def sweep_rounds(cfg: SweepConfig) -> list[int]:
    """Trials per round: the initial design, then `parallel` GP suggestions at a time."""
    rounds = [initial_trials(cfg)]
    while sum(rounds) < cfg.trials:
        rounds.append(min(cfg.parallel, cfg.trials - sum(rounds)))
    return rounds


def trial_run_id(run_id: str, index: int) -> str:
    return f"{run_id[:50]}-trial-{index}"


def trial_spec(spec: RunSpec, index: int, params: dict[str, float]) -> RunSpec:
    """A short run of its own (own run id and checkpoints), faults off, params applied."""
    steps = spec.sweep.trial_steps
    overrides = {f"train.{k}": (int(v) if k == "warmup_steps" else v) for k, v in params.items()}
    overrides.setdefault("train.warmup_steps", min(spec.train.warmup_steps, steps // 5))
    # one node (a trial is short), the run's global batch (workflows/gang.py)
    one_node = {"train.nodes": 1, "train.min_nodes": 0,
                "train.grad_accum": spec.train.grad_accum * spec.train.nodes}
    return spec.replace(**{"run_id": trial_run_id(spec.run_id, index), "faults": [],
                           "train.total_steps": steps, "train.segment_steps": steps,
                           "train.checkpoint_every": steps, **one_node, **overrides})


def with_params(spec: RunSpec, params: dict[str, float]) -> RunSpec:
    return spec.replace(**{f"train.{k}": (int(v) if k == "warmup_steps" else v)
                           for k, v in params.items()})


def segment_bounds(next_step: int, spec: RunSpec) -> tuple[int, int]:
    return next_step, min(next_step + spec.train.segment_steps, spec.train.total_steps)


ESCALATE_CONTINUE, ESCALATE_LOWER_LR, ESCALATE_PAUSE = "continue", "lower_lr", "pause"


def escalate(rollback_steps: tuple[int, ...], step: int, lowered_at: tuple[int, ...],
             cfg: SpikeConfig) -> tuple[str, str]:
    """What the workflow does after a segment reported rollbacks: (action, reason).

    Within the budget's window: continue. Over budget: lower the LR (once per window);
    still over budget after lowering it: pause the run for a human rather than loop.
    """
    horizon = step - cfg.budget.per_steps
    recent = [s for s in rollback_steps if s > horizon]
    if len(recent) <= cfg.budget.rollbacks:
        return ESCALATE_CONTINUE, f"{len(recent)} rollbacks in {cfg.budget.per_steps} steps"
    if not any(s > horizon for s in lowered_at):
        return ESCALATE_LOWER_LR, (f"{len(recent)} rollbacks in {cfg.budget.per_steps} steps "
                                   f"exceed the budget of {cfg.budget.rollbacks}")
    return ESCALATE_PAUSE, (f"{len(recent)} rollbacks in {cfg.budget.per_steps} steps even "
                            f"after lowering the LR at step {max(lowered_at)}")


def lower_lr_window(step: int, cfg: SpikeConfig) -> list[float]:
    """ESCALATE_LOWER_LR's LR window [start, end, factor] from `step`."""
    return [step, step + cfg.lr_backoff_steps, cfg.lr_backoff]


def rollback_allowance(rollback_steps: list[int], budget_from: int, step: int,
                       cfg: SpikeConfig) -> int:
    """Rollbacks the next segment may do before it must end early and let the workflow
    escalate: what is left of the budget in the window ending at `step` (-1: handling off)."""
    if not cfg.enabled:
        return -1
    horizon = step - cfg.budget.per_steps
    used = sum(1 for s in rollback_steps if s >= budget_from and s > horizon)
    return max(0, cfg.budget.rollbacks - used)


def still_counted(steps: list[int], budget_from: int, floor: int, cfg: SpikeConfig) -> list[int]:
    """The entries of rollback_steps / lowered_at that escalate() and rollback_allowance()
    can still count, so the carry stays bounded. Both count a step s only when
    s >= budget_from and s > step - per_steps for the step they are asked about, and the run
    never goes back before `floor` (the oldest committed checkpoint, or the step it is at):
    whatever is older than floor - per_steps can never count again."""
    horizon = floor - cfg.budget.per_steps
    return [s for s in steps if s >= budget_from and s > horizon]


def promotion_step(run_id: str, evals: dict[int, float]) -> int:
    """The trained step with the lowest held-out loss. None evaluated (every trained
    checkpoint was corrupt, so evaluate fell back to step 0) fails the run as BadData."""
    trained = [st for st in evals if st > 0]
    if not trained:
        raise ApplicationError(
            f"run {run_id}: no trained checkpoint could be evaluated; see the "
            f"checkpoint_corrupt events", {"evaluated": sorted(evals)},
            type="BadData", non_retryable=True)
    return min(trained, key=lambda st: evals[st])
