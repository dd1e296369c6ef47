"""`mainspring sweep RUN [--durable URL] [--json]`: a run's warm-up sweep as a table, from its
durable event log (storage/events.py), no Temporal needed.

One row per `sweep_trial` event (workflows/sweep.py writes one as each trial is scored): the
trial's number, where its point came from (`prior`: the scaling-law point, trial 0; else the
sampler, `tpe` | `gp`; `initial` in runs older than optuna), each swept parameter, its status,
its held-out loss and its steps, the winner starred: the lowest finite loss, the earliest
trial on a tie, as the Sweep workflow chooses it. Events written before they carried a
status or steps get them derived: a finite loss is `complete`, any other `diverged`; the
steps are the stored spec's sweep.trial_steps. A pruned sweep (sweep.pruning) adds a
`rungs` column: each trial's held-out loss at each rung boundary it reached, `loss@step`; a
`pruned` trial stopped at its last one, with no final loss (it never wins) and the steps it
trained. A run with no sweep says so, exit 0; a run with no event log is one line naming the
store and the fix, exit 1.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from common.errors import BadConfig, StorageUnavailable
from common.redact import redact
from ops.cli_args import run_command
from ops.cli_output import json_line, printable
from ops.store_fields import valid_run_id
from sweep.saving import pruning_saving

STATUSES = ("complete", "diverged", "failed", "pruned")  # as recorded; derived: the first two


@dataclass(frozen=True)
class TrialRow:
    trial: int
    run_id: str
    source: str
    round: int
    params: dict[str, float]
    status: str
    val_loss: float | None  # None: no finite held-out loss
    steps: int | None  # None: neither the event nor the stored spec says
    winner: bool = False
    # [step, held-out loss] at each rung boundary reached (a pruned sweep); None: not finite
    rungs: list[list[float | None]] = field(default_factory=list)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `sweep RUN [--durable URL] [--json]`."""
    p = run_command(sub, "sweep", "a run's warm-up sweep: each trial's point, status, loss "
                                  "and steps, the winner marked")
    p.add_argument("--json", action="store_true", help="the table as one JSON document")
    p.set_defaults(fn=cmd_sweep)


def _finite(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _index(payload: dict, event_id: str, fallback: int) -> int:
    """The trial's number: from its run id (`<run>-trial-<i>`), else its event id
    (`sweep_trial/<i>`), else its place in the log."""
    for text, sep in ((str(payload.get("trial_run_id", "")), "-trial-"),
                      (event_id, "sweep_trial/")):
        tail = text.rsplit(sep, 1)[-1] if sep in text else ""
        # a trial number: sweep.trials is at most 1000, so six digits are plenty
        if tail.isascii() and tail.isdigit() and len(tail) <= 6:
            return int(tail)
    return fallback


def _params(value: Any) -> dict[str, float]:
    """The swept point: names (printable, at most 80 characters) to finite numbers; any
    other entry of a stored `params` is left out."""
    if not isinstance(value, dict):
        return {}
    return {printable(k, 80): float(v) for k, v in value.items()
            if isinstance(k, str) and _finite(v) is not None}


def sweep_rows(events: list[dict], trial_steps: int | None = None) -> list[TrialRow]:
    """Pure: one row per trial from a run's events, in trial order, the winner marked.
    `trial_steps` stands in for the steps of events that do not carry them."""
    rows: dict[int, TrialRow] = {}
    for n, e in enumerate(e for e in events if e["kind"] == "sweep_trial"):
        p = e["payload"]
        index = _index(p, str(e.get("event_id", "")), n)
        loss = _finite(p.get("result"))
        status = p.get("status") if p.get("status") in STATUSES else \
            "complete" if loss is not None else "diverged"
        steps = p.get("steps")
        rungs = [[int(r[0]), _finite(r[1])] for r in p.get("rungs") or []
                 if isinstance(r, (list, tuple)) and len(r) == 2 and _finite(r[0]) is not None]
        rid = p.get("trial_run_id")
        rows.setdefault(index, TrialRow(  # a trial's event written twice: the first stays
            trial=index, run_id=rid if valid_run_id(rid) else "",
            source=printable(p.get("source", ""), 40), round=int(p.get("round", 0)),
            params=_params(p.get("params")), status=status,
            val_loss=loss if status == "complete" else None,
            steps=steps if isinstance(steps, int) else trial_steps, rungs=rungs))
    ordered = [rows[i] for i in sorted(rows)]
    scored = [r for r in ordered if r.val_loss is not None]
    best = min(scored, key=lambda r: r.val_loss).trial if scored else None  # first on a tie
    return [TrialRow(**{**asdict(r), "winner": r.trial == best}) for r in ordered]


def _stored_trial_steps(durable_url: str, run_id: str) -> int | None:
    from spec import RunSpec
    from storage.runs import stored_spec

    raw = stored_spec(durable_url, run_id)
    try:
        return RunSpec.from_dict(raw).sweep.trial_steps if raw else None
    except BadConfig:
        return None


def _num(value: float | None) -> str:
    """A parameter for the table: whole numbers whole (a 16,384-token batch), the rest to
    four significant digits."""
    if value is None:
        return "-"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def _rungs(row: TrialRow) -> str:
    """`loss@step` at each rung boundary, comma-separated; `-` for none."""
    shown = [f"{'-' if v is None else f'{v:.4f}'}@{int(s)}" for s, v in row.rungs]
    return ",".join(shown) or "-"


def table(run_id: str, rows: list[TrialRow]) -> str:
    """Pure: the rows as an aligned text table, a star on the winner; a `rungs` column when
    the sweep was pruned."""
    names = sorted({k for r in rows for k in r.params})
    pruned = any(r.rungs for r in rows)
    head = ["", "trial", "source", *names, "status", "loss", "steps",
            *(["rungs"] if pruned else [])]
    body = [["*" if r.winner else "", str(r.trial), r.source,
             *(_num(r.params.get(k)) for k in names), r.status,
             "-" if r.val_loss is None else f"{r.val_loss:.4f}",
             "-" if r.steps is None else str(r.steps), *([_rungs(r)] if pruned else [])]
            for r in rows]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
             for line in [head, *body]]
    winner = next((r for r in rows if r.winner), None)
    if winner:
        point = ", ".join(f"{k} {_num(v)}" for k, v in sorted(winner.params.items()))
        close = f"winner: trial {winner.trial} ({point})"
    else:
        close = "no winner: no trial has a finite held-out loss"
    return "\n".join([f"run {run_id}: {len(rows)} sweep trial{'s' if len(rows) != 1 else ''}",
                      *lines, close, *([pruning_line(rows)] if pruned else [])])


def pruning_summary(rows: list[TrialRow]) -> dict[str, Any]:
    """Pure: how many trials the pruner stopped and the share of the trials' planned steps
    it saved (sweep/saving.py pruning_saving; a trial's planned steps: the longest's)."""
    planned = max((r.steps or 0) for r in rows)
    records = [{"steps": r.steps if r.steps is not None else planned} for r in rows]
    return {"trials_pruned": sum(1 for r in rows if r.status == "pruned"),
            "pruning_saving": pruning_saving(records, planned) if planned else 0.0,
            "trained_steps": sum(r["steps"] for r in records),
            "planned_steps": len(rows) * planned}


def pruning_line(rows: list[TrialRow]) -> str:
    p = pruning_summary(rows)
    return (f"pruning: {p['trials_pruned']} of {len(rows)} trials pruned, "
            f"{p['pruning_saving']:.0%} of the trials' steps saved "
            f"({p['trained_steps']} of {p['planned_steps']})")


def document(run_id: str, rows: list[TrialRow]) -> dict[str, Any]:
    """Pure: the table as one JSON-ready object (with `pruning` when the sweep was pruned)."""
    winner = next((r.trial for r in rows if r.winner), None)
    return {"run_id": run_id, "swept": bool(rows),
            "parameters": sorted({k for r in rows for k in r.params}),
            "winner": winner, "trials": [asdict(r) for r in rows],
            **({"pruning": pruning_summary(rows)} if any(r.rungs for r in rows) else {})}


def cmd_sweep(args: argparse.Namespace) -> int:
    from common import telemetry
    from ops.report import exit_code, missing_run
    from ops.store_fields import checked_events
    from storage.events import read_events

    # Logs (a damaged batch's warning) to stderr: stdout carries only the table.
    telemetry.configure_logging(os.environ.get("MAINSPRING_LOG_LEVEL", "warning"))
    try:
        events = checked_events(read_events(args.durable, args.run_id))
        if not events:
            raise missing_run(args.durable, args.run_id)
        rows = sweep_rows(events)
        if any(r.steps is None for r in rows):
            rows = sweep_rows(events, _stored_trial_steps(args.durable, args.run_id))
    except (BadConfig, StorageUnavailable) as exc:
        print(f"mainspring sweep: {printable(' '.join(redact(str(exc)).split()))}",
              file=sys.stderr)
        return exit_code(exc)
    if args.json:
        print(json_line(document(args.run_id, rows)))
    elif not rows:
        print(f"run {args.run_id}: no sweep — its event log holds no sweep_trial event "
              "(sweep.enabled false, or the sweep has not scored a trial yet).")
    else:
        print(table(args.run_id, rows))  # its cells printable (`table`)
    return 0

