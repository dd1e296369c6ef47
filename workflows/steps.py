"""Which steps: a training segment's bounds and the step a run promotes. Deterministic and
I/O-free; imported by the workflows inside the sandbox.
"""

from __future__ import annotations

from temporalio.exceptions import ApplicationError

from spec import RunSpec


def segment_bounds(next_step: int, spec: RunSpec) -> tuple[int, int]:
    return next_step, min(next_step + spec.train.segment_steps, spec.train.total_steps)


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
