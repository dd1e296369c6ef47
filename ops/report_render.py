"""Drawing for `mainspring report`: the loss curve (matplotlib, Agg) and the HTML page.

Everything here takes the rows ops/report.py extracted, in the shapes defined here
(`Window`, `LossSeries`); it imports nothing of the project and reads no storage — the
report builds the data, this draws it. matplotlib is imported inside plot_losses so
`mainspring --help` and the other commands stay fast.
"""

from __future__ import annotations

import base64
import html
import json
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """One train_metrics window, clipped to the steps it still speaks for."""

    first: int
    last: int
    mean: float | None
    lo: float | None
    hi: float | None
    skipped: int
    ts: float
    attempt: int


@dataclass(frozen=True)
class LossSeries:
    current: list[Window]  # the latest trajectory, by step
    abandoned: list[Window]  # replaced by a replay, in emission order


@dataclass(frozen=True)
class PlanChart:
    """The run's training time against `mainspring plan --from-run`'s prediction of it."""

    steps: list[int]  # each point's step
    actual_s: list[float]  # seconds from the first segment's start to that step's window
    predicted_s: list[float]  # what the prediction from the first 10 % foresaw there
    seen_steps: int  # the prefix the prediction saw
    figures: dict  # ops/plan_run.predict's figures
    note: str = ""  # why there is no chart (the prediction's refusal), else ""


def fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v, default=str)
    return str(v)


# kind -> (colour, line style, legend label) for events drawn as a vertical line.
VLINES = {
    "fault": ("#d62728", "--", "fault"),
    "recovered": ("#17becf", ":", "recovered (resumed step)"),
    "lr_adjusted": ("#9467bd", "-.", "LR lowered"),
    "needs_attention": ("#000000", "-", "needs attention"),
    "operator": ("#1f77b4", (0, (1, 3)), "operator command"),
}


def vline_step(e: dict) -> int | None:
    """Where an event's vertical line goes: the step it acted on."""
    p = e["payload"]
    if e["kind"] == "recovered":  # resumed_step None: no checkpoint yet, so a fresh start
        return p.get("resumed_step") or 0
    if e["kind"] == "lr_adjusted":
        return p.get("from_step", e["step"])
    return e["step"]


def branches(windows: list[Window]) -> list[list[Window]]:
    """Abandoned windows as contiguous runs (each one a trajectory a replay replaced)."""
    out: list[list[Window]] = []
    for w in windows:
        if out and out[-1][-1].last + 1 == w.first:
            out[-1].append(w)
        else:
            out.append([w])
    return out


def _nan(x: float | None) -> float:
    return float("nan") if x is None else x


def plot_losses(path: str, run_id: str, series: LossSeries, vals: list[tuple[int, float]],
                events: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on workers or CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(13, 5.5), dpi=110)
    try:
        draw_losses(ax, series, vals, events)
        ax.set(title=f"{run_id}: loss", xlabel="optimizer step", ylabel="loss (nats/token)")
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))  # one legend entry per kind
        if unique:
            ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left",
                      bbox_to_anchor=(1.01, 1.0))  # outside: never hides the curve
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def draw_losses(ax, series: LossSeries, vals: list[tuple[int, float]], events: list[dict]
                ) -> None:
    """The loss curves and every decision's mark on `ax` (loss.png and the training map)."""
    cur = series.current
    if cur:
        x = [w.last for w in cur]
        ax.fill_between(x, [_nan(w.lo) for w in cur], [_nan(w.hi) for w in cur],
                        color="#1f77b4", alpha=0.15, linewidth=0, label="train loss min–max")
        ax.plot(x, [_nan(w.mean) for w in cur], color="#1f77b4", lw=1.5,
                label="train loss (window mean)")
    for branch in branches(series.abandoned):
        ax.plot([w.last for w in branch], [_nan(w.mean) for w in branch], color="#7f7f7f",
                alpha=0.6, lw=1, marker="x", ms=4, zorder=3,
                label="abandoned (replayed) trajectory")
    if vals:
        ax.plot([s for s, _ in vals], [v for _, v in vals], color="#2ca02c", marker="o",
                ms=4, lw=1.2, label="held-out loss")
    if not cur and not vals:
        ax.text(0.5, 0.5, "no train_metrics or eval events in the log yet",
                transform=ax.transAxes, ha="center", va="center", color="#7f7f7f")
    top, bottom = ax.get_xaxis_transform(), ax.get_xaxis_transform()
    for e in events:
        kind, p = e["kind"], e["payload"]
        if kind == "rollback":
            ax.axvspan(p.get("to_step", e["step"]), p.get("at_step", e["step"]),
                       color="#ff7f0e", alpha=0.12, label="rollback (lost steps)")
            ax.axvline(p.get("at_step", e["step"]), color="#ff7f0e", lw=1.2, label="rollback")
        elif kind in VLINES and vline_step(e) is not None:
            color, style, label = VLINES[kind]
            ax.axvline(vline_step(e), color=color, ls=style, lw=1.2, label=label)
        elif kind == "loss_spike" and e["step"] is not None:
            if p.get("loss") is not None:
                ax.plot([e["step"]], [p["loss"]], "v", color="#d62728", ms=6, label="loss spike")
            else:  # a non-finite loss has no height: mark it on the top edge
                ax.plot([e["step"]], [0.97], "v", color="#d62728", ms=6, transform=top,
                        label="loss spike (non-finite)")
        elif kind == "batch_skipped" and e["step"] is not None:
            ax.plot([e["step"]], [0.02], "|", color="#000000", ms=10, mew=1.5,
                    transform=bottom, label="batch skipped")
        elif kind == "checkpoint_committed" and e["step"] is not None:
            ax.plot([e["step"]], [0.99], "v", color="#7f7f7f", ms=4, transform=top,
                    clip_on=False, label="checkpoint committed")
        elif kind == "promoted" and e["step"] is not None:
            ax.plot([e["step"]], [1.0], "*", color="#bcbd22", ms=12, transform=top,
                    clip_on=False, label="promoted")


def draw_plan(ax, chart: PlanChart) -> None:
    """The actual cumulative training time and the predicted one, by step, on `ax`."""
    ax.plot(chart.steps, chart.actual_s, color="#1f77b4", lw=1.5, marker=".", ms=3,
            label="actual (window times)")
    ax.plot(chart.steps, chart.predicted_s, color="#ff7f0e", lw=1.5, ls="--",
            label=f"predicted from the first {chart.seen_steps} steps")
    ax.axvspan(0, chart.seen_steps, color="#7f7f7f", alpha=0.15, label="what the plan saw")


def plot_plan(chart: PlanChart, run_id: str) -> bytes:
    """The plan chart as PNG bytes (inlined in the page)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4), dpi=90)
    try:
        draw_plan(ax, chart)
        ax.set(title=f"{run_id}: training time against the plan", xlabel="optimizer step",
               ylabel="seconds since training started")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png")
        return out.getvalue()
    finally:
        plt.close(fig)


PLAN_ROWS = [
    ("seen_steps", "steps the prediction saw"), ("total_steps", "steps"),
    ("seconds_per_step", "seconds per step"), ("startup_s", "start of a segment (s)"),
    ("tail_s", "end of a segment (s)"), ("segments", "segments"),
    ("predicted_s", "predicted training time (s)"), ("actual_s", "actual training time (s)"),
    ("error", "error (predicted ÷ actual − 1)"), ("faults", "faults (not foreseen)"),
    ("error_without_faults", "error without the faults' badput"),
]


def plan_html(chart: PlanChart | None, png_b64: str, run_id: str) -> str:
    """The plan section: the chart inline and the prediction's figures, or why none."""
    if chart is None or chart.note:
        return f"<p><em>no prediction: {html.escape(chart.note if chart else 'no record')}</em></p>"
    rows = "".join(f"<tr><th>{html.escape(title)}</th><td>{cell(chart.figures.get(k))}</td></tr>"
                   for k, title in PLAN_ROWS)
    return (f"<p>What <code>mainspring plan --from-run {html.escape(run_id)}</code> predicts "
            f"from the first 10 % of the steps, against the run.</p>"
            f"<img alt=\"training time of {html.escape(run_id)} against the plan\" "
            f"src=\"data:image/png;base64,{png_b64}\"><table>{rows}</table>")


# ---- HTML ---------------------------------------------------------------------------------
STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f2f2f2}tr.rollback,tr.fault{background:#fff3e0}
tr.needs_attention{background:#fde0e0}tr.recovered{background:#e8f5e9}img{max-width:100%}
code{font-size:12px}.map{display:flex;align-items:stretch;gap:0;margin:1em 0}
.stage{flex:1;border:1px solid #888;border-radius:6px;padding:4px 8px;font-size:12px}
.stage h3{margin:.2em 0;font-size:14px}.stage ul{padding-left:1.1em;margin:.3em 0}
.stage .cost{color:#444;margin:.2em 0}.arrow{align-self:center;font-size:24px;padding:0 4px}"""


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + "Z"


def cell(v: object) -> str:
    if v is None or v == "":
        return "–"
    return html.escape(fmt(v))


def table(rows: list[dict], columns: list[tuple[str, str]], *, row_class: str = "") -> str:
    """An escaped HTML table; `row_class` names a column whose value becomes the row class."""
    if not rows:
        return "<p><em>none</em></p>"
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in columns)
    body = []
    for r in rows:
        cls = f' class="{html.escape(str(r.get(row_class, "")))}"' if row_class else ""
        tds = "".join(f"<td>{when(r[k]) if k == 'ts' else cell(r.get(k))}</td>"
                      for k, _ in columns)
        body.append(f"<tr{cls}>{tds}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


SUMMARY_ROWS = [
    ("status", "status"), ("initialized_from", "started from (train.init_from)"),
    ("first_step", "first step"), ("last_step", "last step"),
    ("final_train_loss", "final training loss (last window)"),
    ("initial_val_loss", "initial held-out loss"), ("final_val_loss", "final held-out loss"),
    ("final_val_step", "…at step"), ("promoted_step", "promoted checkpoint step"),
    ("promoted_uri", "promoted checkpoint"), ("wall_s", "wall time, first to last event (s)"),
    ("faults", "faults"), ("recoveries", "recoveries (retries)"), ("rollbacks", "rollbacks"),
    ("batch_skippeds", "batches skipped"), ("loss_spikes", "loss spikes"),
    ("lost_steps", "steps lost (retries + rollbacks)"),
    ("checkpoint_committeds", "checkpoints committed"), ("operators", "operator commands"),
    ("abandoned_windows", "abandoned metric windows"), ("events", "events"),
]


GOODPUT_ROWS = [
    ("goodput", "goodput (kept productive step time ÷ run wall time)"),
    ("train_goodput", "train-stage goodput (÷ the train stage's wall time)"),
    ("wall_s", "run wall time (s)"), ("train_wall_s", "train stage wall time (s)"),
    ("productive_s", "productive step time (s)"), ("steps_executed", "step executions"),
    ("steps_kept", "steps kept (final trajectory)"), ("steps_replayed", "step executions replayed"),
    ("injected_faults", "injected faults (chaos, not counted as faults)"),
    ("spans", "spans in the record"),
]


def goodput_html(goodput: dict | None) -> str:
    """The goodput section: headline figures, the time table, MTTR per fault kind."""
    if not goodput:
        return "<p><em>none</em></p>"
    figures = goodput["figures"]
    note = ("" if figures.get("spans") else "<p><em>no spans stored for this run: step time, "
            "and so goodput, unknown; the table itemises only what the event log says</em></p>")
    rows = "".join(f"<tr><th>{html.escape(title)}</th><td>{cell(figures.get(k))}</td></tr>"
                   for k, title in GOODPUT_ROWS)
    time_columns = [("cause", "productive / badput cause"), ("seconds", "seconds"),
                    ("percent", "% of wall")]
    if goodput["time"] and "accel_h" in goodput["time"][0]:  # priced by the training map
        time_columns += [("accel_h", "accelerator-hours"), ("cost", "cost")]
    return (f"{note}<table>{rows}</table><h3>Where the run's wall time went</h3>"
            + table(goodput["time"], time_columns)
            + "<h3>MTTR per fault kind (real faults)</h3>"
            + table(goodput["faults"], [
                ("kind", "kind"), ("count", "faults"), ("recovered", "recovered"),
                ("mttr_s_median", "MTTR median (s)"), ("mttr_s_max", "MTTR max (s)"),
                ("lost_steps", "lost steps")]))


def render_html(*, run_id: str, store: str, png_path: str, summary: dict, timeline: list[dict],
                faults: list[dict], recoveries: list[dict], rollbacks: list[dict],
                checkpoints: list[dict], goodput: dict | None = None,
                training_map: str = "", incidents: tuple[str, ...] = (),
                plan: str = "") -> str:
    """One self-contained page: the PNG inline (base64), every value escaped. `goodput`:
    ops/report.goodput_section's rows; `training_map`: the map's section, rendered and
    escaped already (ops/report_map_render.map_html), first on the page; `incidents`: each
    incident in words (ops/explain.py), as `mainspring explain` tells it; `plan`: the plan
    section, rendered and escaped already (plan_html)."""
    with open(png_path, "rb") as f:
        png = base64.b64encode(f.read()).decode("ascii")
    faults = [{**r, "handled_by": " ".join(r["handled_by"])} for r in faults]
    rid, where = html.escape(run_id), html.escape(store)
    summary_rows = "".join(f"<tr><th>{html.escape(title)}</th><td>{cell(summary.get(k))}</td></tr>"
                           for k, title in SUMMARY_ROWS)
    told = "".join(f"<li>{html.escape(text)}</li>" for text in incidents)
    sections = [
        ("Incidents", f"<ol>{told}</ol>" if told else "<p>none</p>"),
        ("Goodput and badput (from the durable record)", goodput_html(goodput)),
        *([("Training time against the plan", plan)] if plan else []),
        ("Faults and how they were handled", table(faults, [
            ("ts", "time"), ("step", "step"), ("kind", "kind"), ("evidence", "evidence"),
            ("handled_by", "handled by"), ("lost_steps", "lost steps"),
            ("mttr_s", "recovered in (s)")])),
        ("Recoveries (segment retries)", table(recoveries, [
            ("ts", "time"), ("attempt", "attempt"), ("resumed_step", "resumed at step"),
            ("last_step_seen", "last step seen"), ("heartbeat_step", "heartbeat step"),
            ("lost_steps", "lost steps"), ("mttr_s", "MTTR (s)")])),
        ("Rollbacks", table(rollbacks, [
            ("ts", "time"), ("at_step", "at step"), ("onset", "spike onset"),
            ("to_step", "restored step"), ("skip", "skipped data window"),
            ("lost_steps", "lost steps"), ("reason", "reason"), ("loss", "loss"),
            ("threshold", "threshold")])),
        ("Checkpoints", table(checkpoints, [
            ("ts", "time"), ("step", "step"), ("bytes", "bytes"), ("status", "status"),
            ("uri", "uri")])),
        ("Timeline of decisions", table(timeline, [
            ("ts", "time"), ("step", "step"), ("kind", "kind"), ("evidence", "evidence")],
            row_class="kind")),
    ]
    body = "".join(f"<h2>{html.escape(title)}</h2>{content}" for title, content in sections)
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>mainspring report: {rid}"
            f"</title><style>{STYLE}</style></head><body><h1>Run {rid}</h1>"
            f"<p>From the event log at <code>{where}</code>, generated {when(time.time())}.</p>"
            + (f"<h2>Training map</h2>{training_map}<h2>Loss</h2>" if training_map else "")
            + f"<img alt=\"loss curve of {rid}\" src=\"data:image/png;base64,{png}\">"
            f"<h2>Summary</h2><table>{summary_rows}</table>{body}</body></html>\n")
