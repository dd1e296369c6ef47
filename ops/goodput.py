"""Goodput accounting: where a run's training time went, from what the run left behind.

Two measurements. `from_record` (at the end) reads only the durable record, the event log
and the trainer's spans, so `mainspring report` can tell it for any run; the functions
before it are the soak's external one (benchmarks/goodput.py), whose inputs are these.

Inputs: every segment attempt's progress lines (`step`: step, ts = when it ended,
step_time_s, verdict; `start`: resumed_from, ts), the event log, and the wall-clock times
at which faults were injected. Pure functions; benchmarks/goodput.py feeds them.

- final trajectory: the last execution of each step number. A retry replays the steps after
  the checkpoint it resumed from, a rollback those after its restore point; either way the
  replay runs later, so the last execution is the one whose update the model kept.
- productive time: step_time_s of final-trajectory steps whose update was applied (verdict
  `ok`). Skipped (vetoed) steps and every replaced execution are wasted step time.
- goodput: productive time ÷ the train stage's wall time (stage_started -> stage_finished).
- per fault: `recovery_s` = fault -> end of the first step that ran after it; `lost_steps`
  = the last step finished before the fault - the step training resumed from (0 when no
  trainer restarted: training went on through the fault).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable

HUMAN_KINDS = ("operator", "needs_attention", "run_resumed")


def final_trajectory(steps: Iterable[dict]) -> dict[int, dict]:
    """{step: the step line of its last execution}, from step lines in any order."""
    kept: dict[int, dict] = {}
    for line in sorted(steps, key=lambda s: s["ts"]):
        kept[line["step"]] = line
    return kept


def time_budget(steps: list[dict], wall_s: float, pauses_s: float = 0.0) -> dict:
    """Wall time of the train stage split into productive, replayed and skipped step time,
    checkpoint pauses and the rest (start-ups, detection, restarts, waits)."""
    kept = final_trajectory(steps)
    kept_ids = {id(line) for line in kept.values()}
    productive = sum(s["step_time_s"] for s in kept.values() if s.get("verdict", "ok") == "ok")
    skipped = sum(s["step_time_s"] for s in kept.values() if s.get("verdict", "ok") != "ok")
    replayed = sum(s["step_time_s"] for s in steps if id(s) not in kept_ids)
    return {"wall_s": wall_s, "productive_s": productive, "replayed_s": replayed,
            "skipped_s": skipped, "checkpoint_pause_s": pauses_s,
            "other_s": wall_s - productive - replayed - skipped - pauses_s,
            "goodput": productive / wall_s if wall_s > 0 else None,
            "steps_executed": len(steps), "steps_kept": len(kept),
            "steps_replayed": len(steps) - len(kept)}


def fault_outcome(fault_ts: float, lines: list[dict], until_ts: float = float("inf")) -> dict:
    """Recovery of one fault injected at `fault_ts`, from the time-ordered progress lines.

    A restart is a `start` line after the fault and before `until_ts` (the next fault) that
    is a retried attempt (attempt > 1) or that went back: resumed from before the last step
    already finished (a fault at a segment's end that spoils its checkpoint makes the next
    segment's first attempt fall back to an earlier one). A new segment that picks up where
    training was is not one. With a restart, recovery ends at the first step after it: a
    dying rank can still finish the step it was in after the fault. Without one, training
    went on: recovery ends at the next step and nothing is lost.
    """
    starts = [s for s in lines if s["type"] == "start" and fault_ts < s["ts"] <= until_ts
              and (s.get("attempt", 1) > 1 or went_back(s, lines))]
    resume_ts = starts[0]["ts"] if starts else fault_ts
    after = [s for s in lines if s["type"] == "step" and s["ts"] > resume_ts]
    if not after:
        return {"recovered": False}
    first = after[0]
    attempts = [s for s in starts if s["ts"] <= first["ts"]]
    before = [s for s in lines if s["type"] == "step" and s["ts"] <= resume_ts]
    last = before[-1]["step"] if before else 0  # where the interrupted attempt had got to
    resumed = attempts[-1]["resumed_from"] if attempts else None
    return {"recovered": True, "restarted": bool(attempts), "attempts": len(attempts),
            "recovery_s": first["ts"] - fault_ts, "first_step_ts": first["ts"],
            "last_step_before": last, "resumed_from": resumed, "first_step_after": first["step"],
            "lost_steps": max(0, last - (resumed or 0)) if attempts else 0}


def went_back(start: dict, lines: list[dict]) -> bool:
    """Whether a `start` line resumed from before the last step finished ahead of it."""
    done = [s["step"] for s in lines if s["type"] == "step" and s["ts"] <= start["ts"]]
    return bool(done) and (start.get("resumed_from") or 0) < max(done)


def downtime(fault_ts: float, recovery_s: float, lines: list[dict]) -> float:
    """Seconds of a fault's recovery window in which no step ran: the window minus the step
    time of steps that ended in it (counted as productive or replayed already: a dying rank's
    last steps, the first step after the restart)."""
    end = fault_ts + recovery_s
    busy = sum(s["step_time_s"] for s in lines if s["type"] == "step" and fault_ts < s["ts"] <= end)
    return max(0.0, recovery_s - busy)


def longest_gap(lines: list[dict], t0: float, t1: float) -> float:
    """Longest time without a finished step inside [t0, t1] (a stall that did not restart)."""
    ends = [t0] + [s["ts"] for s in lines if s["type"] == "step" and t0 < s["ts"] < t1] + [t1]
    return max(b - a for a, b in itertools.pairwise(ends))


def spike_outcomes(events: list[dict], window_steps: int = 50) -> list[dict]:
    """Each injected spike fault (corrupt_batches, lr_burst, nan_loss) and the detector's
    decisions on it: skips and rollbacks at most `window_steps` steps after the step it
    fired at (the detector's window). `handled` is the strongest decision (rollback > skip);
    `wasted_steps` counts skipped steps plus steps a rollback threw away."""
    out = []
    for fault in (e for e in events if e["kind"] == "fault"
                  and e["payload"].get("kind") in ("corrupt_batches", "lr_burst", "nan_loss")):
        step = fault["step"]
        decisions = [e for e in events if e["kind"] in ("rollback", "batch_skipped")
                     and e["ts"] >= fault["ts"] and step <= e["step"] <= step + window_steps]
        kinds = {e["kind"] for e in decisions}
        out.append({"kind": fault["payload"]["kind"], "at_step": step,
                    "handled": "rollback" if "rollback" in kinds else
                               "skip" if kinds else None,
                    "skips": sum(e["kind"] == "batch_skipped" for e in decisions),
                    "wasted_steps": sum(e["payload"].get("lost_steps", 0) if e["kind"] == "rollback"
                                        else 1 for e in decisions)})
    return out


def summarize_recoveries(outcomes: list[dict], timeout_s: dict[str, float]) -> dict:
    """Per fault kind: count, median/max recovery and lost steps, and how many recovered
    within the kind's detection timeout + 10 s (DESIGN §8: worker kill <= T + 10 s)."""
    by_kind: dict[str, list[dict]] = {}
    for o in outcomes:
        by_kind.setdefault(o["kind"], []).append(o)
    summary = {}
    for kind, items in sorted(by_kind.items()):
        rec = [o["recovery_s"] for o in items if o.get("recovered")]
        lost = [o["lost_steps"] for o in items if o.get("recovered")]
        bound = timeout_s.get(kind, 0.0) + 10.0
        summary[kind] = {
            "faults": len(items), "recovered": len(rec),
            "recovery_s_median": statistics.median(rec) if rec else None,
            "recovery_s_max": max(rec) if rec else None, "bound_s": bound,
            "within_bound": sum(r <= bound for r in rec),
            "lost_steps_max": max(lost) if lost else None}
    return summary


def projected_goodput(budget: dict, outcomes: list[dict], faults: int,
                      intervals_s: Iterable[float]) -> dict:
    """Goodput at other fault rates, if every fault cost what the soak's cost on average.

    Fault cost here = downtime until the first new step (restarted faults; the longest gap
    between steps for faults that training ran through, `longest_step_gap_s`) + replayed
    and skipped step time. `fault_free` = productive ÷ (wall - that cost): the steady overhead
    (start-ups, checkpoints, scheduling). At one fault per F seconds: fault_free × (1 - c/F).
    """
    down = sum(o["recovery_s"] if o.get("restarted") else o.get("longest_step_gap_s", 0.0)
               for o in outcomes if o.get("recovered"))
    cost = down + budget["replayed_s"] + budget["skipped_s"]
    clean_wall = budget["wall_s"] - cost
    fault_free = budget["productive_s"] / clean_wall if clean_wall > 0 else None
    per_fault = cost / faults if faults else 0.0
    out = {"cost_per_fault_s": per_fault, "fault_free": fault_free}
    for interval in intervals_s:
        out[f"fault_every_{interval:g}s"] = (fault_free * max(0.0, 1 - per_fault / interval)
                                             if fault_free is not None else None)
    return out


def human_actions(events: Iterable[dict]) -> int:
    """Operator commands and pauses that waited for one (not the checkpoint scrub's
    `needs_attention`, which holds nothing: `holds`)."""
    return sum(e["kind"] in HUMAN_KINDS and (e["kind"] not in HOLD_KINDS or holds(e))
               for e in events)


def holds(event: dict) -> bool:
    """A paused / needs_attention that held the run. The checkpoint scrub's needs_attention
    (`held: false`, storage/scrub.py) asks for a look while training goes on."""
    return event["kind"] in HOLD_KINDS and event["payload"].get("held", True) is not False


# ---- goodput from the durable record alone: the event log and the trainer's spans ---------
# After Google's ml-goodput-measurement (BadputType): only the preserved steps are
# productive; restarts, restores, checkpoint saves, wasted progress and the rest are badput.
BADPUT_CAUSES = ("startup", "restore", "checkpoint_stall", "replayed", "skipped", "detection",
                 "rollback", "evaluation", "sweep", "data", "paused", "other")
SPAN_CAUSES = ("startup", "restore", "checkpoint_stall", "rollback", "evaluation")
# Stages whose whole window is one cause. Trainer spans that start inside one belong to it
# (a sweep trial's steps are the sweep's time, not the run's trajectory).
STAGE_CAUSES = {"prepare_data": "data", "warmup_sweep": "sweep", "evaluate": "evaluation"}
HOLD_KINDS = ("paused", "needs_attention")
NS = 1e9


def from_record(events: list[dict], spans: list[dict], now: float | None = None) -> dict:
    """Goodput and badput of a run from its durable record alone (storage.events.read_events,
    storage.spans.read_spans). Trainer time comes from rank 0's spans (ranks run side by
    side; a span's `rank` attribute, else its process's), except those that start inside a
    stage counted whole (below); a cause's spans are merged where they overlap (a span
    nested in another of its cause counts once). Returns:

    - wall_s, start_ts, end_ts: run_started -> run_finished, or -> `now`, or -> the newest
      event or span end while the run is live.
    - productive_s: step time of the final trajectory's applied steps. The final trajectory
      holds each step number's last execution (by its `steps a-b` window's end, then its
      place in the window): what a retry or rollback replayed replaces what came before.
    - goodput: productive_s ÷ wall_s (None for an empty record).
    - badput_s, seconds per cause: startup (trainer `startup`, `process_group_init`),
      restore (`restore` spans), checkpoint_stall (`checkpoint stage` spans), replayed (step
      time of every execution a later one replaced), skipped (step time of final steps whose
      update was vetoed), detection (sum of `recovered` detection_s), rollback (`rollback`
      spans), evaluation (`online_eval` spans and the evaluate stage), sweep (the
      warmup_sweep stage), data (the prepare_data stage), paused (paused / needs_attention
      -> run_resumed), other = wall - productive - the rest, never negative: scheduling,
      trainer restarts and waits not itemised.
    - train: {wall_s, productive_s, goodput} over the train stage's window alone
      (stage_started -> stage_finished train, or -> the end); goodput None without one.
    - faults: {kind: {count, recovered, mttr_s_median, mttr_s_max, lost_steps}} for real
      faults (payload.injected false or absent), each paired with its `recovered` event.
    - injected_faults: fault events with payload.injected true (chaos, never real faults).
    - steps: executed (every step execution), kept (final-trajectory steps, skipped ones
      included), replayed (executed - kept).
    """
    start, end = run_window(events, spans, now)
    stages = stage_windows(events, end)
    owned = [stages[s] for s in STAGE_CAUSES if s in stages]
    ranks = process_ranks(spans)
    trainer = [s for s in spans if rank0_trainer(s, ranks)
               and not any(a <= s["start_ns"] / NS < b for a, b in owned)]
    steps = step_accounting(executions([s for s in trainer if step_window(s)]))
    intervals: dict[str, list[tuple[float, float]]] = {c: [] for c in SPAN_CAUSES}
    for s in trainer:
        if s["attributes"].get("badput") in intervals:
            intervals[s["attributes"]["badput"]].append((s["start_ns"] / NS, s["end_ns"] / NS))
    for stage, cause in STAGE_CAUSES.items():
        intervals.setdefault(cause, []).extend([stages[stage]] if stage in stages else [])
    badput = {c: union_s(clip(iv, start, end)) for c, iv in intervals.items()}
    badput.update(replayed=steps["replayed_s"], skipped=steps["skipped_s"],
                  detection=detection_s(events), paused=union_s(hold_intervals(events, end)))
    wall = end - start
    badput["other"] = max(0.0, wall - steps["productive_s"] - sum(badput.values()))
    faults, injected = fault_summary(events)
    return {"wall_s": wall, "start_ts": start, "end_ts": end,
            "goodput": ratio(steps["productive_s"], wall), "productive_s": steps["productive_s"],
            "badput_s": {c: badput[c] for c in BADPUT_CAUSES},
            "train": train_goodput(steps["final"], stages.get("train")),
            "faults": faults, "injected_faults": injected,
            "steps": {k: steps[k] for k in ("executed", "kept", "replayed")}}


def ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def run_window(events: list[dict], spans: list[dict], now: float | None) -> tuple[float, float]:
    """(start, end) of the run in unix seconds (from_record's wall_s); (0, 0) when empty."""
    started = [e["ts"] for e in events if e["kind"] == "run_started"]
    finished = [e["ts"] for e in events if e["kind"] == "run_finished"]
    seen = [e["ts"] for e in events] + [s["end_ns"] / NS for s in spans if s.get("end_ns")]
    firsts = [e["ts"] for e in events] + [s["start_ns"] / NS for s in spans if s.get("start_ns")]
    if not seen:
        return 0.0, 0.0
    start = min(started) if started else min(firsts)
    end = max(finished) if finished else now if now is not None else max(seen)
    return start, max(start, end)


def stage_windows(events: list[dict], end: float) -> dict[str, tuple[float, float]]:
    """{stage: (first stage_started, the first stage_finished after it, else `end`)}."""
    out: dict[str, tuple[float, float]] = {}
    for e in sorted(events, key=lambda e: e["ts"]):
        stage = e["payload"].get("stage")
        if e["kind"] == "stage_started" and stage not in out:
            out[stage] = (e["ts"], end)
    for e in sorted(events, key=lambda e: e["ts"], reverse=True):
        stage = e["payload"].get("stage")
        if e["kind"] == "stage_finished" and stage in out and e["ts"] >= out[stage][0]:
            out[stage] = (out[stage][0], e["ts"])
    return out


def hold_intervals(events: list[dict], end: float) -> list[tuple[float, float]]:
    """Each hold: the first paused / needs_attention -> the next run_resumed (or `end`)."""
    out, since = [], None
    for e in sorted(events, key=lambda e: e["ts"]):
        if holds(e) and since is None:
            since = e["ts"]
        elif e["kind"] == "run_resumed" and since is not None:
            out.append((since, e["ts"]))
            since = None
    return out + ([(since, end)] if since is not None else [])


def process_ranks(spans: list[dict]) -> dict[tuple, object]:
    """{(trace_id, pid): rank} of the processes whose spans name a `rank`: a trainer span
    that does not carry the attribute itself is its process's."""
    return {(s.get("trace_id"), s.get("pid")): s["attributes"]["rank"] for s in spans
            if s.get("pid") is not None and s.get("attributes", {}).get("rank") is not None}


def rank0_trainer(span: dict, ranks: dict[tuple, object]) -> bool:
    """A finished span of trainer rank 0: its `rank` attribute, else its process's."""
    rank = span.get("attributes", {}).get("rank")
    if rank is None:
        rank = ranks.get((span.get("trace_id"), span.get("pid")))
    return rank is not None and str(rank) == "0" and bool(span.get("end_ns"))


def step_window(span: dict) -> bool:
    """A `steps a-b` window: goodput, with its steps and their times."""
    a = span.get("attributes", {})
    return bool(a.get("goodput")) and all(k in a for k in ("first_step", "last_step",
                                                           "step_times_s"))


def executions(windows: list[dict]) -> list[dict]:
    """Every step execution in `steps a-b` window spans: {step, time_s, skipped, end_ts,
    order}; `order` = (window end, place in the window), later executions sort after."""
    out = []
    for w in windows:
        a = w["attributes"]
        vetoed = set(a.get("skipped_steps") or ())
        for i, (step, t) in enumerate(zip(range(a["first_step"], a["last_step"] + 1),
                                          a.get("step_times_s") or (), strict=False)):
            out.append({"step": step, "time_s": float(t), "skipped": step in vetoed,
                        "end_ts": w["end_ns"] / NS, "order": (w["end_ns"], i)})
    return out


def step_accounting(execs: list[dict]) -> dict:
    """Productive / replayed / skipped step time and counts of step executions; `final`:
    {step: its last execution}."""
    final: dict[int, dict] = {}
    for e in sorted(execs, key=lambda e: e["order"]):
        final[e["step"]] = e
    last = {id(e) for e in final.values()}
    return {"final": final,
            "productive_s": sum((e["time_s"] for e in final.values() if not e["skipped"]), 0.0),
            "skipped_s": sum((e["time_s"] for e in final.values() if e["skipped"]), 0.0),
            "replayed_s": sum((e["time_s"] for e in execs if id(e) not in last), 0.0),
            "executed": len(execs), "kept": len(final), "replayed": len(execs) - len(final)}


def train_goodput(final: dict[int, dict], window: tuple[float, float] | None) -> dict:
    """Productive step time of final steps whose window ended in the train stage ÷ its wall."""
    if window is None:
        return {"wall_s": 0.0, "productive_s": 0.0, "goodput": None}
    a, b = window
    productive = sum((e["time_s"] for e in final.values()
                      if not e["skipped"] and a <= e["end_ts"] <= b), 0.0)
    return {"wall_s": b - a, "productive_s": productive, "goodput": ratio(productive, b - a)}


def clip(intervals: Iterable[tuple[float, float]], lo: float,
         hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def union_s(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the intervals, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def number(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def detection_s(events: list[dict]) -> float:
    """Fault -> detection seconds the supervisor measured, summed over recoveries."""
    return sum((number(e["payload"].get("detection_s")) or 0.0
                for e in events if e["kind"] == "recovered"), 0.0)


def injected(event: dict) -> bool:
    return bool(event["payload"].get("injected"))


def fault_summary(events: list[dict]) -> tuple[dict, int]:
    """({kind: count, recovered, mttr_s_median, mttr_s_max, lost_steps} of real faults,
    injected fault count). A `recovered` event answers the fault its fault_event_id names
    (and those its also_answers lists: the peers of a multi-node launch),
    else the newest real fault before it still open; MTTR is its mttr_s, else the time from
    the fault to it."""
    evs = sorted(events, key=lambda e: (e["ts"], e["event_id"]))
    real = [e for e in evs if e["kind"] == "fault" and not injected(e)]
    answer: dict[str, dict] = {}
    for r in (e for e in evs if e["kind"] == "recovered"):
        named = r["payload"].get("fault_event_id")
        fault = next((f for f in real if f["event_id"] == named), None) if named else next(
            (f for f in reversed(real) if f["ts"] <= r["ts"] and f["event_id"] not in answer),
            None)
        if fault is not None and fault["event_id"] not in answer:
            answer[fault["event_id"]] = r
        for also in r["payload"].get("also_answers") or ():  # a multi-node launch's peers
            answer.setdefault(also, r)
    out: dict[str, dict] = {}
    for f in real:
        row = out.setdefault(str(f["payload"].get("kind")), {"count": 0, "recovered": 0,
                                                             "mttr": [], "lost_steps": 0})
        row["count"] += 1
        r = answer.get(f["event_id"])
        if r is not None:
            row["recovered"] += 1
            mttr = number(r["payload"].get("mttr_s"))
            row["mttr"].append(mttr if mttr is not None else r["ts"] - f["ts"])
            row["lost_steps"] += int(number(r["payload"].get("lost_steps")) or 0)
    return ({kind: {"count": row["count"], "recovered": row["recovered"],
                    "mttr_s_median": statistics.median(row["mttr"]) if row["mttr"] else None,
                    "mttr_s_max": max(row["mttr"]) if row["mttr"] else None,
                    "lost_steps": row["lost_steps"]} for kind, row in sorted(out.items())},
            sum(e["kind"] == "fault" and injected(e) for e in evs))
