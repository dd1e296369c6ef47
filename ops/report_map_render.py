"""Drawing the training map (ops/report_map.py builds it): one PNG and its HTML section.

The PNG, top to bottom: the five stages as boxes joined by arrows, each with its wall time,
accelerator-hours and figures; the loss curves (ops/report_render.draw_losses, the same
marks as loss.png); the sweep's trials (each trial's training loss, and held-out loss
against the swept parameter); the cost by row. Like ops/report_render.py it imports
nothing of the project beyond that renderer and reads no storage. Legibility is checked,
not hoped for: a box's text shrinks until it fits its box (`fit_text`), and
`overlapping_texts` lists any two labels of the figure that collide (the tests call it).
"""

from __future__ import annotations

import html
import itertools
import textwrap
from dataclasses import dataclass, field

from ops.report_render import LossSeries, cell, draw_losses, table


@dataclass(frozen=True)
class StageBox:
    stage: str  # activities/contracts.STAGES
    title: str
    wall_s: float | None  # stage_started -> stage_finished; None: the stage never started
    accel_h: float | None  # wall_s × accelerators / 3600
    lines: tuple[str, ...]  # the figures as text, in the order drawn
    figures: dict = field(default_factory=dict)  # the numbers behind the lines


@dataclass(frozen=True)
class Trial:
    index: int
    run_id: str
    params: dict
    val_loss: float | None  # None: not finite
    round: int
    source: str  # prior (the Step Law point, trial 0) | tpe | gp: the sampler that chose it
    best: bool
    curve: list[tuple[int, float]]  # (step, training loss) of the trial's metrics windows


@dataclass(frozen=True)
class CostRow:
    row: str
    causes: tuple[str, ...]  # the ops/goodput.from_record parts it adds up
    seconds: float
    accel_h: float
    cost: float
    percent: float | None  # of the run's wall time


@dataclass(frozen=True)
class TrainingMap:
    boxes: list[StageBox]
    trials: list[Trial]
    cost: list[CostRow]  # adds up to wall_s × accelerators
    accelerators: int
    accelerators_from: str
    price: float  # per accelerator-hour; 0: unpriced
    wall_s: float
    accel_h: float


COLOURS = {"prepare_data": "#e3f2fd", "warmup_sweep": "#f3e5f5", "train": "#fff3e0",
           "evaluate": "#e8f5e9", "promote": "#fffde7"}
# the cost rows in ops/report_map.COST_GROUPS order: productive green, lost red, then each
# cause in its own colour, other / idle grey
BAR_COLOURS = ("#2ca02c", "#d62728", "#9467bd", "#17becf", "#8c564b", "#ff7f0e", "#1f77b4",
               "#e377c2", "#7f7f7f")
WRAP = 35  # characters per line in a box: 5 boxes across an 18-inch figure at 10 pt
# points: a box's header (title, wall time, accelerator-hours), a line of 10 pt text at
# line spacing 1.45 (measured on DejaVu Sans)
HEAD, LINE = 62, 16


def duration(s: float | None) -> str:
    if s is None:
        return "–"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    if s < 86400:
        return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"
    return f"{int(s // 86400)} d {int(s % 86400 // 3600)} h"


def fmt_num(v: object, spec: str = ",") -> str:
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return "–" if v is None else str(v)
    return format(v, spec)


def fmt_accel_h(h: float | None) -> str:
    if h is None:
        return "–"
    return f"{h:,.0f}" if abs(h) >= 100 else f"{h:.2f}" if abs(h) >= 1 else f"{h:.3g}"


def params_text(params: dict) -> str:
    return ", ".join(f"{k} {v:.2g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in sorted(params.items())) or "defaults"


def fmt_bytes(n: object) -> str:
    if not isinstance(n, (int, float)):
        return "–"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def box_cost(box: StageBox) -> str:
    return f"{duration(box.wall_s)} wall · {fmt_accel_h(box.accel_h)} accelerator-h"


def headline(tmap: TrainingMap) -> str:
    text = (f"{duration(tmap.wall_s)} wall × {tmap.accelerators} "
            f"accelerator{'s' if tmap.accelerators != 1 else ''} = "
            f"{fmt_accel_h(tmap.accel_h)} accelerator-hours")
    if tmap.price:
        text += f" × {tmap.price:g} per hour = {tmap.accel_h * tmap.price:,.2f}"
    return text


# ---- the PNG ----------------------------------------------------------------------------
def plot_map(path: str, run_id: str, tmap: TrainingMap, series: LossSeries,
             vals: list[tuple[int, float]], events: list[dict]) -> list[str]:
    """Write the training map PNG; return what makes it hard to read (empty: nothing):
    labels that overlap, box texts that do not fit their box even at the smallest size."""
    import matplotlib

    matplotlib.use("Agg")  # no display on workers or CI
    import matplotlib.pyplot as plt

    rows = [stages_height(tmap), 4.4, 4.0]  # inches: boxes, loss curves, sweep and cost
    fig = plt.figure(figsize=(18, sum(rows) + 1.0), dpi=100, layout="constrained")
    try:
        # a row each, laid out on its own: the loss legend's margin is that row's alone
        top, middle, bottom = fig.subfigures(3, 1, height_ratios=rows)
        boxes = draw_stages(top.add_subplot(), tmap)
        loss = middle.add_subplot()
        draw_losses(loss, series, vals, events)
        loss.set(title="Loss: training (mean and min–max of each metrics window) and held-out "
                       "(each evaluation)", xlabel="optimizer step", ylabel="loss (nats/token)")
        loss.grid(alpha=0.3)
        handles, labels = loss.get_legend_handles_labels()
        unique = dict(zip(labels, handles))  # one entry per kind, outside: never on the curve
        if unique:
            loss.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left",
                        bbox_to_anchor=(1.005, 1.0))
        curves, scatter, cost = bottom.subplots(1, 3, width_ratios=[1, 1, 1.15])
        draw_trial_curves(curves, tmap.trials)
        draw_trial_scatter(scatter, tmap.trials)
        draw_cost(cost, tmap)
        fig.suptitle(f"Training map of run {run_id} — {headline(tmap)}", fontsize=14,
                     fontweight="bold")
        fig.canvas.draw()  # lay out, then shrink any box text that does not fit its box
        unfit = [f"the text of box {box.title!r} does not fit it" for box, (patch, texts)
                 in zip(tmap.boxes, boxes) if not fit_text(fig, patch, texts)]
        fig.savefig(path, format="png")
        return unfit + overlapping_texts(fig)
    finally:
        plt.close(fig)


def box_body(box: StageBox) -> str:
    """A box's lines, wrapped to its width (continuations indented)."""
    return "\n".join(itertools.chain.from_iterable(
        textwrap.wrap(line, WRAP, subsequent_indent="      ") or [""] for line in box.lines))


def stages_height(tmap: TrainingMap) -> float:
    """Inches the stage boxes need: the header, then the longest box's lines."""
    lines = max((box_body(b).count("\n") + 1 for b in tmap.boxes), default=1)
    return (HEAD + 8 + lines * LINE + 24) / 72


def draw_stages(ax, tmap: TrainingMap) -> list[tuple[object, list]]:
    """The five boxes and their arrows on a 0-100 canvas; returns (box patch, its texts).
    Headers sit a fixed number of points below a box's top, whatever the figure's size."""
    from matplotlib.patches import FancyBboxPatch
    from matplotlib.transforms import offset_copy

    ax.set(xlim=(-0.3, 100.3), ylim=(0, 100))
    ax.axis("off")
    n, gap = len(tmap.boxes), 3.2
    width = (100 - gap * (n - 1)) / n

    def below(points: float):  # the data transform, moved down by `points`
        return offset_copy(ax.transData, fig=ax.figure, y=-points, units="points")
    drawn = []
    for i, box in enumerate(tmap.boxes):
        x = i * (width + gap)
        patch = FancyBboxPatch((x, 1), width, 98, boxstyle="round,pad=0,rounding_size=1.2",
                               facecolor=COLOURS.get(box.stage, "#f5f5f5"), edgecolor="#555",
                               lw=1.3)
        ax.add_patch(patch)
        texts = [ax.text(x + width / 2, 99, box.title, ha="center", va="top", fontsize=13,
                         fontweight="bold", transform=below(7)),
                 ax.text(x + width / 2, 99, f"wall {duration(box.wall_s)}\n"
                         f"{fmt_accel_h(box.accel_h)} accelerator-hours", ha="center",
                         va="top", fontsize=10, color="#333", linespacing=1.4,
                         transform=below(26))]
        ax.plot([x + 1, x + width - 1], [99, 99], color="#999", lw=0.8, transform=below(HEAD))
        texts.append(ax.text(x + 1.2, 99, box_body(box), ha="left", va="top", fontsize=10,
                             linespacing=1.45, transform=below(HEAD + 8)))
        drawn.append((patch, texts))
        if i < n - 1:
            ax.annotate("", xy=(x + width + gap, 50), xytext=(x + width, 50),
                        arrowprops={"arrowstyle": "-|>", "lw": 2, "color": "#444"})
    return drawn


def fit_text(fig, patch, texts: list, smallest: float = 6.0) -> bool:
    """Shrink each of `texts` (0.5 pt a step) until it lies inside `patch`; whether all fit."""
    renderer = fig.canvas.get_renderer()
    outer = patch.get_window_extent(renderer)
    fits = True
    for text in texts:
        while not inside(text.get_window_extent(renderer), outer, 4):
            if text.get_fontsize() <= smallest:
                fits = False
                break
            text.set_fontsize(text.get_fontsize() - 0.5)
    return fits


def inside(inner, outer, margin: float) -> bool:
    return (inner.x0 >= outer.x0 + margin and inner.x1 <= outer.x1 - margin
            and inner.y0 >= outer.y0 + margin and inner.y1 <= outer.y1 - margin)


def draw_trial_curves(ax, trials: list[Trial]) -> None:
    ax.set(title="Sweep trials: training loss", xlabel="step", ylabel="loss (nats/token)")
    ax.grid(alpha=0.3)
    drawn = [t for t in trials if t.curve]
    for t in drawn:
        ax.plot([s for s, _ in t.curve], [v for _, v in t.curve], marker="o", ms=3,
                lw=2.6 if t.best else 1.2, label=f"{'★ ' if t.best else ''}#{t.index} "
                                                 f"{params_text(t.params)}")
    if drawn:
        ax.legend(fontsize=8, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no trial curves recorded", transform=ax.transAxes, ha="center",
                va="center", color="#7f7f7f")


def draw_trial_scatter(ax, trials: list[Trial]) -> None:
    scored = [t for t in trials if t.val_loss is not None and t.params]
    name = sorted(scored[0].params)[0] if scored else "parameter"
    ax.set(title=f"Sweep: held-out loss of each trial vs {name}", xlabel=name,
           ylabel="held-out loss")
    ax.grid(alpha=0.3)
    if not scored:
        ax.text(0.5, 0.5, "no scored trials", transform=ax.transAxes, ha="center",
                va="center", color="#7f7f7f")
        return
    xs = [float(t.params[name]) for t in scored]
    if min(xs) > 0 and max(xs) / min(xs) > 3:
        ax.set_xscale("log")
    for t, x in zip(scored, xs):
        ax.plot([x], [t.val_loss], marker="*" if t.best else "o", ms=16 if t.best else 8,
                color="#bcbd22" if t.best else "#1f77b4", mec="#333", ls="none")
        ax.annotate(f"#{t.index}{' best' if t.best else ''}", (x, t.val_loss),
                    textcoords="offset points", xytext=(8, 6), fontsize=9)
    ax.margins(x=0.15, y=0.25)


def draw_cost(ax, tmap: TrainingMap) -> None:
    rows = tmap.cost[::-1]  # the first row on top
    ax.barh([r.row for r in rows], [r.accel_h for r in rows],
            color=[BAR_COLOURS[len(tmap.cost) - 1 - i] if len(tmap.cost) - 1 - i < len(
                BAR_COLOURS) else "#7f7f7f" for i in range(len(rows))])
    top = max((r.accel_h for r in rows), default=0.0) or 1.0
    for y, r in enumerate(rows):
        label = f"{fmt_accel_h(r.accel_h)} h · {fmt_num(r.percent, '.1f')} %"
        if tmap.price:
            label += f" · cost {r.cost:,.2f}"
        ax.text(max(r.accel_h, 0) + top * 0.02, y, label, va="center", fontsize=8.5)
    ax.set_xlim(min(0.0, min(r.accel_h for r in rows)), top * 1.75)
    priced = f", at {tmap.price:g} per accelerator-hour" if tmap.price else ", unpriced"
    ax.set(title=f"Cost: accelerator-hours by cause{priced}",
           xlabel=f"accelerator-hours (total {fmt_accel_h(tmap.accel_h)})")
    ax.tick_params(axis="y", labelsize=9)
    ax.grid(alpha=0.3, axis="x")


def labels(fig) -> list:
    """Every text the figure draws: titles, axis labels, tick labels in view, annotations,
    box texts, legend entries."""
    figures = [fig, *getattr(fig, "subfigs", [])]
    out = [t for f in figures for t in f.texts]
    for ax in (ax for f in figures for ax in f.axes):
        out += [*ax.texts, ax.title, ax.xaxis.label, ax.yaxis.label]
        if ax.axison:
            for axis, at in ((ax.xaxis, 0), (ax.yaxis, 1)):
                lo, hi = sorted(axis.get_view_interval())
                out += [t for t in axis.get_ticklabels() if lo <= t.get_position()[at] <= hi]
        if ax.get_legend() is not None:
            out += ax.get_legend().get_texts()
    unique = {id(t): t for t in out}
    return [t for t in unique.values() if t.get_visible() and t.get_text().strip()]


def overlapping_texts(fig) -> list[str]:
    """Pairs of the figure's labels whose drawn extents intersect (none: legible)."""
    renderer = fig.canvas.get_renderer()
    extents = [(t.get_text(), t.get_window_extent(renderer)) for t in labels(fig)]
    return [f"{a!r} overlaps {b!r}" for (a, ra), (b, rb) in itertools.combinations(extents, 2)
            if ra.overlaps(rb)]


# ---- the HTML section ------------------------------------------------------------------
def map_html(tmap: TrainingMap, png_b64: str, run_id: str) -> str:
    """The map PNG inline, the boxes as text, the trials and the cost table (all escaped)."""
    boxes = []
    for box in tmap.boxes:
        items = "".join(f"<li>{html.escape(line.strip())}</li>" for line in box.lines)
        boxes.append(f'<div class="stage" id="stage-{html.escape(box.stage)}">'
                     f"<h3>{html.escape(box.title)}</h3><p class=\"cost\">"
                     f"{html.escape(box_cost(box))}</p><ul>{items}</ul></div>")
    trials = [{"index": f"#{t.index}", "params": params_text(t.params), "val_loss": t.val_loss,
               "round": t.round, "source": t.source, "best": "★ best" if t.best else "",
               "run_id": t.run_id} for t in tmap.trials]
    price = tmap.price or None
    rows = [{"row": r.row, "causes": " + ".join(r.causes) or "–", "seconds": round(r.seconds, 3),
             "percent": None if r.percent is None else round(r.percent, 2),
             "accel_h": r.accel_h, "cost": r.cost if price else None} for r in tmap.cost]
    rows.append({"row": "total (wall time × accelerators)", "causes": "",
                 "seconds": round(tmap.wall_s, 3), "percent": 100.0 if tmap.wall_s else None,
                 "accel_h": tmap.accel_h, "cost": tmap.accel_h * tmap.price if price else None})
    return (f'<img alt="training map of {html.escape(run_id)}" '
            f'src="data:image/png;base64,{png_b64}">'
            f'<div class="map">{"<div class=arrow>→</div>".join(boxes)}</div>'
            f"<p>{html.escape(headline(tmap))}. Accelerators: {tmap.accelerators} "
            f"({html.escape(tmap.accelerators_from)}); price per accelerator-hour: "
            f"{cell(price) if price else 'unpriced (ops.accelerator_hour_price 0)'}.</p>"
            "<h3>Sweep trials</h3>"
            + table(trials, [("index", "trial"), ("params", "parameters"),
                             ("val_loss", "held-out loss"), ("round", "round"),
                             ("source", "suggested by"), ("best", ""), ("run_id", "run id")])
            + "<h3>Cost</h3>"
            + table(rows, [("row", "accelerator time"), ("causes", "goodput parts"),
                           ("seconds", "wall seconds"), ("percent", "% of wall"),
                           ("accel_h", "accelerator-hours"), ("cost", "cost")]))
