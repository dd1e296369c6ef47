"""What a TrainingRun checks before its first stage: its spec, where its relative paths
point, and its claim on the run id.

Workflow code (deterministic, no I/O of its own): the claim is a local activity
(activities/runs.py -> storage/runs.py), and so is the root relative paths are anchored at
(ops/worker.py:spec_root_activity).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.contracts import CLAIM_RUN, SPEC_ROOT, ClaimRunInput
    from common.errors import NON_RETRYABLE, BadConfig
    from spec import RunSpec
    from spec.paths import anchor, anchor_raw, needs_root, unanchored


def parse_spec(raw: object) -> RunSpec:
    """The run's spec, or the run fails at once with BadConfig naming the field (never
    retried). Every rule a later stage relies on is checked here (spec/run.py)."""
    try:
        return RunSpec.from_dict(raw)  # not an object: BadConfig("spec", ...)
    except BadConfig as exc:
        raise _bad_config(exc) from None


async def anchor_paths(raw: dict[str, Any], s: RunSpec) -> tuple[dict[str, Any], RunSpec]:
    """The spec (as written, and parsed) with every local path absolute (spec/paths.py), so a
    relative path means one place for every worker and child process, whichever client
    started the run. Relative ones are anchored at the orchestrator's root (`mainspring
    worker --spec-root`), asked once through a local activity, so the history holds it;
    `~` fails the run at once (BadConfig with the fix). `mainspring run start` anchors
    before it starts a run: such a spec, and histories from before this, schedule nothing
    here."""
    if not unanchored(s) or not workflow.patched("anchor_paths"):
        return raw, s
    try:
        anchor(s, "/")  # a `~` path is refused before anything is asked
    except BadConfig as exc:
        raise _bad_config(exc) from None
    root = "/"  # no path is relative: the result does not depend on the root
    if needs_root(s):
        root = await workflow.execute_local_activity(
            SPEC_ROOT, result_type=str, start_to_close_timeout=timedelta(seconds=30),
            summary="anchor the spec's relative paths at the orchestrator's --spec-root")
    return anchor_raw(raw, s, root), anchor(s, root)


def _bad_config(exc: BadConfig) -> ApplicationError:
    return ApplicationError(str(exc), {"field": exc.field, "fix": exc.fix}, type="BadConfig",
                            non_retryable=True)


async def claim(s: RunSpec) -> None:
    """Claim the run id in the durable store for this spec (storage/runs.py): a run id that
    already belongs to a different spec fails the run at once, before it touches anything."""
    try:
        await workflow.execute_local_activity(
            CLAIM_RUN, ClaimRunInput(durable=s.storage.durable, run_id=s.run_id,
                                     spec_hash=s.spec_hash(), spec=s.to_dict()),
            start_to_close_timeout=timedelta(seconds=60),
            summary=f"claim run id {s.run_id} in {s.storage.durable}",
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=30),
                                     non_retryable_error_types=list(NON_RETRYABLE)))
    except ActivityError as exc:
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.type in NON_RETRYABLE:
            raise ApplicationError(cause.message, *cause.details, type=cause.type,
                                   non_retryable=True) from None
        raise
