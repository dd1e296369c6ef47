"""scrub_checkpoints: the data worker (which does not train) reads back the run's
checkpoints a fallback would need, beside the training segment (storage/scrub.py)."""

from __future__ import annotations

import dataclasses

from temporalio import activity

from activities.contracts import SCRUB_CHECKPOINTS, ScrubInput, ScrubResult
from activities.errors import classified
from activities.tracing import activity_span
from spec import RunSpec
from storage.checkpoints import CheckpointStore
from storage.events import EventLog
from storage.retention import spike_reach
from storage.scrub import ScrubPolicy, scrub


@activity.defn(name=SCRUB_CHECKPOINTS)
@classified
def scrub_checkpoints(inp: ScrubInput) -> ScrubResult:
    """One pass; heartbeats as it reads (a throttled pass over large checkpoints takes
    minutes). A retry starts the pass again: what was verified before is in its record."""
    spec = RunSpec.from_dict(inp.spec)
    policy = ScrubPolicy.from_storage(spec.storage, spike_reach(spec.spikes.window)
                                      if spec.spikes.enabled else 0)
    with activity_span("scrub", spec), EventLog(spec.storage.durable, spec.run_id, "scrub",
                                                attempt=activity.info().attempt) as events:
        report = scrub(CheckpointStore(spec.storage.durable, spec.run_id), events, policy,
                       progress=activity.heartbeat)
    return ScrubResult(**dataclasses.asdict(report))
