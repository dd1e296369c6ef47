"""What a TrainingRun checks before its first stage: its spec, and its claim on the run id.

Workflow code (deterministic, no I/O of its own): the claim is a local activity
(activities/runs.py -> storage/runs.py).
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.contracts import CLAIM_RUN, ClaimRunInput
    from common.errors import NON_RETRYABLE, BadConfig
    from spec import RunSpec


def parse_spec(raw: object) -> RunSpec:
    """The run's spec, or the run fails at once with BadConfig naming the field (never
    retried). Every rule a later stage relies on is checked here (spec/run.py)."""
    try:
        return RunSpec.from_dict(raw)  # not an object: BadConfig("spec", ...)
    except BadConfig as exc:
        raise ApplicationError(str(exc), {"field": exc.field, "fix": exc.fix},
                               type="BadConfig", non_retryable=True) from None


async def claim(s: RunSpec) -> None:
    """Claim the run id in the durable store for this spec (storage/runs.py): a run id that
    already belongs to a different spec fails the run at once, before it touches anything."""
    try:
        await workflow.execute_local_activity(
            CLAIM_RUN, ClaimRunInput(durable=s.storage.durable, run_id=s.run_id,
                                     spec_hash=s.spec_hash(), spec=s.to_dict()),
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=30),
                                     non_retryable_error_types=list(NON_RETRYABLE)))
    except ActivityError as exc:
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.type in NON_RETRYABLE:
            raise ApplicationError(cause.message, *cause.details, type=cause.type,
                                   non_retryable=True) from None
        raise
