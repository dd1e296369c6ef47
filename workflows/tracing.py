"""The run's trace, in workflow code: one trace per run, whatever started it and however
many times it continued as new (docs/design.md, "Traces").

A run has a root span `run <run_id>` and one span per stage, `stage <name>`. Both outlive
a workflow run (the train stage spans every continue-as-new), so neither is a live span
object: each is *begun* by choosing its ids and start time — kept in RunCarry.trace, which
continue-as-new carries — and *emitted* once, when it ends, with those ids (backdated to
its start; `common/telemetry.preset_span_id`). Meanwhile its context is the current one, so
Temporal's OpenTelemetry plugin puts it in the headers of every activity, child workflow
and continue-as-new the run starts: activity spans are children of their stage, and every
workflow run of the chain is a child of the stage it continued in — one trace id for all.

The first workflow run's trace is that of its `RunWorkflow` span (the plugin's; a child of
the client's `StartWorkflow` span when the client traces), so runs started by `mainspring
run start`, the raw `temporal workflow start` or the Web UI are traced alike; without the
plugin, a trace id derived from the run id. Ids are derived by hashing, never drawn from
the workflow's random: replay chooses the same ones, and no other random draw moves.
Spans are emitted only when not replaying (replay re-runs the code, never re-emits).

Workflow code: deterministic, no I/O (the export is the tracer provider's, in its thread).
"""

from __future__ import annotations

import hashlib
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from common.telemetry import preset_span_id, tracer


def derived_id(bits: int, *parts: object) -> int:
    """Pure: a nonzero id of `bits` bits from `parts` (the same parts, the same id)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=bits // 8).digest()
    return int.from_bytes(digest, "big") or 1


def _context(trace_id: str, span_id: str) -> otel_context.Context:
    return trace.set_span_in_context(NonRecordingSpan(SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED))))


class RunTrace:
    """The run's root and stage spans over RunCarry.trace (a dict it updates in place):
    `{"trace_id", "run_id", "root": {span_id, parent_id, start_ns}, "stage": {name, span_id,
    start_ns}}`."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def start(self, run_id: str) -> None:
        """At the top of every workflow run: the first begins the root span; every one makes
        the open stage (or the root) the current context."""
        s = self.state
        if not s:
            current = trace.get_current_span().get_span_context()
            info = workflow.info()
            trace_id = current.trace_id if current.is_valid else derived_id(
                128, run_id, info.workflow_id, info.run_id)
            s.update(trace_id=f"{trace_id:032x}", run_id=run_id, root={
                "span_id": f"{derived_id(64, trace_id, 'run', info.run_id):016x}",
                "parent_id": f"{current.span_id:016x}" if current.is_valid else None,
                "start_ns": workflow.time_ns()})
        self._attach()

    def begin(self, stage: str) -> None:
        s = self.state
        if not s:
            return
        span_id = derived_id(64, s["trace_id"], "stage", stage, workflow.info().run_id)
        s["stage"] = {"name": stage, "start_ns": workflow.time_ns(), "span_id": f"{span_id:016x}"}
        self._attach()

    def finish(self, stage: str, error: str = "", **attributes: Any) -> None:
        """End the open stage's span (begun in this workflow run or an earlier one)."""
        s = self.state
        open_stage = s.get("stage") if s else None
        if not open_stage or open_stage["name"] != stage:
            return
        self._emit(f"stage {stage}", open_stage, s["root"]["span_id"],
                   {"stage": stage, **attributes}, error)
        del s["stage"]
        self._attach()

    def end(self, status: str, error: str = "", **attributes: Any) -> None:
        """End the run: its open stage (failed or aborted in it), then the root span."""
        s = self.state
        if not s:
            return
        if s.get("stage"):
            self.finish(s["stage"]["name"], error or status)
        self._emit(f"run {s['run_id']}", s["root"], s["root"]["parent_id"],
                   {"status": status, **attributes}, error)

    def command(self, entry: dict[str, Any]) -> None:
        """An operator command's queue entry as it arrives: an instant span `operator <name>`
        of the run's trace (a child of the open stage, else the root), linked to the span
        its handler ran in — the sender's trace when the client sent one, else the one-span
        trace Temporal's plugin starts for a raw `temporal workflow update` that carries
        none. Sets `entry["span_id"]`, which the command's `operator` event carries. An
        update can run in the first workflow task, before `start`: then the handler's span
        is kept in the entry and the span is emitted by `start` (`pending`)."""
        if "link" not in entry:
            handler = trace.get_current_span().get_span_context()
            entry["link"] = ([f"{handler.trace_id:032x}", f"{handler.span_id:016x}"]
                             if handler.is_valid else [])
        s = self.state
        if not s:
            return
        span = {"span_id": f"{derived_id(64, s['trace_id'], 'operator', entry['id']):016x}",
                "start_ns": workflow.time_ns()}
        link = entry.pop("link")
        links = ([trace.Link(SpanContext(int(link[0], 16), int(link[1], 16), is_remote=True))]
                 if link and link[0] != s["trace_id"] else [])
        raw = entry.get("raw")
        who = raw.get("who", "") if isinstance(raw, dict) else ""
        self._emit(f"operator {entry['name']}", span, (s.get("stage") or s["root"])["span_id"],
                   {"command": entry["name"], "command_id": entry["id"], "who": str(who or "")},
                   "", links)
        entry["span_id"] = span["span_id"]

    def pending(self, queue: list[dict[str, Any]]) -> None:
        """The spans of commands accepted before the trace began (see `command`)."""
        for entry in queue:
            if "span_id" not in entry:
                self.command(entry)

    def _attach(self) -> None:
        s = self.state
        span = s.get("stage") or s["root"]
        otel_context.attach(_context(s["trace_id"], span["span_id"]))

    def _emit(self, name: str, span: dict, parent_id: str | None, attributes: dict[str, Any],
              error: str, links: list[trace.Link] | None = None) -> None:
        if workflow.unsafe.is_replaying_history_events():
            return
        s = self.state
        parent = (_context(s["trace_id"], parent_id) if parent_id else otel_context.Context())
        attrs = {"run_id": s["run_id"], "workflow_run": workflow.info().run_id,
                 **{k: v for k, v in attributes.items() if isinstance(v, (str, bool, int, float))}}
        with preset_span_id(int(span["span_id"], 16), int(s["trace_id"], 16)):
            live = tracer().start_span(name, context=parent, attributes=attrs,
                                       start_time=span["start_ns"], links=links or ())
        if error:
            live.set_status(Status(StatusCode.ERROR, error[:500]))
        live.end(end_time=workflow.time_ns())
