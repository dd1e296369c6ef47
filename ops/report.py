"""`mainspring report RUN`: a loss curve PNG and a self-contained HTML page (DESIGN §6).

Reads only the durable event log, so it works during a run, after it, and after a crash
of everything else (no Temporal needed). The curve comes from the supervisor's
`train_metrics` windows (activities/metrics.py), held-out loss from `eval` events; every
decision (spike, skip, rollback, fault, recovery, LR change, pause, operator command,
checkpoint) is marked on the plot and listed with its evidence.

Replayed steps (after a rollback or a retry) keep the *latest* trajectory: for each step
the window emitted last speaks for it; windows left with no step are the abandoned branch,
drawn faintly. The extraction below is pure (events in, rows out) and tested that way;
ops/report_render.py draws the rows (and defines the shapes it draws), never the reverse.

Goodput, badput by cause and MTTR per fault kind come from the durable record too: the
event log and the run's stored spans (storage/spans.py), through ops/goodput.from_record.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import sys
from collections.abc import Iterable

import structlog

from common.errors import BadConfig, StorageUnavailable
from common.redact import redact, redact_value
from ops.cli_args import run_command
from ops.cli_output import printable
from ops.goodput import from_record
from ops.report_map import (
    accelerators,
    dataset_stats,
    hour_price,
    layout_of,
    priced,
    training_map,
    trials_of,
)
from ops.report_map_render import TrainingMap, map_html, plot_map
from ops.report_render import (
    LossSeries,
    PlanChart,
    Window,
    fmt,
    plan_html,
    plot_losses,
    plot_plan,
    render_html,
)
from ops.step_ranges import merged, uncovered
from ops.store_fields import loss_window, whole

log = structlog.get_logger(__name__)

# Periodic records, not decisions: plotted or tabled on their own, kept out of the timeline.
PERIODIC = ("train_metrics", "checkpoint_saved", "checkpoint_committed", "eval")

# The evidence worth a column, per kind; other kinds show their scalar payload fields.
KEY_FIELDS: dict[str, tuple[str, ...]] = {
    "loss_spike": ("reason", "loss", "baseline", "threshold", "spread", "outlier_steps"),
    "batch_skipped": ("reason", "loss", "batches"),
    "rollback": ("at_step", "onset", "to_step", "skip", "lost_steps", "reason", "loss",
                 "threshold", "discarded"),
    "fault": ("kind", "evidence", "at_step", "cursors", "steps", "factor", "injected"),
    "recovered": ("resumed_step", "lost_steps", "mttr_s", "attempt", "heartbeat_step",
                  "last_step_seen"),
    "lr_adjusted": ("scale", "from_step", "until_step", "reason", "rollback_steps"),
    "needs_attention": ("reason", "failure", "fingerprint", "repeats", "rollback_steps", "fix"),
    "oom_adapted": ("micro_batch", "grad_accum", "global_batch_sequences", "evidence"),
    "run_resumed": ("note", "paused_for"),
    "operator": ("command", "args", "who", "note", "accepted_at_step"),
    "checkpoint_corrupt": ("file", "expected", "actual"),
    "overfitting": ("evidence", "early_stop"),
    "segment_started": ("from_step", "to_step", "attempt"),
    "segment_finished": ("from_step", "to_step", "attempt", "train_loss", "resumed_from"),
    "promoted": ("uri", "bytes"),
}


def ordered(events: Iterable[dict]) -> list[dict]:
    return sorted(events, key=lambda e: (e["ts"], e["event_id"]))


def _emit_order(e: dict) -> tuple:
    # Windows of one poll can share a timestamp; attempt and seq break the tie in the
    # order the forwarder emitted them (the event_id's seq would sort "10" before "9").
    p = e["payload"]
    return (e["ts"], p.get("attempt", e.get("attempt", 0)), p.get("seq", 0), e["event_id"])


def loss_series(events: Iterable[dict]) -> LossSeries:
    """Training loss windows: for each step the latest-emitted window covering it wins.

    A window partly replaced keeps the steps still its own (its statistics include the
    replaced steps; windows end on multiples of `every`, and rollbacks and retries restart
    at checkpoint steps, so this is rare). Worked out on step ranges, newest window first,
    never step by step: a window is two numbers however many steps it claims, so a record
    claiming steps 0 to 10^12 costs what any other does.
    """
    wins = sorted(filter(loss_window, events), key=_emit_order)
    taken: list[tuple[int, int]] = []  # steps later windows own: sorted, disjoint ranges
    owned: dict[int, tuple[int, int]] = {}
    for i in range(len(wins) - 1, -1, -1):
        p = wins[i]["payload"]
        free = uncovered(p["first_step"], p["last_step"], taken)
        if free:
            owned[i] = (free[0][0], free[-1][1])
            taken = merged(taken, (p["first_step"], p["last_step"]))
    current = sorted((_window(wins[i], a, b) for i, (a, b) in owned.items()),
                     key=lambda w: w.last)
    abandoned = [_window(e, e["payload"]["first_step"], e["payload"]["last_step"])
                 for i, e in enumerate(wins) if i not in owned]
    return LossSeries(current=current, abandoned=abandoned)


def _window(e: dict, first: int, last: int) -> Window:
    p = e["payload"]
    return Window(first=first, last=last, mean=p.get("loss_mean"), lo=p.get("loss_min"),
                  hi=p.get("loss_max"), ts=e["ts"],
                  skipped=p["skipped"] if whole(p.get("skipped"), 0, 2**53) else 0,
                  attempt=p.get("attempt", e.get("attempt", 0)))


def val_series(events: Iterable[dict]) -> list[tuple[int, float]]:
    """Held-out loss per step from `eval` events and the evaluate stage; the latest wins."""
    latest: dict[int, float] = {}
    for e in ordered(events):
        p = e["payload"]
        if e["kind"] == "eval" and e["step"] is not None and finite(p.get("val_loss")):
            latest[e["step"]] = float(p["val_loss"])
        elif e["kind"] == "stage_finished" and p.get("stage") == "evaluate":
            for step, val in (p.get("val_loss") or {}).items():  # checked: digit keys
                if finite(val):
                    latest[int(step)] = float(val)
    return sorted(latest.items())


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def evidence(e: dict, limit: int = 300) -> str:
    """The event's key payload fields as `k=v` text (the kind's KEY_FIELDS, else all)."""
    p = e["payload"]
    keys = KEY_FIELDS.get(e["kind"]) or sorted(p)
    text = " ".join(f"{k}={fmt(p[k])}" for k in keys if k in p and p[k] not in (None, ""))
    return printable(text, limit)


def timeline(events: Iterable[dict]) -> list[dict]:
    """Every decision event in order: time, step, kind, evidence."""
    return [{"ts": e["ts"], "step": e["step"], "kind": e["kind"], "evidence": evidence(e)}
            for e in ordered(events) if e["kind"] not in PERIODIC]


HANDLERS = ("recovered", "rollback", "batch_skipped", "lr_adjusted", "needs_attention",
            "oom_adapted")


def fault_rows(events: Iterable[dict]) -> list[dict]:
    """Each fault with what handled it. A decision that names its fault (`fault_event_id`,
    and a multi-node launch's `also_answers`: a `recovered` event) goes to that fault's
    row; one that names none to the newest fault before it (a spike's skips and rollback
    follow the fault that caused them)."""
    rows: list[dict] = []
    by_id: dict[str, dict] = {}
    for e in ordered(events):
        if e["kind"] == "fault":
            rows.append({"ts": e["ts"], "step": e["step"], "kind": e["payload"].get("kind"),
                         "evidence": evidence(e), "handled_by": [], "lost_steps": 0,
                         "mttr_s": None})
            by_id[e["event_id"]] = rows[-1]
        elif rows and e["kind"] in HANDLERS:
            p = e["payload"]
            row = by_id.get(p.get("fault_event_id"), rows[-1])
            peers = [by_id[i] for i in p.get("also_answers") or () if by_id.get(i) not in (None, row)]
            for answered in (row, *peers):
                answered["handled_by"].append(f"{e['kind']}@{e['step']}")
                if e["kind"] == "recovered" and answered["mttr_s"] is None:
                    answered["mttr_s"] = p.get("mttr_s")
                elif answered["mttr_s"] is None and e["kind"] == "rollback":
                    answered["mttr_s"] = round(e["ts"] - answered["ts"], 2)
            row["lost_steps"] += p.get("lost_steps") or 0  # counted once, on the named fault
    return rows


def recovery_rows(events: Iterable[dict]) -> list[dict]:
    """Every retry that resumed training (a `recovered` event), injected fault or not."""
    return [{"ts": e["ts"], **{k: e["payload"].get(k) for k in (
        "attempt", "resumed_step", "heartbeat_step", "last_step_seen", "lost_steps", "mttr_s")}}
            for e in ordered(events) if e["kind"] == "recovered"]


def rollback_rows(events: Iterable[dict]) -> list[dict]:
    return [{"ts": e["ts"], **{k: e["payload"].get(k) for k in (
        "at_step", "onset", "to_step", "skip", "lost_steps", "reason", "loss", "threshold")}}
            for e in ordered(events) if e["kind"] == "rollback"]


def checkpoint_rows(events: Iterable[dict]) -> list[dict]:
    """Committed checkpoints with what became of them: discarded by a later rollback,
    found corrupt, or promoted (the newest commit of the promoted step)."""
    evs = ordered(events)
    rows = [{"ts": e["ts"], "step": e["step"], "bytes": e["payload"].get("bytes"),
             "uri": e["payload"].get("uri", ""), "status": []}
            for e in evs if e["kind"] == "checkpoint_committed"]
    for e in (e for e in evs if e["kind"] in ("rollback", "checkpoint_corrupt")):
        p = e["payload"]  # only those two mark a row: not each row for each of 55k events
        for row in rows:
            if row["ts"] >= e["ts"]:
                continue
            if e["kind"] == "rollback" and row["step"] in (p.get("discarded") or ()):
                row["status"].append(f"discarded by rollback@{e['step']}")
            elif e["kind"] == "checkpoint_corrupt" and row["step"] == e["step"]:
                row["status"].append("corrupt")
    promoted = [e for e in evs if e["kind"] == "promoted"]
    if promoted:
        mine = [r for r in rows if r["step"] == promoted[-1]["step"]]
        if mine:
            mine[-1]["status"].append("promoted")
    return [{**r, "status": ", ".join(dict.fromkeys(r["status"])) or "committed"} for r in rows]


def summary(events: list[dict], series: LossSeries,
            vals: list[tuple[int, float]]) -> dict:
    evs = ordered(events)
    kinds = [e["kind"] for e in evs]
    promoted = [e for e in evs if e["kind"] == "promoted"]
    with_loss = [w for w in series.current if w.mean is not None]
    finished = [e for e in evs if e["kind"] == "run_finished"]
    lineage = [e["payload"] for e in evs if e["kind"] == "initialized_from"]
    return {
        "initialized_from": (f"run {lineage[-1].get('source_run')}, promoted step "
                             f"{lineage[-1].get('source_step')} ({lineage[-1].get('uri')})"
                             if lineage else None),
        "first_step": series.current[0].first if series.current else None,
        "last_step": series.current[-1].last if series.current else None,
        "final_train_loss": with_loss[-1].mean if with_loss else None,
        "initial_val_loss": vals[0][1] if vals and vals[0][0] == 0 else None,
        "final_val_loss": vals[-1][1] if vals else None,
        "final_val_step": vals[-1][0] if vals else None,
        "promoted_step": promoted[-1]["step"] if promoted else None,
        "promoted_uri": promoted[-1]["payload"].get("uri") if promoted else None,
        "status": finished[-1]["payload"].get("status") if finished else "not finished",
        "wall_s": round(evs[-1]["ts"] - evs[0]["ts"], 1) if evs else 0.0,
        "events": len(evs),
        **{f"{k}s": kinds.count(k) for k in ("fault", "rollback", "batch_skipped", "loss_spike",
                                             "checkpoint_committed", "operator")},
        "recoveries": kinds.count("recovered"),
        "lost_steps": sum(e["payload"].get("lost_steps") or 0 for e in evs
                          if e["kind"] in ("recovered", "rollback")),
        "abandoned_windows": len(series.abandoned),
    }


def goodput_section(events: list[dict], spans: list[dict], now: float | None = None, *,
                    rec: dict | None = None) -> dict:
    """The report's goodput rows (ops/goodput.from_record): headline figures, where the
    run's wall time went (productive first, then each badput cause, with its share), and
    real faults per kind with their MTTR. Without spans (a run from before the trainer
    stored them) the step time is unknown: goodput is None, not 0. `rec`: from_record's
    answer when the caller has it (over a 30-day record it costs seconds)."""
    rec = rec if rec is not None else from_record(events, spans, now)
    wall, train = rec["wall_s"], rec["train"]
    parts = {"productive": rec["productive_s"], **rec["badput_s"]}
    known = bool(spans)
    return {
        "figures": {"goodput": rec["goodput"] if known else None,
                    "train_goodput": train["goodput"] if known else None,
                    "wall_s": wall, "train_wall_s": train["wall_s"],
                    "productive_s": rec["productive_s"], **{
                        f"steps_{k}": v for k, v in rec["steps"].items()},
                    "injected_faults": rec["injected_faults"], "spans": len(spans)},
        "time": [{"cause": c, "seconds": round(v, 3),
                  "percent": round(100 * v / wall, 2) if wall > 0 else None}
                 for c, v in parts.items()],
        "faults": [{"kind": k, **{f: round(v, 3) if isinstance(v, float) else v
                                  for f, v in row.items()}}
                   for k, row in rec["faults"].items()],
    }


def plan_chart(events: list[dict], spans: list[dict], *, rec: dict | None = None
               ) -> PlanChart:
    """The run's training time by step against `mainspring plan --from-run`'s prediction
    from its first 10 % (ops/plan_run.py, the same code): for each window of the latest
    trajectory, the seconds from the first segment's start to it and the prediction's at
    its step; the last point is the training's end. A run the prediction refuses (too
    short, never trained) gets the refusal as its note."""
    from ops.plan_run import FAULT_CAUSES, predict, predicted_at, training_span

    try:
        span = training_span(events, spans)
        badput = (rec if rec is not None else from_record(events, spans))["badput_s"]
        figures = predict(span, fault_s=sum(badput.get(c) or 0.0 for c in FAULT_CAUSES))
    except BadConfig as exc:
        return PlanChart(steps=[], actual_s=[], predicted_s=[], seen_steps=0, figures={},
                         note=exc.problem)
    start = span["start_ts"]
    points = [(w.last, w.ts - start) for w in loss_series(events).current if w.ts >= start]
    if span["finished"]:
        points = [p for p in points if p[0] < figures["total_steps"]]
        points.append((figures["total_steps"], figures["actual_s"]))
    return PlanChart(steps=[s for s, _ in points], actual_s=[t for _, t in points],
                     predicted_s=[predicted_at(s, figures) for s, _ in points],
                     seen_steps=figures["seen_steps"], figures=figures)


def list_runs(durable_url: str, limit: int = 20) -> list[str]:
    """Run ids with an event log under the store (for the not-found message)."""
    from ops.store_fields import valid_run_id
    from storage.fs import join, resolve

    try:
        fs, root = resolve(durable_url)
        names = sorted(n for n in (p.rstrip("/").rsplit("/", 1)[-1]
                                   for p in fs.ls(join(root, "runs"), detail=False))
                       if valid_run_id(n))  # a name in the store is not shown unchecked
        return [n for n in names if fs.exists(join(root, "runs", n, "events"))][-limit:]
    except (FileNotFoundError, StorageUnavailable, OSError):
        return []


def exit_code(exc: BaseException) -> int:
    """Pure: a read command's exit code for `exc` — 1 when the run is not there or its store
    cannot be reached (like `mainspring run status` of an unknown run), 2 for bad arguments."""
    return 1 if isinstance(exc, StorageUnavailable) or getattr(exc, "field", "") == "run_id" \
        else 2


def missing_run(durable_url: str, run_id: str) -> BadConfig:
    """The error for a run with no event log: where we looked, what is there, how to list."""
    from storage.fs import normalize_url

    url = normalize_url(durable_url)
    runs = list_runs(durable_url)
    listing = (f"`ls {url[len('file://'):]}/runs/`" if url.startswith("file://")
               else f"`aws s3 ls {url}/runs/`" if url.startswith("s3://")
               else f"a listing of {url}/runs/")
    found = (f"runs with an event log there: {', '.join(runs)}" if runs
             else "no run has an event log there")
    return BadConfig("run_id", f"no events for run {run_id!r} under {url}/runs/{run_id}/events "
                               f"({found})",
                     f"pass a run id from {listing}, or --durable the store the run used "
                     "(its spec's storage.durable)")


def build_report(durable_url: str, run_id: str, out_dir: str, *,
                 price: float | None = None) -> dict[str, str]:
    """Write loss.png, training_map.png and report.html for `run_id` into out_dir; return
    their paths. `price` per accelerator-hour overrides the spec's ops.accelerator_hour_price."""
    from ops.explain import incidents
    from ops.store_fields import checked_events, checked_spans
    from storage.events import read_events
    from storage.fs import normalize_url
    from storage.spans import read_spans

    # Scrubbed again here: a log written before redaction existed, or by another tool,
    # must not carry a secret into a page that is mailed around.
    events = checked_events(redact_value(read_events(durable_url, run_id)))
    if not events:
        raise missing_run(durable_url, run_id)
    from storage.runs import stored_spec

    spec = stored_spec(durable_url, run_id)
    hourly = hour_price(spec, price)  # a bad price is refused before anything is written
    spans = checked_spans(read_spans(durable_url, run_id))
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    series, vals = loss_series(events), val_series(events)
    png = os.path.join(out_dir, "loss.png")
    plot_losses(png, run_id, series, vals, ordered(events))
    rec = from_record(events, spans)  # one walk of the record for the map, goodput, plan
    tmap = training_map_of(durable_url, run_id, events, spans, spec, hourly, rec=rec)
    map_png = os.path.join(out_dir, "training_map.png")
    problems = plot_map(map_png, run_id, tmap, series, vals, ordered(events))
    if problems:  # legible is the point of the picture: say so where someone will look
        log.warning("training_map_hard_to_read", run_id=run_id, problems=problems[:5])
    goodput = goodput_section(events, spans, rec=rec)
    goodput["time"] = priced(goodput["time"], tmap.accelerators, hourly)
    with open(map_png, "rb") as f:
        map_b64 = base64.b64encode(f.read()).decode("ascii")
    chart = plan_chart(events, spans, rec=rec)
    plan_b64 = ("" if chart.note else
                base64.b64encode(plot_plan(chart, run_id)).decode("ascii"))
    page = os.path.join(out_dir, "report.html")
    with open(page, "w", encoding="utf-8") as f:
        f.write(render_html(
            run_id=run_id, store=redact(normalize_url(durable_url)), png_path=png,
            summary=summary(events, series, vals), timeline=timeline(events),
            faults=fault_rows(events), recoveries=recovery_rows(events),
            rollbacks=rollback_rows(events), checkpoints=checkpoint_rows(events),
            goodput=goodput, training_map=map_html(tmap, map_b64, run_id),
            incidents=tuple(i.text.split(": ", 1)[1] for i in incidents(events, spec)),
            plan=plan_html(chart, plan_b64, run_id)))
    log.info("report_written", run_id=run_id, png=png, map=map_png, html=page,
             events=len(events), windows=len(series.current))
    return {"png": png, "map": map_png, "html": page}


def training_map_of(durable_url: str, run_id: str, events: list[dict], spans: list[dict],
                    spec: dict | None, price: float, *, rec: dict | None = None
                    ) -> TrainingMap:
    """The map's records gathered from the store: the dataset manifest's stats and each
    sweep trial's loss curve (its own event log), with the accelerators of the spec."""
    from ops.store_fields import checked_events, valid_run_id
    from storage.events import read_events

    stats, source = dataset_stats(durable_url, events)
    curves = {}
    for e in events:
        rid = e["payload"].get("trial_run_id") if e["kind"] == "sweep_trial" else None
        if rid and not valid_run_id(rid):  # `../x` would read another directory's events
            log.warning("sweep_trial_run_id_invalid", run_id=run_id,
                        trial_run_id=printable(rid, 80))
        elif rid and rid not in curves:
            windows = loss_series(checked_events(redact_value(
                read_events(durable_url, rid)))).current
            curves[rid] = [(w.last, w.mean) for w in windows if w.mean is not None]
    count, count_from = accelerators(spec, spans)
    rec = rec if rec is not None else from_record(events, spans)
    return training_map(events, rec, stats=stats, stats_source=source,
                        trials=trials_of(events, curves), accelerators=count,
                        accelerators_from=count_from, price=price, layout=layout_of(spec))


def cmd_report(args: argparse.Namespace) -> int:
    from common import telemetry

    # Logs to stderr: stdout carries only the one JSON line with the paths.
    telemetry.configure_logging(os.environ.get("MAINSPRING_LOG_LEVEL", "warning"))
    out = args.out or os.path.join(".mainspring", "reports", args.run_id)
    try:
        paths = build_report(args.durable, args.run_id, out, price=args.price)
    except (BadConfig, StorageUnavailable) as exc:
        print(f"mainspring report: {exc}", file=sys.stderr)
        return exit_code(exc)
    print(json.dumps({"run_id": args.run_id, **paths}))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `report RUN_ID [--durable URL] [--out DIR] [--price P]` to the CLI's subcommands."""
    p = run_command(sub, "report", "loss curve PNG + HTML of a run, from its event log")
    p.add_argument("--out", default="",
                   help="output directory (default .mainspring/reports/RUN_ID)")
    p.add_argument("--price", type=float, default=None,
                   help="price of one accelerator-hour (default: the run spec's "
                        "ops.accelerator_hour_price; 0: unpriced)")
    p.set_defaults(fn=cmd_report)
