"""The training map of `mainspring report`: the chain from data to a converged model.

Five stage boxes (activities/contracts.STAGES), and a sixth for the optional distill stage
when the run had one (the student's and its baseline's held-out loss beside the teacher's,
and what they took), each with what it did and its wall time and
accelerator-hours: data prep from the dataset manifest's stats (documents read, removed by
each filter, exact and near duplicates, tokens, shards), the sweep from its `sweep_trial`
events, training from the event log (segments, faults, rollbacks, skipped data),
evaluation and promotion from their stage events. A stage's wall time is its
stage_started -> stage_finished window (ops/goodput.stage_windows); its accelerator-hours
are that × the run's accelerators: the world size of the spec its claim stored
(`runs/<run>/RUN.json`: train.nodes × train.procs_per_node; storage/runs.py).

The cost rows regroup ops/goodput.from_record's productive time and badput causes - the
same seconds, none measured again - into what a budget asks about, priced at
`ops.accelerator_hour_price`. They add up to the run's wall time × accelerators exactly:
`other / idle` is what no cause explains (from_record's `other`, and any cause without a
row of its own).

Pure, apart from one read of the store (`dataset_stats`; the run's spec comes from
storage/runs.py `stored_spec`); ops/report.py gathers the records, ops/report_map_render.py draws what this returns (and defines it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import structlog

from activities.contracts import STAGES
from common.errors import BadConfig, BadData, StorageUnavailable
from ops.goodput import holds, stage_windows
from ops.report_map_render import (
    CostRow,
    StageBox,
    TrainingMap,
    Trial,
    duration,
    fmt_bytes,
    fmt_num,
    params_text,
)

log = structlog.get_logger(__name__)

TITLES = {"prepare_data": "1 · Data preparation", "warmup_sweep": "2 · Warm-up sweep",
          "train": "3 · Training", "evaluate": "4 · Evaluation", "promote": "5 · Promotion",
          "distill": "6 · Distillation"}
DISTILL = "distill"  # the optional stage after promotion (workflows/distill.py): a sixth box
DISTILL_ROW = "distillation (student runs)"
# (row, the from_record parts it adds up). "other / idle" is the remainder (module doc).
COST_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("productive training", ("productive",)),
    ("lost to faults and spikes", ("replayed", "skipped", "detection", "rollback")),
    ("warm-up sweep", ("sweep",)),
    ("evaluation", ("evaluation",)),
    ("checkpoint stalls", ("checkpoint_stall",)),
    ("trainer start-up and restore", ("startup", "restore")),
    ("data preparation", ("data",)),
    ("paused for an operator", ("paused",)),
)
OTHER = "other / idle"
PRICE_FIX = ("set ops.accelerator_hour_price (or --price) to what one accelerator costs per "
             "hour, e.g. 2.5, or 0 to leave the costs unpriced")


# ---- the read of the store (the spec: storage/runs.py stored_spec) ----------------------
def dataset_stats(durable_url: str, events: list[dict]) -> tuple[dict, str]:
    """(the dataset manifest's stats, where they came from). The manifest is read from this
    store only, by content hash: the `dataset_ready` event's, else the directory name of the
    URI the run recorded; a URI in an event is never opened itself (store data is data,
    not an address). Without a readable manifest, the `dataset_ready` event's counts."""
    from ops.store_fields import dataset_key
    from storage.dataset import load_manifest, manifest_url

    ready = [e["payload"] for e in events if e["kind"] == "dataset_ready"]
    done = [e["payload"] for e in events if e["kind"] == "stage_finished"
            and e["payload"].get("stage") == "prepare_data"]
    key = dataset_key(ready[-1] if ready else {}, done[-1].get("dataset") if done else None)
    if key:
        url = manifest_url(durable_url, key)
        try:
            return dict(load_manifest(url).stats), url
        except (BadData, StorageUnavailable, OSError, ValueError) as exc:
            log.info("report_manifest_not_at", url=url, error=repr(exc)[:200])
    if ready:
        p = ready[-1]
        return ({**{k: p[k] for k in ("docs_in", "docs_out", "exact_dups", "near_dups")
                    if k in p},
                 "tokens_train": p.get("train_tokens"), "tokens_val": p.get("val_tokens")},
                "the dataset_ready event (manifest not found)")
    return {}, "nothing recorded"


# ---- accelerators and price -------------------------------------------------------------
def accelerators(spec: dict | None, spans: list[dict]) -> tuple[int, str]:
    """(the run's accelerator count, where it came from): the spec's world size, else the
    trainer ranks its spans name, else 1."""
    train = (spec or {}).get("train") or {}
    if train:
        n = int(train.get("nodes", 1)) * int(train.get("procs_per_node", 1))
        return n, "world size: train.nodes × train.procs_per_node of the run's spec"
    ranks = {str(s["attributes"]["rank"]) for s in spans
             if s.get("attributes", {}).get("rank") is not None}
    if ranks:
        return len(ranks), "trainer ranks seen in the run's spans (no stored spec)"
    return 1, "unknown (no stored spec, no trainer spans): 1 assumed"


def hour_price(spec: dict | None, override: float | None = None) -> float:
    """The price of one accelerator-hour: `override` (--price), else the spec's
    ops.accelerator_hour_price, else 0 (unpriced). BadConfig for a negative, non-finite or
    non-numeric price, naming where it came from."""
    from spec.ops import OpsConfig

    field = "--price" if override is not None else "ops.accelerator_hour_price"
    value = override if override is not None else (
        ((spec or {}).get("ops") or {}).get("accelerator_hour_price", 0.0))
    try:  # the spec's own rule (spec/ops.py), for the stored spec and the flag alike
        return float(OpsConfig(accelerator_hour_price=value).accelerator_hour_price)
    except BadConfig as exc:
        raise BadConfig(field, exc.problem, PRICE_FIX) from None


# ---- cost ----------------------------------------------------------------------------
def cost_rows(rec: dict, accelerators: int, price: float,
              distill_s: float | None = None) -> list[CostRow]:
    """from_record's seconds regrouped (COST_GROUPS), then `other / idle` = wall - the rest,
    so the rows add up to wall × accelerators (negative only if causes overlapped).
    `distill_s`: the distill stage's window, where the run waits on its student runs (their
    own records hold how that time went), a row of its own rather than idle."""
    parts = {"productive": rec["productive_s"], **rec["badput_s"]}
    wall = rec["wall_s"]
    rows = [(name, causes, sum(parts.get(c, 0.0) for c in causes)) for name, causes in COST_GROUPS]
    if distill_s is not None:
        rows.append((DISTILL_ROW, (), distill_s))
    grouped = {c for _, causes, _ in rows for c in causes}
    rest = tuple(c for c in parts if c not in grouped)
    rows.append((OTHER, rest, wall - sum(s for _, _, s in rows)))
    return [CostRow(row=name, causes=causes, seconds=s, accel_h=s * accelerators / 3600,
                    cost=s * accelerators / 3600 * price,
                    percent=100 * s / wall if wall > 0 else None) for name, causes, s in rows]


def priced(time_rows: list[dict], accelerators: int, price: float) -> list[dict]:
    """The goodput table's rows (ops/report.goodput_section) with accelerator-hours and cost."""
    return [{**r, "accel_h": r["seconds"] * accelerators / 3600,
             "cost": r["seconds"] * accelerators / 3600 * price} for r in time_rows]


# ---- the stage boxes ------------------------------------------------------------------
def of_kind(events: Iterable[dict], *kinds: str) -> list[dict]:
    return [e for e in events if e["kind"] in kinds]


def stage_payload(events: list[dict], stage: str) -> dict:
    done = [e["payload"] for e in of_kind(events, "stage_finished")
            if e["payload"].get("stage") == stage]
    return done[-1] if done else {}


def data_box(stats: dict, source: str, events: list[dict]) -> tuple[list[str], dict]:
    removed = {k.removeprefix("dropped_"): int(v) for k, v in sorted(stats.items())
               if k.startswith("dropped_") and isinstance(v, (int, float))}
    fig = {"files": stats.get("files"), "bytes_in": stats.get("bytes_in"),
           "docs_in": stats.get("docs_in"), "removed_by_filter": removed,
           "removed_total": sum(removed.values()) if removed else None,
           "exact_dups": stats.get("exact_dups"),
           "near_dups": stats.get("near_dups"), "docs_out": stats.get("docs_out"),
           "docs_train": stats.get("docs_train"), "docs_val": stats.get("docs_val"),
           "tokens_train": stats.get("tokens_train"), "tokens_val": stats.get("tokens_val"),
           "shards_train": stats.get("shards_train"), "shards_val": stats.get("shards_val"),
           "cache_hit": bool(stage_payload(events, "prepare_data").get("cache_hit")),
           "source": source}
    lines = [f"files: {fmt_num(fig['files'])} ({fmt_bytes(fig['bytes_in'])})",
             f"documents read: {fmt_num(fig['docs_in'])}",
             f"removed by filters: {fmt_num(fig['removed_total'])}"]
    lines += [f"   {name}: {n:,}" for name, n in removed.items() if n]
    lines += [f"exact duplicates: {fmt_num(fig['exact_dups'])}",
              f"near duplicates: {fmt_num(fig['near_dups'])}",
              f"documents kept: {fmt_num(fig['docs_out'])}",
              f"   split: {fmt_num(fig['docs_train'])} train / {fmt_num(fig['docs_val'])} val",
              f"tokens: {fmt_num(fig['tokens_train'])} train / {fmt_num(fig['tokens_val'])} val",
              f"shards: {fmt_num(fig['shards_train'])} train / {fmt_num(fig['shards_val'])} val"]
    if fig["cache_hit"]:
        lines.append("cache hit: counts from when it was built")
    return lines, fig


def sweep_box(events: list[dict], trials: list[Trial]) -> tuple[list[str], dict]:
    p = stage_payload(events, "warmup_sweep")
    best = next((t for t in trials if t.best), None)
    fig = {"enabled": p.get("enabled", bool(trials)), "trials": len(trials),
           "rounds": len({t.round for t in trials}), "best_params": p.get("best_params"),
           "best_val_loss": best.val_loss if best else None,
           "best_trial": best.index if best else None}
    if not trials:
        return ["no trials (sweep.enabled is false)" if not fig["enabled"]
                else "no sweep_trial events"], fig
    lines = [f"{len(trials)} trials in {fig['rounds']} rounds", "held-out loss of each:"]
    lines += [f"{'★' if t.best else '   '} #{t.index} {params_text(t.params)}: "
              f"{fmt_num(t.val_loss, '.4f')}" for t in trials]
    lines.append(f"best: {params_text(fig['best_params'] or {})}")
    return lines, fig


def stage_of(ts: float, windows: dict[str, tuple[float, float]]) -> str:
    """The stage running at `ts`: the latest started whose window holds it, else train (a
    log without stage events is a log of training)."""
    inside = [(a, stage) for stage, (a, b) in windows.items() if a <= ts <= b]
    return max(inside)[1] if inside else "train"


def fault_lines(faults: list[dict]) -> list[str]:
    return [f"   {e['payload'].get('kind')}"
            + (f" @ step {e['step']}" if e["step"] is not None else "") for e in faults]


def layout_of(spec: dict | None) -> dict | None:
    """Pure: how the run's spec laid the model across its ranks, and why, for the training
    box: {tp, pp, dp, zero, ranks, why}, with the planner's reasons where "auto" chose it
    (spec/layout.py planned_layout); None without a stored spec."""
    train = (spec or {}).get("train")
    if not train:
        return None
    ranks = int(train.get("nodes", 1)) * int(train.get("procs_per_node", 1))
    zero, layout = int(train.get("zero_stage", 0)), train.get("layout", "dp")
    tp, pp = (int(layout.get("tp", 1)), int(layout.get("pp", 1))) \
        if isinstance(layout, dict) else (1, 1)
    dp = ranks // (tp * pp)
    why = ["TP shards inside a node"] if tp > 1 else []
    why += ["PP stages, 1F1B"] if pp > 1 else []
    why += [f"{dp} replica{'s' if dp != 1 else ''}, ZeRO {zero}"]
    planned = list(layout.get("why") or []) if isinstance(layout, dict) else []
    source = ' (train.layout "dp")' if layout == "dp" else \
        ' (train.layout "auto": ' + "; ".join(planned) + ")" if planned else " (train.layout)"
    return {"tp": tp, "pp": pp, "dp": dp, "zero": zero, "ranks": ranks,
            "why": " · ".join(why) + source}


def train_box(events: list[dict], rec: dict, faults: list[dict],
              layout: dict | None = None) -> tuple[list[str], dict]:
    p = stage_payload(events, "train")
    starts = of_kind(events, "segment_started")
    injected = [e for e in faults if e["payload"].get("injected")]
    rollbacks = of_kind(events, "rollback")
    windows = [tuple(r["payload"]["skip"]) for r in rollbacks if r["payload"].get("skip")]
    real = rec["faults"]
    mttrs = [row["mttr_s_max"] for row in real.values() if row["mttr_s_max"] is not None]
    fig = {"final_step": p.get("final_step", max((e["step"] or 0 for e in events), default=0)),
           "segments": p.get("segments", len({(e["payload"].get("from_step"),
                                               e["payload"].get("to_step")) for e in starts})),
           "launches": len(starts), "faults": len(faults), "faults_injected": len(injected),
           "faults_detected": len(faults) - len(injected),
           "recoveries": len(of_kind(events, "recovered")), "rollbacks": len(rollbacks),
           "rollback_lost_steps": sum(r["payload"].get("lost_steps") or 0 for r in rollbacks),
           "loss_spikes": len(of_kind(events, "loss_spike")),
           "batches_skipped": len(of_kind(events, "batch_skipped")),
           "skip_windows": [list(w) for w in windows],
           "skipped_data_batches": sum(b - a for a, b in windows),
           "lr_adjusted": len(of_kind(events, "lr_adjusted")),
           "holds": sum(map(holds, of_kind(events, "paused", "needs_attention"))),
           "checkpoints": len(of_kind(events, "checkpoint_committed")),
           "steps_replayed": rec["steps"]["replayed"], "goodput": rec["train"]["goodput"]}
    lines = [f"steps 0 → {fig['final_step']}"]
    if layout:
        fig["layout"] = layout
        lines += [f"layout: TP {layout['tp']} × PP {layout['pp']} × DP {layout['dp']} on "
                  f"{layout['ranks']} ranks", f"   {layout['why']}"]
    lines += [f"segments: {fig['segments']} ({fig['launches']} launches)",
             f"faults: {fig['faults']} ({fig['faults_injected']} injected, "
             f"{fig['faults_detected']} detected)"]
    lines += fault_lines(faults)
    lines += [f"recovered: {fig['recoveries']}"
              + (f" (MTTR ≤ {duration(max(mttrs))})" if mttrs else ""),
              f"rollbacks: {fig['rollbacks']} ({fig['rollback_lost_steps']} steps lost)",
              f"loss spikes: {fig['loss_spikes']}, batches skipped: {fig['batches_skipped']}"]
    lines += [f"data skipped: batches {a}–{b} ({b - a})" for a, b in windows]
    if fig["lr_adjusted"] or fig["holds"]:
        lines.append(f"LR lowered: {fig['lr_adjusted']}, holds: {fig['holds']}")
    lines += [f"checkpoints: {fig['checkpoints']}, steps replayed: {fig['steps_replayed']}",
              f"goodput of the stage: {fmt_num(fig['goodput'], '.1%')}"]
    return lines, fig


def eval_box(events: list[dict]) -> tuple[list[str], dict]:
    vals = {int(k): v for k, v in (stage_payload(events, "evaluate").get("val_loss") or {}).items()
            if isinstance(v, (int, float))}
    steps = sorted(vals)
    fig = {"val_loss": vals, "online_evals": len(of_kind(events, "eval"))}
    lines = [f"held-out loss at step {s}: {vals[s]:.4f}" for s in steps]
    if len(steps) >= 2:
        lines.append(f"change: {vals[steps[-1]] - vals[steps[0]]:+.4f} nats/token")
    lines.append(f"evaluations during training: {fig['online_evals']}")
    return lines, fig


def promote_box(events: list[dict]) -> tuple[list[str], dict]:
    promoted = of_kind(events, "promoted")
    p = promoted[-1]["payload"] if promoted else {}
    fig = {"step": promoted[-1]["step"] if promoted else None, "bytes": p.get("bytes"),
           "uri": p.get("uri")}
    if not promoted:
        return ["nothing promoted (yet)"], fig
    return [f"checkpoint of step {fig['step']}", f"{fmt_bytes(fig['bytes'])} copied, verified",
            f"→ …/{str(fig['uri']).rstrip('/').rsplit('/', 2)[-2]}/"
            f"{str(fig['uri']).rstrip('/').rsplit('/', 1)[-1]}"], fig


def distill_box(events: list[dict]) -> tuple[list[str], dict]:
    """The distill stage's record (workflows/distill.py): the held-out loss of the student,
    of the same student trained without a teacher, and of the teacher, and what each
    student's training took. The teacher's forward cost per step is in the student run's
    own record (its `teacher_cost` events; its report's training box)."""
    p = stage_payload(events, DISTILL)
    keys = ("student_run", "baseline_run", "teacher_step", "steps", "alpha", "temperature",
            "teacher_val_loss", "student_val_loss", "baseline_val_loss", "student_wall_s",
            "baseline_wall_s", "student_promoted", "student_status", "baseline_status",
            "student_error", "baseline_error")
    fig = {k: p.get(k) for k in keys}
    if not p:
        return ["not finished"], fig
    student, base = fig["student_val_loss"], fig["baseline_val_loss"]
    fig["gain"] = base - student if isinstance(base, (int, float)) and isinstance(
        student, (int, float)) else None
    lines = [f"student: {fig['student_run']}",
             f"{fmt_num(fig['steps'])} steps from step {fmt_num(fig['teacher_step'])}, "
             f"α {fig['alpha']}, T {fig['temperature']}",
             f"held-out loss, teacher: {fmt_num(fig['teacher_val_loss'], '.4f')}",
             f"   student: {child_outcome(fig, 'student', student)}"]
    if fig["baseline_run"]:
        lines += [f"   without teacher: {child_outcome(fig, 'baseline', base)}",
                  f"   teacher's gain: {fmt_num(fig['gain'], '+.4f')} nats/token"]
    lines.append("promoted in its own run, beside the teacher" if fig["student_status"] != "failed"
                 else "the student failed: nothing promoted for it; the teacher's run stands")
    return lines, fig


def child_outcome(fig: dict, prefix: str, loss: object) -> str:
    """A child run's held-out loss and wall time, or that it failed and why (its error is
    the child's own failure message, bounded by the workflow and escaped on output)."""
    if fig.get(f"{prefix}_status") == "failed":
        return f"failed ({str(fig.get(f'{prefix}_error') or 'no reason recorded')[:200]})"
    return f"{fmt_num(loss, '.4f')} ({duration(fig[f'{prefix}_wall_s'])})"


def teacher_lines(events: list[dict]) -> tuple[list[str], dict | None]:
    """A student run's teacher and what its forward cost (`teacher_cost`, per segment)."""
    costs = of_kind(events, "teacher_cost")
    if not costs:
        return [], None
    steps = sum(e["payload"].get("steps") or 0 for e in costs)
    seconds = sum((e["payload"].get("forward_s_per_step") or 0) * (e["payload"].get("steps")
                                                                    or 0) for e in costs)
    last = costs[-1]["payload"]
    fig = {"teacher": last.get("teacher"), "forward_s_per_step": seconds / steps if steps
           else None, "weight_bytes": last.get("weight_bytes"),
           "logits_bytes": max(e["payload"].get("logits_bytes") or 0 for e in costs) or None}
    return [f"teacher: {fig['teacher']}",
            f"   its forward: {fmt_num(fig['forward_s_per_step'], '.4f')} s/step",
            f"   its memory: weights {fmt_bytes(fig['weight_bytes'])}, logits "
            f"{fmt_bytes(fig['logits_bytes'])}"], fig


def trials_of(events: list[dict], curves: dict[str, list[tuple[int, float]]]) -> list[Trial]:
    """Each sweep trial (its `sweep_trial` event), the lowest finite held-out loss of a
    trial not pruned best."""
    rows = []
    for e in of_kind(events, "sweep_trial"):
        p = e["payload"]
        rid = str(p.get("trial_run_id", ""))
        tail = rid.rsplit("-trial-", 1)[-1] if "-trial-" in rid else ""
        index = int(tail) if tail.isascii() and tail.isdigit() and len(tail) <= 6 else len(rows)
        loss = p.get("result")
        finite = isinstance(loss, (int, float)) and math.isfinite(loss)  # NaN: it diverged
        # a pruned trial's result is its loss where it stopped, not a final one: never best
        finite = finite and p.get("status") != "pruned"
        rows.append((index, rid, p.get("params") or {}, loss if finite else None,
                     int(p.get("round", 0)), str(p.get("source", ""))))
    scored = [r for r in rows if r[3] is not None]
    best = min(scored, key=lambda r: r[3])[0] if scored else None
    return [Trial(index=i, run_id=rid, params=params, val_loss=loss, round=rnd, source=src,
                  best=i == best, curve=curves.get(rid, []))
            for i, rid, params, loss, rnd, src in sorted(rows)]


def training_map(events: list[dict], rec: dict, *, stats: dict, stats_source: str,
                 trials: list[Trial], accelerators: int, accelerators_from: str,
                 price: float, layout: dict | None = None) -> TrainingMap:
    """The boxes, trials and cost of a run from its records (ops/report.build_report)."""
    windows = stage_windows(events, rec["end_ts"])
    faults = {stage: [e for e in of_kind(events, "fault")
                      if stage_of(e["ts"], windows) == stage] for stage in STAGES}
    made = {"prepare_data": data_box(stats, stats_source, events),
            "warmup_sweep": sweep_box(events, trials),
            "train": train_box(events, rec, faults["train"], layout),
            "evaluate": eval_box(events), "promote": promote_box(events)}
    lines, teacher = teacher_lines(events)  # a student run: its teacher's cost
    if teacher:
        made["train"] = ([*made["train"][0], *lines], {**made["train"][1], "teacher": teacher})
    stages = list(STAGES)
    if DISTILL in windows:  # the optional stage ran (or runs): its box after promotion
        stages.append(DISTILL)
        made[DISTILL] = distill_box(events)
        faults[DISTILL] = []  # its faults are in the student runs' own records
    boxes = []
    for stage in stages:
        a, b = windows.get(stage, (None, None))
        wall = b - a if a is not None else None
        lines, fig = made[stage]
        if stage != "train" and faults[stage]:  # the train box lists its own
            fig["faults"] = len(faults[stage])
            lines = [*lines, f"faults: {len(faults[stage])}", *fault_lines(faults[stage])]
        boxes.append(StageBox(stage=stage, title=TITLES[stage], wall_s=wall,
                              accel_h=wall * accelerators / 3600 if wall is not None else None,
                              lines=tuple(lines), figures=fig))
    distill_s = boxes[-1].wall_s if stages[-1] == DISTILL else None
    return TrainingMap(boxes=boxes, trials=trials,
                       cost=cost_rows(rec, accelerators, price, distill_s),
                       accelerators=accelerators, accelerators_from=accelerators_from,
                       price=price, wall_s=rec["wall_s"],
                       accel_h=rec["wall_s"] * accelerators / 3600)

