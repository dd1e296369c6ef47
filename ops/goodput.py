"""Goodput accounting: where a run's training time went, from what the run left behind.

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
    """Operator commands and pauses that waited for one."""
    return sum(e["kind"] in HUMAN_KINDS for e in events)
