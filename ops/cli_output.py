"""What the CLI shows: for people on a terminal (rich), as plain lines elsewhere (pipes, CI
logs), and as one JSON object per line for scripts (`--json`).

A run's progress (`run watch`, `run start --wait`, the demo) is one pure snapshot of the
`status` query and the event log, shown by one of three views: a rich step bar with its
ETA, loss, tokens/s and faults when the stream is a terminal, else a plain line when it
changed, or with --json a JSON line per update. `run status` and `run list` draw a table
on a terminal and keep printing JSON everywhere else, as they always have.
"""

from __future__ import annotations

import json
import math
import time
from typing import IO, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Column, Table
from rich.text import Text

_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\x1b": "\\x1b"}


def printable(value: object, limit: int | None = None) -> str:
    """Pure: `value` as text safe to put on a terminal: every character Python does not
    call printable but the space (C0 and C1 controls, ESC, DEL, bidi and other format
    characters, line separators) shown escaped, `\\n` and `\\t` included, so a store
    record can neither move the cursor, recolour, retitle the terminal, nor start a line
    that looks like mainspring's own; cut at `limit` characters with an ellipsis. Every
    command that prints store content prints it through this."""
    text = value if isinstance(value, str) else str(value)
    if not text.isprintable():
        text = "".join(ch if ch == " " or ch.isprintable() else _escaped(ch) for ch in text)
    return text if limit is None or len(text) <= limit else text[:limit - 1] + "…"


def printable_strings(value: Any) -> Any:
    """Pure: a JSON-like value with every string in it, keys included, `printable`: what a
    view that draws store records itself (a rich tree or table) is handed."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(k) if isinstance(k, str) else k: printable_strings(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable_strings(v) for v in value]
    return value


def _escaped(ch: str) -> str:
    code = ord(ch)
    return _NAMED.get(ch) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
                              if code < 0x10000 else f"\\U{code:08x}")


def finite(obj: Any) -> Any:
    """Pure: a JSON-like value with NaN and ±inf as null (strict JSON has neither, and a
    diverged loss is one)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def json_line(obj: Any) -> str:
    """One strict-JSON line for scripts (`--json`)."""
    return json.dumps(finite(obj), default=str, allow_nan=False)


def is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


# ---- a run's progress (pure) ------------------------------------------------------------

def injected(event: dict) -> bool:
    """A fault the spec asked for (a real one, even one it caused, says injected: false)."""
    return event["kind"] == "fault" and bool(event["payload"].get("injected"))


def automatic_rollback(event: dict) -> bool:
    """A rollback the spike guard decided (an operator's carries by=operator)."""
    return event["kind"] == "rollback" and event["payload"].get("by") != "operator"


def recoveries(events: list[dict]) -> int:
    """Automatic recoveries: a retried segment that resumed (`recovered`), a rollback past
    bad data (`rollback`), a skipped non-finite step (`batch_skipped` of a NaN loss)."""
    return sum(e["kind"] == "recovered" or automatic_rollback(e)
               or (e["kind"] == "batch_skipped" and e["payload"].get("reason") == "non_finite_loss")
               for e in events)


def snapshot(status: dict, events: list[dict]) -> dict:
    """Pure: where a run is, from its `status` query and its event log.

    The query's step moves when a segment returns; the newest `train_metrics` window
    (flushed at each checkpoint commit, activities/metrics.py) moves within one, so the
    later of the two is shown, with that window's loss and tokens/s. `faults` counts the
    faults the run met (an injection marker is `injected`, its effect a fault of its own).
    """
    run_id = status.get("run_id")
    window = next((e for e in reversed(events) if e["kind"] == "train_metrics"), None)
    step, loss = status.get("step") or 0, status.get("train_loss")
    if window and isinstance(window["step"], int) and window["step"] >= step:
        step, loss = window["step"], window["payload"].get("loss_mean", loss)
    return finite({
        "run_id": run_id, "stage": status.get("stage"), "step": step,
        "total_steps": status.get("total_steps") or 0,
        "committed": max((e["step"] for e in events if e["kind"] == "checkpoint_committed"
                          and e["run_id"] == run_id and isinstance(e["step"], int)),
                         default=None),
        "loss": loss, "tokens_per_s": window["payload"].get("tokens_per_s") if window else None,
        "faults": sum(e["kind"] == "fault" and not injected(e) for e in events),
        "injected": sum(map(injected, events)), "recovered": recoveries(events),
        "needs_attention": status.get("needs_attention"), "events": len(events)})


def plain_line(p: dict) -> str:
    """Pure: a snapshot as one line of text (CI logs, pipes)."""
    loss = p["loss"] if p["loss"] is None else round(p["loss"], 3)
    tps = p["tokens_per_s"] if p["tokens_per_s"] is None else round(p["tokens_per_s"])
    line = (f"stage={p['stage'] or '?':<13} step={p['step']}/{p['total_steps']}"
            f" committed={p['committed']} loss={loss} tok/s={tps} faults={p['faults']}"
            f" injected={p['injected']} recovered={p['recovered']} events={p['events']}")
    line = line + (f" needs_attention={p['needs_attention']!r}" if p["needs_attention"] else "")
    return printable(line)


def figures(p: dict) -> str:
    """Pure: the figures beside the step bar."""
    parts = [f"loss {p['loss']:.3f}" if p["loss"] is not None else "loss –"]
    tps = p["tokens_per_s"]
    parts.append("– tok/s" if tps is None else f"{tps / 1000:.1f}k tok/s" if tps >= 1000
                 else f"{tps:.0f} tok/s")
    parts.append(f"faults {p['faults']}" + (f" ({p['injected']} injected)" if p["injected"]
                                             else ""))
    parts.append(f"recovered {p['recovered']}")
    if p["needs_attention"]:
        parts.append(f"needs attention: {p['needs_attention']}")
    return escape(printable(" · ".join(parts)))  # a rich TextColumn reads markup


# ---- the three views --------------------------------------------------------------------

class PlainView:
    """A line each time the snapshot changes."""

    def __init__(self, out: IO[str]) -> None:
        self.out, self.last = out, ""

    def __enter__(self) -> PlainView:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def show(self, p: dict) -> None:
        self._print(plain_line(p))

    def waiting(self, why: str) -> None:
        self._print(f"(waiting: {why})")

    def _print(self, line: str) -> None:
        if line != self.last:
            print(line, file=self.out, flush=True)
            self.last = line


class JsonView(PlainView):
    """One JSON object per update: {"kind": "progress", "ts": …, the snapshot}; a failed
    query is no update."""

    def __init__(self, out: IO[str]) -> None:
        super().__init__(out)
        self.shown: dict | None = None

    def show(self, p: dict) -> None:
        if p != self.shown:
            self.shown = p
            print(json_line({"kind": "progress", "ts": round(time.time(), 3), **p}),
                  file=self.out, flush=True)

    def waiting(self, why: str) -> None:
        pass


class RichView:
    """A live step bar on a terminal: stage, steps done of the total, ETA, figures.

    The ETA is rich's, from the steps per second over the last ten minutes: the step moves
    at checkpoint commits, which may be minutes apart."""

    def __init__(self, console: Console, get_time=None) -> None:
        fixed = {"no_wrap": True}  # the figures fold onto a second line, the bar never shrinks
        self.progress = Progress(
            TextColumn("[bold]{task.fields[stage]:<13}", table_column=Column(**fixed)),
            BarColumn(bar_width=24, table_column=Column(min_width=24, **fixed)),
            MofNCompleteColumn(table_column=Column(**fixed)),
            TextColumn("eta", table_column=Column(**fixed)),
            TimeRemainingColumn(compact=True, table_column=Column(**fixed)),
            TextColumn("{task.fields[figures]}", table_column=Column(overflow="fold")),
            console=console, get_time=get_time, speed_estimate_period=600.0)
        self.task = self.progress.add_task("run", total=None, stage="starting",
                                           figures="")

    def __enter__(self) -> RichView:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def show(self, p: dict) -> None:
        self.progress.update(self.task, total=p["total_steps"] or None, completed=p["step"],
                             stage=escape(printable(p["stage"] or "?", 40)),
                             figures=figures(p))

    def waiting(self, why: str) -> None:
        self.progress.update(self.task, figures=f"waiting: {why}")


def progress_view(out: IO[str], as_json: bool = False) -> PlainView | RichView:
    """JSON lines with --json; else a rich bar when `out` is a terminal, plain lines when not."""
    if as_json:
        return JsonView(out)
    if is_terminal(out):
        return RichView(Console(file=out, highlight=False))
    return PlainView(out)


# ---- run status / run list on a terminal ------------------------------------------------

LIST_COLUMNS = ("run_id", "status", "stage", "step", "loss", "started")


def print_table(rows: list[dict], out: IO[str]) -> None:
    """`run list` for a person: one row per run."""
    table = Table(*LIST_COLUMNS, box=None, header_style="bold")
    for row in rows:
        loss = row.get("loss")
        table.add_row(*(Text(f"{loss:.3f}") if key == "loss" and isinstance(loss, float)
                        else Text("" if row.get(key) is None else printable(row.get(key)))
                        for key in LIST_COLUMNS))
    Console(file=out, highlight=False).print(table if rows else "no runs")


def print_status(status: dict, out: IO[str]) -> None:
    """`run status` for a person: the fields that say something, one per line."""
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in status.items():
        if value in (None, "", [], {}):
            continue
        table.add_row(Text(printable(key)),  # Text: a stored `[bold]` is no rich markup
                      Text(printable(value) if isinstance(value, str) else json_line(value)))
    Console(file=out, highlight=False).print(table)
