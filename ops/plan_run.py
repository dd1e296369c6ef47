"""`mainspring plan --from-run RUN`: predict a recorded run's training wall time from its
first 10 % of steps, and say how far off that was.

Reads only the durable event log (storage/events.py), as `mainspring report` does. The
prediction is pure: a segment's start-up cost (its `segment_started` to its first
`train_metrics` window, less that window's steps) times the number of segments, plus the
seconds per step between the first window and the one that reaches 10 % of the steps
(checkpoints and evals in that stretch included, since they recur). Faults after the first
10 % are not foreseen: the record's fault count is reported beside the error.
"""

from __future__ import annotations

import argparse
import math
import sys

from common.errors import BadConfig

PREFIX = 0.10  # the share of steps the prediction may see
# ops/goodput.from_record's badput causes that a fault brings: what the prediction, which
# foresees no fault, is also held against with them taken out of the actual
FAULT_CAUSES = ("detection", "restore", "replayed", "rollback", "skipped")


def training_span(events: list[dict]) -> dict:
    """The training stage's facts from the record: first start, last finish, total steps,
    steps per segment, the windows of the first attempt of the first segment, faults."""
    starts = [e for e in events if e["kind"] == "segment_started"]
    if not starts:
        raise BadConfig("--from-run", "the run recorded no training segment",
                        "pick a run that reached training ('mainspring report' lists its stages)")
    first = starts[0]
    ends = [e for e in events if e["kind"] == "segment_finished"]
    windows = [e for e in events if e["kind"] == "train_metrics"]
    total = max(int(e["payload"]["to_step"]) for e in starts)
    seg = int(first["payload"]["to_step"]) - int(first["payload"]["from_step"])
    lead = [w for w in windows if w["ts"] >= first["ts"]
            and w["payload"].get("attempt") == first["payload"].get("attempt")
            and w["payload"].get("segment") == f"{first['payload']['from_step']}-"
                                               f"{first['payload']['to_step']}"]
    end_ts = ends[-1]["ts"] if ends else (windows[-1]["ts"] if windows else first["ts"])
    return {"start_ts": first["ts"], "end_ts": end_ts, "finished": bool(ends)
            and int(ends[-1]["payload"]["to_step"]) == total, "total_steps": total,
            "segment_steps": seg, "windows": lead,
            "faults": sum(1 for e in events if e["kind"] == "fault")}


def predict(span: dict, prefix: float = PREFIX, fault_s: float = 0.0) -> dict:
    """Predicted training seconds from the windows up to `prefix` of the steps, against the
    actual and against the actual less `fault_s`, the badput the record's faults caused."""
    total, windows = span["total_steps"], span["windows"]
    cutoff = max(1, math.ceil(prefix * total))
    seen = [w for w in windows if w["payload"]["first_step"] <= cutoff]
    if len(seen) < 2 or seen[-1]["payload"]["last_step"] < cutoff:
        raise BadConfig("--from-run", f"the record has under two train_metrics windows in "
                        f"its first {cutoff} steps", "pick a longer run, or one whose first "
                        "segment reached 10 % of its steps")
    first, last = seen[0], seen[-1]
    per_step = (last["ts"] - first["ts"]) / (last["payload"]["last_step"]
                                             - first["payload"]["last_step"])
    startup = max(0.0, first["ts"] - span["start_ts"] - per_step * first["payload"]["last_step"])
    segments = math.ceil(total / span["segment_steps"]) if span["segment_steps"] > 0 else 1
    predicted = segments * startup + per_step * total
    actual = span["end_ts"] - span["start_ts"]
    return {"seen_steps": last["payload"]["last_step"], "total_steps": total,
            "seconds_per_step": per_step, "startup_s": startup, "segments": segments,
            "predicted_s": predicted, "actual_s": actual,
            "error": (predicted - actual) / actual if actual > 0 else None,
            "fault_badput_s": fault_s, "error_without_faults":
                (predicted - (actual - fault_s)) / (actual - fault_s)
                if actual - fault_s > 0 else None,
            "finished": span["finished"], "faults": span["faults"]}


def cmd_from_run(args: argparse.Namespace) -> int:
    from ops.goodput import from_record
    from storage.events import read_events
    from storage.spans import read_spans

    events = read_events(args.store, args.from_run)
    if not events:
        raise BadConfig("--from-run", f"no events for run {args.from_run!r} in {args.store}",
                        "give the run id and its --store (durable storage URL)")
    badput = from_record(events, read_spans(args.store, args.from_run))["badput_s"]
    fault_s = sum(badput.get(c) or 0.0 for c in FAULT_CAUSES)
    result = {"run_id": args.from_run, **predict(training_span(events), fault_s=fault_s)}
    if args.json:
        from ops.cli_output import json_line

        print(json_line(result))
        return 0
    sys.stdout.write(
        f"run {result['run_id']}: from its first {result['seen_steps']} of "
        f"{result['total_steps']} steps ({result['seconds_per_step']:.3g} s a step, "
        f"{result['startup_s']:.3g} s to start each of {result['segments']} segments) the "
        f"plan predicts {result['predicted_s']:.0f} s of training; it took "
        f"{result['actual_s']:.0f} s ({result['error']:+.1%}"
        f"{'' if result['finished'] else ', unfinished'}); {result['faults']} faults cost "
        f"{result['fault_badput_s']:.0f} s, which the prediction does not foresee: without "
        f"them it is off by {result['error_without_faults']:+.1%}\n")
    return 0
