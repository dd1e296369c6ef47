"""`mainspring trace RUN` and `mainspring goodput RUN`: a run's spans as a tree, as JSON or
as a Perfetto trace, and where its time went (DESIGN §6).

Reads only the durable store (storage/spans.py, storage/events.py), so it works during a
run, after it, and after every process of it is gone. A process killed with SIGKILL loses
its open spans: what it finished points at a parent that was never stored. Such an orphan
is shown under the span its process's TRACEPARENT named (`parent_hint`), marked "(parent
span lost)", or at top level when that span is missing too.

Everything above `cmd_trace` is pure (span records in; a tree, dicts, renderables out) and
tested that way. rich is imported where it draws, so building the CLI's parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from common.errors import BadConfig, StorageUnavailable
from ops.cli_args import run_command
from ops.cli_output import printable, printable_strings
from ops.store_fields import checked_events, checked_spans

# Event attributes the tree line names in its head (`fault rank_lost step 25`) or drops.
_HEAD_KEYS = ("event_id", "step", "kind", "evidence", "run_id")


@dataclass(frozen=True)
class Node:
    """One span in the tree. `parent_lost`: its parent span was never stored."""

    span: dict
    children: tuple[Node, ...] = ()
    parent_lost: bool = False


# Nesting of the tree: mainspring's deepest is about 8 (run, stage, activity, segment, rank,
# phase, ...); a stored chain deeper than this is cut and continued as roots, so neither
# this walk nor rich's drawing recurses without bound.
MAX_TREE_DEPTH = 64


def _start(span: dict) -> tuple:
    return (span.get("start_ns") or 0, span["span_id"])


def build_tree(spans: Iterable[dict]) -> list[Node]:
    """Roots (and orphans with no surviving hint) by start time, children by start time."""
    by_id: dict[str, dict] = {}
    for span in spans:
        by_id.setdefault(span["span_id"], span)
    kids: dict[str | None, list[dict]] = {}
    lost: set[str] = set()
    for span in by_id.values():
        parent = span.get("parent_id")
        if parent is not None and parent not in by_id:
            lost.add(span["span_id"])
            hint = span.get("parent_hint")
            parent = hint if hint in by_id and hint != span["span_id"] else None
        kids.setdefault(parent, []).append(span)
    seen: set[str] = set()

    def node(span: dict, depth: int = 0) -> Node:
        seen.add(span["span_id"])
        if depth >= MAX_TREE_DEPTH:  # a parent chain this long is a damaged record: its
            return Node(span, (), span["span_id"] in lost)  # rest is shown from the top
        children = tuple(node(c, depth + 1) for c in sorted(kids.get(span["span_id"], ()),
                                                            key=_start)
                         if c["span_id"] not in seen)
        return Node(span, children, span["span_id"] in lost)

    roots = [node(s) for s in sorted(kids.get(None, ()), key=_start)]
    for span in sorted(by_id.values(), key=_start):  # a parent cycle (damaged records)
        if span["span_id"] not in seen:               # reaches no root: show it on top
            roots.append(node(span))
    return sorted(roots, key=lambda n: _start(n.span))


def walk(roots: Iterable[Node], depth: int = 0) -> Iterator[tuple[int, Node]]:
    for n in roots:
        yield depth, n
        yield from walk(n.children, depth + 1)


def human_duration(ns: int | None) -> str:
    if ns is None or ns < 0:
        return "?"
    if ns == 0:
        return "0 s"
    s = ns / 1e9
    if s < 1e-3:
        return f"{ns / 1e3:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 59.995:
        return f"{s:.2f} s"
    if s < 3600:
        m, sec = divmod(round(s), 60)
        return f"{m}m {sec:02d}s"
    h, rem = divmod(round(s), 3600)
    return f"{h}h {rem // 60:02d}m"


def _duration(span: dict) -> int | None:
    start, end = span.get("start_ns"), span.get("end_ns")
    return end - start if isinstance(start, int) and isinstance(end, int) else None


def track_label(service: str, rank: Any = None) -> str:
    """'orchestrator', 'trainer worker', 'trainer rank 1', 'checkpoint writer', ..."""
    name = service.removeprefix("mainspring-")
    if name.startswith("worker-"):
        role = name.removeprefix("worker-")
        name = role if role == "orchestrator" else f"{role} worker"
    name = name.replace("-", " ") or "unknown service"
    return f"{name} rank {rank}" if rank is not None else name


def _scalar(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def event_line(event: dict, limit: int = 200) -> str:
    """`⚡ fault rank_lost step 25: rank 0 exited -9 at_step=25` (other kinds with `•`)."""
    attrs = event.get("attributes") or {}
    head = event.get("name", "?")
    if attrs.get("kind") is not None:
        head += f" {attrs['kind']}"
    if attrs.get("step") is not None:
        head += f" step {attrs['step']}"
    rest = [str(attrs["evidence"])] if attrs.get("evidence") not in (None, "") else []
    rest += [f"{k}={_scalar(v)}" for k, v in sorted(attrs.items())
             if k not in _HEAD_KEYS and v not in (None, "")]
    text = f"{head}: {' '.join(rest)}" if rest else head
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return ("⚡ " if event.get("name") == "fault" else "• ") + text


def _span_label(node: Node, parent: dict | None):
    from rich.text import Text

    span, attrs = node.span, node.span.get("attributes") or {}
    label = Text(span.get("name", "?"), style="bold" if parent is None else "")
    label.append(f"  {human_duration(_duration(span))}", style="cyan")
    up = (parent or {}).get("attributes") or {}
    details = [f"{k} {attrs[k]}" for k in ("attempt", "rank")
               if attrs.get(k) is not None and attrs[k] != up.get(k)]
    if parent is None or span.get("service") != parent.get("service"):
        details.append(track_label(span.get("service") or "", None))
    if attrs.get("badput"):
        details.append(f"badput {attrs['badput']}")
    if details:
        label.append("  " + " · ".join(details), style="dim")
    if span.get("status") == "error":
        msg = span.get("status_message") or ""
        label.append(f"  ✗ error{': ' + _scalar(msg, 160) if msg else ''}", style="bold red")
    if node.parent_lost:
        label.append("  (parent span lost)", style="yellow")
    return label


def _header(spans: list[dict]):
    from rich.text import Text

    traces = Counter(s.get("trace_id") or "?" for s in spans)
    if len(traces) == 1:
        return Text(f"trace {next(iter(traces))} · {len(spans)} spans", style="bold")
    head = Text(f"⚠ {len(traces)} trace ids in one run (a run should be one trace) · "
                f"{len(spans)} spans", style="bold yellow")
    for trace_id, n in traces.most_common():
        head.append(f"\n  trace {trace_id}: {n} spans", style="yellow")
    return head


def render_tree(spans: Iterable[dict]):
    """A rich Tree: the trace id(s) and span count on top, then each span with its duration,
    attempt/rank, service where it changes, errors, and its events as child lines."""
    from rich.text import Text
    from rich.tree import Tree

    spans = list({s["span_id"]: s for s in spans}.values())
    tree = Tree(_header(spans), guide_style="dim")

    def add(branch: Tree, node: Node, parent: dict | None) -> None:
        here = branch.add(_span_label(node, parent))
        items = [((e.get("ts_ns") or 0, 0, i), e) for i, e in enumerate(node.span.get("events")
                                                                         or ())]
        items += [((c.span.get("start_ns") or 0, 1, i), c) for i, c in enumerate(node.children)]
        for _, item in sorted(items, key=lambda x: x[0]):
            if isinstance(item, Node):
                add(here, item, node.span)
            else:
                fault = item.get("name") == "fault"
                here.add(Text(event_line(item), style="bold yellow" if fault else "magenta"))

    for root in build_tree(spans):
        add(tree, root, None)
    return tree


def tree_text(spans: Iterable[dict], width: int = 120) -> str:
    """render_tree as plain text (no colour codes)."""
    import io

    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=width, color_system=None, highlight=False).print(render_tree(spans))
    return out.getvalue()


def to_json(spans: Iterable[dict]) -> dict:
    """{trace_ids, span_count, roots: [span fields + parent_lost + children, ...]}."""
    spans = list({s["span_id"]: s for s in spans}.values())

    def node(n: Node) -> dict:
        return {**n.span, "parent_lost": n.parent_lost, "children": [node(c) for c in n.children]}

    return {"trace_ids": sorted({s.get("trace_id") or "" for s in spans}),
            "span_count": len(spans), "roots": [node(r) for r in build_tree(spans)]}


# The subset of the Trace Event Format (the "JSON Object Format": catapult's
# docs/trace-event-format.md, the Google doc it points to) that to_perfetto writes.
# ts/dur are microseconds; "X" complete events need dur; instants carry a scope s
# (g global, p process, t thread); flow events s/f are matched by cat+name+id and bind to
# the slice enclosing their ts ("bp": "e" on the end binds it to the enclosing slice);
# "M" metadata names a process/thread (args.name) or orders it (args.sort_index).
_NUM = {"type": "number"}
_INT = {"type": "integer"}
TRACE_EVENT_SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "traceEvents": {"type": "array", "items": {"$ref": "#/$defs/event"}},
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
    },
    "$defs": {
        "event": {
            "type": "object",
            "required": ["name", "ph", "pid"],
            "properties": {
                "name": {"type": "string"}, "cat": {"type": "string"},
                "ph": {"enum": ["X", "i", "s", "f", "M"]},
                "ts": _NUM, "dur": {"type": "number", "minimum": 0}, "pid": _INT, "tid": _INT,
                "args": {"type": "object"}, "s": {"enum": ["g", "p", "t"]},
                "id": {"type": ["integer", "string"]}, "bp": {"const": "e"},
            },
            "allOf": [
                {"if": {"properties": {"ph": {"const": "X"}}},
                 "then": {"required": ["ts", "dur", "tid"]}},
                {"if": {"properties": {"ph": {"const": "i"}}},
                 "then": {"required": ["ts", "tid", "s"]}},
                {"if": {"properties": {"ph": {"enum": ["s", "f"]}}},
                 "then": {"required": ["ts", "tid", "cat", "id"]}},
                {"if": {"properties": {"ph": {"const": "M"}}},
                 "then": {"required": ["args"], "oneOf": [
                     {"properties": {"name": {"enum": ["process_name", "thread_name"]},
                                     "args": {"required": ["name"],
                                              "properties": {"name": {"type": "string"}}}}},
                     {"properties": {"name": {"enum": ["process_sort_index",
                                                       "thread_sort_index"]},
                                     "args": {"required": ["sort_index"],
                                              "properties": {"sort_index": _INT}}}}]}},
            ],
        },
    },
}


def _us(ns: int | None) -> float:
    return round((ns or 0) / 1000, 3)


def _inside(span: dict) -> float:
    """A flow event's ts: just after the span starts. A flow binds to the slice enclosing its
    ts; exactly at the start a parent that starts with the span would do too."""
    return round(_us(span.get("start_ns")) + min(1.0, max(0.0, _us(_duration(span))) / 2), 3)


def _lanes(spans: list[dict]) -> list[int]:
    """A lane per span such that spans in one lane nest (the viewers draw a thread's slices
    as a stack and misdraw ones that overlap without nesting: perfetto.dev/docs/faq)."""
    lane = [0] * len(spans)
    stacks: list[list[int]] = []  # per lane: end times of the spans still open
    for i in sorted(range(len(spans)), key=lambda i: (spans[i].get("start_ns") or 0,
                                                      -(spans[i].get("end_ns") or 0))):
        start = spans[i].get("start_ns") or 0
        end = max(start, spans[i].get("end_ns") or start)
        for n, stack in enumerate(stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                lane[i] = n
                break
        else:
            stacks.append([end])
            lane[i] = len(stacks) - 1
    return lane


def tracks(roots: list[Node]) -> dict[tuple, list[tuple[Node, dict]]]:
    """(service, pid, rank) -> its (node, inherited attrs) in start order. A span without a
    rank attribute takes its parent's when the parent ran in the same process."""
    out: dict[tuple, list[tuple[Node, dict]]] = {}

    def visit(node: Node, up: dict, up_proc: tuple | None) -> None:
        span, attrs = node.span, node.span.get("attributes") or {}
        proc = (span.get("service") or "", span.get("pid"))
        ctx = {k: attrs.get(k, up.get(k) if proc == up_proc else None) for k in ("rank", "attempt")}
        out.setdefault((*proc, ctx["rank"]), []).append((node, ctx))
        for child in node.children:
            visit(child, ctx, proc)

    for root in roots:
        visit(root, {}, None)
    return dict(sorted(out.items(), key=lambda kv: _start(kv[1][0][0].span)))


def to_perfetto(spans: Iterable[dict]) -> dict:
    """Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing): a process per
    (service, pid, rank), its spans as complete events on nesting lanes (threads), span
    events as thread instants, links as flow arrows (linked span -> linking span)."""
    roots = build_tree(spans)
    events: list[dict] = []
    where: dict[str, tuple[int, int]] = {}  # span_id -> (pid, tid)
    used: set[int] = set()
    for index, ((service, os_pid, rank), members) in enumerate(tracks(roots).items()):
        pid = os_pid if isinstance(os_pid, int) and os_pid > 0 and os_pid not in used \
            else max(used | {1 << 22}) + 1  # above Linux's pid_max: never a real pid
        used.add(pid)
        attempts = sorted({ctx["attempt"] for _, ctx in members if ctx["attempt"] is not None},
                          key=str)
        label = track_label(service, rank) + "".join(f" · attempt {a}" for a in attempts[:3])
        label += f" · pid {os_pid}"
        events += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 1,
                    "args": {"name": label}},
                   {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 1,
                    "args": {"sort_index": index}}]
        lanes = _lanes([n.span for n, _ in members])
        for lane in sorted(set(lanes)):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": lane + 1,
                           "args": {"name": label if lane == 0 else f"{label} · overlap {lane}"}})
        for (node, _), lane in zip(members, lanes):
            events += _span_events(node, pid, lane + 1)
            where[node.span["span_id"]] = (pid, lane + 1)
    by_id = {n.span["span_id"]: n.span for _, n in walk(roots)}
    flow = 0
    for span in by_id.values():
        for link in span.get("links") or ():
            if link.get("span_id") in where:
                flow += 1
                src, dst = where[link["span_id"]], where[span["span_id"]]
                linked = by_id[link["span_id"]]
                common = {"name": "link", "cat": "link", "id": flow}
                events += [{**common, "ph": "s", "ts": _inside(linked), "pid": src[0],
                            "tid": src[1]},
                           {**common, "ph": "f", "bp": "e", "ts": _inside(span), "pid": dst[0],
                            "tid": dst[1]}]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _span_events(node: Node, pid: int, tid: int) -> list[dict]:
    span = node.span
    args = {**(span.get("attributes") or {}),
            **{k: span.get(k) for k in ("span_id", "parent_id", "trace_id", "status",
                                        "status_message", "service", "pid")}}
    args["parent_lost"] = node.parent_lost
    out = [{"name": span.get("name") or "?", "cat": "span", "ph": "X",
            "ts": _us(span.get("start_ns")), "dur": max(0.0, _us(_duration(span))),
            "pid": pid, "tid": tid, "args": args}]
    for ev in span.get("events") or ():
        attrs = ev.get("attributes") or {}
        name = ev.get("name") or "?"
        out.append({"name": f"{name} {attrs['kind']}" if attrs.get("kind") else name,
                    "cat": "event", "ph": "i", "s": "t", "ts": _us(ev.get("ts_ns")),
                    "pid": pid, "tid": tid, "args": attrs})
    return out


def _seconds(x: Any) -> str:
    return "–" if x is None else human_duration(int(x * 1e9))


def _ratio(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "–"


def goodput_view(result: dict):
    """ops.goodput.from_record's result as rich tables: productive time and each badput
    cause with its share of the wall (causes with no time left out), MTTR per fault kind."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    wall, train = result.get("wall_s") or 0, result.get("train") or {}
    head = Text(f"goodput {_ratio(result.get('goodput'))}", style="bold")
    if train.get("wall_s"):
        head.append(f" · train stage goodput {_ratio(train.get('goodput'))} "
                    f"({_seconds(train.get('productive_s'))} productive of "
                    f"{_seconds(train['wall_s'])})")
    if result.get("injected_faults"):
        head.append(f" · {result['injected_faults']} injected faults (chaos), not counted below")
    time = Table("where the time went", "time", "share")
    rows = [("productive", result.get("productive_s") or 0.0)] + sorted(
        ((f"badput: {c}", s) for c, s in (result.get("badput_s") or {}).items() if s),
        key=lambda row: -row[1])
    for name, s in rows:
        time.add_row(name, _seconds(s), f"{s / wall:.1%}" if wall else "–",
                     style="green" if name == "productive" else None)
    time.add_row("wall", _seconds(wall), "", style="bold")
    faults = Table("fault kind", "count", "recovered", "MTTR median", "MTTR max", "lost steps")
    for kind, f in sorted((result.get("faults") or {}).items()):
        faults.add_row(Text(kind), str(f.get("count", "–")), str(f.get("recovered", "–")),
                       _seconds(f.get("mttr_s_median")), _seconds(f.get("mttr_s_max")),
                       str(f.get("lost_steps", "–")))
    for column in (*time.columns[1:], *faults.columns[1:]):
        column.justify = "right"
    return Group(head, time, *([faults] if faults.row_count else [Text("no real faults")]))


# ---- the commands (I/O) -----------------------------------------------------------------

def no_spans(durable_url: str, run_id: str) -> BadConfig:
    """The error for a run with no stored spans: where we looked and what to check."""
    from storage.fs import join, normalize_url, resolve

    url = normalize_url(durable_url)
    try:
        fs, root = resolve(durable_url)
        has_events = fs.exists(join(root, "runs", run_id, "events"))
        others = sorted(p.rstrip("/").rsplit("/", 1)[-1]
                        for p in fs.ls(join(root, "runs"), detail=False)
                        if fs.exists(join(p, "spans")))[-20:]
    except (FileNotFoundError, OSError, StorageUnavailable):
        has_events, others = False, []
    where = f"no spans for run {run_id!r} under {url}/runs/{run_id}/spans"
    if has_events:
        return BadConfig("run_id", f"{where}, though its event log is there",
                         "its processes stored no spans: check that they trace to the durable "
                         "store (common/telemetry.py) and flushed before they stopped")
    found = f"runs with spans there: {', '.join(others)}" if others else "no run has spans there"
    return BadConfig("run_id", f"{where} ({found})",
                     "check the run id, and pass --durable the store the run used (its spec's "
                     "storage.durable)")


def cmd_trace(args: argparse.Namespace) -> int:
    from common.redact import redact, redact_value
    from ops.report import exit_code
    from storage.spans import read_spans

    try:
        # scrubbed again: a Perfetto file or a pasted tree travels further than the store;
        # checked: times, ids and attributes in range (ops/store_fields.py)
        spans = checked_spans(redact_value(read_spans(args.durable, args.run_id)))
        if not spans:
            raise no_spans(args.durable, args.run_id)
    except (BadConfig, StorageUnavailable) as exc:
        print(f"mainspring trace: {printable(redact(str(exc)))}", file=sys.stderr)
        return exit_code(exc)
    if args.perfetto:
        path = os.path.abspath(args.perfetto)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(to_perfetto(spans), f)
        print(path)
    elif args.json:
        print(json.dumps(to_json(spans), default=str))
    else:
        from rich.console import Console

        Console(highlight=False).print(render_tree(printable_strings(spans)))
    return 0


def cmd_goodput(args: argparse.Namespace) -> int:
    from common.redact import redact
    from ops.goodput import from_record
    from ops.report import exit_code, missing_run
    from storage.events import read_events
    from storage.spans import read_spans

    try:
        events = checked_events(read_events(args.durable, args.run_id))
        if not events:
            raise missing_run(args.durable, args.run_id)
        spans = checked_spans(read_spans(args.durable, args.run_id))
    except (BadConfig, StorageUnavailable) as exc:
        print(f"mainspring goodput: {printable(redact(str(exc)))}", file=sys.stderr)
        return exit_code(exc)
    result = from_record(events, spans)
    if args.json:
        print(json.dumps(result, default=str))
    else:
        from rich.console import Console

        Console(highlight=False).print(goodput_view(printable_strings(result)))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `trace RUN [--durable URL] [--json | --perfetto FILE]` and `goodput RUN
    [--durable URL] [--json]` to the CLI's subcommands."""
    trace = run_command(sub, "trace", "a run's spans as a tree (or JSON, or a Perfetto file)")
    out = trace.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="the span tree as one JSON object")
    out.add_argument("--perfetto", metavar="FILE",
                     help="write Chrome trace-event JSON for ui.perfetto.dev; print its path")
    trace.set_defaults(fn=cmd_trace)
    goodput = run_command(sub, "goodput", "productive time vs badput by cause, MTTR by fault")
    goodput.add_argument("--json", action="store_true", help="the figures as one JSON object")
    goodput.set_defaults(fn=cmd_goodput)
