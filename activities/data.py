"""Data-queue activities: prepare_data (corpus -> verified token shards) and promote (which
also writes the run's quarantine, the last activity a finished run passes)."""

from __future__ import annotations

from temporalio import activity

from activities.contracts import (
    PREPARE_DATA,
    PROMOTE,
    PrepareDataInput,
    PrepareDataResult,
    PromoteInput,
    PromoteResult,
)
from activities.errors import classified
from activities.tracing import activity_span
from dataprep.pipeline import prepare_dataset
from spec import RunSpec
from storage.checkpoints import CheckpointStore
from storage.events import EventLog
from storage.init_source import check_fit
from storage.quarantine import write_quarantine
from storage.teacher_source import check_teacher


@activity.defn(name=PREPARE_DATA)
@classified
def prepare_data(inp: PrepareDataInput) -> PrepareDataResult:
    """Progress (phases, committed work units) becomes heartbeats; a retry after a crash
    resumes from the work units the dead attempt committed (`dataprep.units`)."""
    spec = RunSpec.from_dict(inp.spec)
    with activity_span("prepare_data", spec):
        return _prepare_data(spec)


def _prepare_data(spec: RunSpec) -> PrepareDataResult:
    attempt = activity.info().attempt
    with EventLog(spec.storage.durable, spec.run_id, "data", attempt=attempt) as events:
        events.emit("dataprep_started", event_id=f"dataprep_started/{attempt}",
                    corpus=spec.data.corpus)
    uri, man, cache_hit = prepare_dataset(
        spec.data, spec.storage.durable, spec.seed,
        progress=lambda phase, counts: activity.heartbeat({"phase": phase, **counts}))
    stats = man.stats
    with EventLog(spec.storage.durable, spec.run_id, "data", attempt=attempt) as events:
        events.emit("dataset_ready", event_id=f"dataset_ready/{man.content_hash}", uri=uri,
                    cache_hit=cache_hit, content_hash=man.content_hash,
                    docs_in=stats.get("docs_in"), docs_out=stats.get("docs_out"),
                    exact_dups=stats.get("exact_dups"), near_dups=stats.get("near_dups"),
                    resume=stats.get("resume"), train_tokens=man.tokens("train"),
                    val_tokens=man.tokens("val"), vocab_size=man.vocab_size)
        if spec.train.init_from:  # before any accelerator: the source fits, or BadConfig
            source = check_fit(spec, uri, man)
            events.emit("initialized_from", event_id=f"initialized_from/{source.run_id}/"
                        f"{source.step}", **source.lineage())
        if spec.distill.teacher:  # a student run: its teacher reads these tokens, or BadConfig
            teacher = check_teacher(spec, uri, man)
            events.emit("distilled_from", event_id=f"distilled_from/{teacher.run_id}/"
                        f"{teacher.step}", **teacher.lineage())
    return PrepareDataResult(manifest_uri=uri, cache_hit=cache_hit,
                             docs_out=int(stats.get("docs_out", 0)),
                             train_tokens=man.tokens("train"), val_tokens=man.tokens("val"),
                             vocab_size=man.vocab_size)


@activity.defn(name=PROMOTE)
@classified
def promote(inp: PromoteInput) -> PromoteResult:
    spec = RunSpec.from_dict(inp.spec)
    with activity_span("promote", spec, step=inp.step):
        return _promote(spec, inp)


def _promote(spec: RunSpec, inp: PromoteInput) -> PromoteResult:
    # derived from the durable spike_diagnosed events and written whole, so a retry writes
    # the same file; an outage fails this attempt (retryable) before anything is promoted
    write_quarantine(spec.storage.durable, spec.run_id)
    uri, man = CheckpointStore(spec.storage.durable, spec.run_id).promote(inp.step)
    with EventLog(spec.storage.durable, spec.run_id, "data") as events:
        events.emit("promoted", step=inp.step, event_id=f"promoted/{inp.step}", uri=uri,
                    bytes=man.total_bytes)
    return PromoteResult(step=inp.step, uri=uri, bytes=man.total_bytes)
