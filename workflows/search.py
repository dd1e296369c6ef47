"""TrainingRun's search attributes (DESIGN §6): how the Temporal UI, `temporal workflow list`
and `mainspring run list` find runs by id, stage, step and loss. Registered on the server
before use (ops/services.py:SEARCH_ATTRIBUTES). Workflow code; each call is one upsert
command in the run's history.
"""

from __future__ import annotations

import math

from temporalio import workflow
from temporalio.common import SearchAttributeKey

RUN_ID = SearchAttributeKey.for_keyword("MainspringRunId")
STAGE = SearchAttributeKey.for_keyword("MainspringStage")  # also paused, needs_attention, aborted
STEP = SearchAttributeKey.for_int("MainspringStep")
LOSS = SearchAttributeKey.for_float("MainspringLoss")  # -1 when not finite


def show_run_id(run_id: str) -> None:
    workflow.upsert_search_attributes([RUN_ID.value_set(run_id)])


def show_stage(stage: str) -> None:
    workflow.upsert_search_attributes([STAGE.value_set(stage)])


def show_progress(step: int, loss: float | None) -> None:
    finite = loss if loss is not None and math.isfinite(loss) else -1.0
    workflow.upsert_search_attributes([STEP.value_set(step), LOSS.value_set(finite)])
