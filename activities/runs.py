"""claim_run: the local activity that claims a run id for its spec (storage/runs.py)."""

from __future__ import annotations

from temporalio import activity

from activities.contracts import CLAIM_RUN, ClaimRunInput
from activities.errors import classified
from storage.runs import claim_run as claim


@activity.defn(name=CLAIM_RUN)
@classified
def claim_run(inp: ClaimRunInput) -> str:
    """"created" | "resumed"; BadConfig (non-retryable) when the id belongs to another spec."""
    return claim(inp.durable, inp.run_id, inp.spec_hash, inp.spec)
