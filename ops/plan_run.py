"""`mainspring plan --from-run RUN`: predict a recorded run's training wall time from its
first 10 % of steps, and say how far off that was; and `--mfu-from-run RUN`: the MFU a
recorded run measured, for a plan of a run to come.

Reads only the durable record, the event log (storage/events.py) and the stored spans
(storage/spans.py), as `mainspring report` does. The prediction is pure (`predict`): the
seconds per step the first 10 % showed, times the steps, plus each segment's head and tail
as the first segment showed them. Faults after the first 10 % are not foreseen: the
record's fault count and their badput are reported beside the error.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

from common.errors import BadConfig

PREFIX = 0.10  # the share of steps the prediction may see
# ops/goodput.from_record's badput causes that a fault brings: what the prediction, which
# foresees no fault, is also held against with them taken out of the actual
FAULT_CAUSES = ("detection", "restore", "replayed", "rollback", "skipped")


def training_span(events: list[dict], spans: list[dict] = ()) -> dict:
    """The training stage's facts from the record: first start, last finish, total steps,
    steps per segment, the step marks of the first attempt of the first segment (from its
    spans and from its windows), its checkpoints' commits, faults."""
    starts = [e for e in events if e["kind"] == "segment_started"]
    if not starts:
        raise BadConfig("--from-run", "the run recorded no training segment",
                        "pick a run that reached training ('mainspring report' lists its stages)")
    first = starts[0]
    ends = [e for e in events if e["kind"] == "segment_finished"]
    windows = [e for e in events if e["kind"] == "train_metrics"]
    total = max(int(e["payload"]["to_step"]) for e in starts)
    seg = int(first["payload"]["to_step"]) - int(first["payload"]["from_step"])
    lead = [{"first": w["payload"]["first_step"], "last": w["payload"]["last_step"],
             "ts": w["ts"]} for w in windows if w["ts"] >= first["ts"]
            and w["payload"].get("attempt") == first["payload"].get("attempt")
            and w["payload"].get("segment") == f"{first['payload']['from_step']}-"
                                               f"{first['payload']['to_step']}"]
    end_ts = ends[-1]["ts"] if ends else (windows[-1]["ts"] if windows else first["ts"])
    return {"start_ts": first["ts"], "end_ts": end_ts, "finished": bool(ends)
            and int(ends[-1]["payload"]["to_step"]) == total, "total_steps": total,
            "segment_steps": seg, "windows": lead,
            "step_spans": step_spans(spans, first["ts"], int(first["payload"]["to_step"])),
            "commits": commits(events, spans, first["ts"]),
            "faults": sum(1 for e in events if e["kind"] == "fault")}


def _rank0(spans: list[dict], prefix: str, since: float) -> list[dict]:
    """The lowest rank's spans named `prefix...` that started after `since`, by start."""
    mine = [s for s in spans if s["name"].startswith(prefix) and s["start_ns"] / 1e9 >= since
            and (s.get("attributes") or {}).get("rank") is not None]
    low = min((s["attributes"]["rank"] for s in mine), default=None)
    return sorted((s for s in mine if s["attributes"]["rank"] == low),
                  key=lambda s: s["start_ns"])


def step_spans(spans: list[dict], since: float, to_step: int) -> list[dict]:
    """The trainer's `steps a-b` spans of the first segment's first launch, as step marks:
    each ends at its last step's own timestamp, where a train_metrics window carries the
    time the supervisor's poll found it (every 0.25 s: on 0.05 s CPU steps a 10-step
    window's time is off by up to half its length). A replay (a retry, a rollback) ends
    the run of marks."""
    out: list[dict] = []
    for s in _rank0(spans, "steps ", since):
        a = s["attributes"]
        if a["last_step"] > to_step or out and a["first_step"] != out[-1]["last"] + 1:
            break
        out.append({"first": a["first_step"], "last": a["last_step"], "ts": s["end_ns"] / 1e9})
    return out


def commits(events: list[dict], spans: list[dict], since: float) -> list[dict]:
    """Each checkpoint's stage-to-durable time by step: the trainer's `checkpoint stage N`
    start to the writer's `upload N` end, or without spans the checkpoint_saved event to
    its checkpoint_committed one."""
    staged = {_step_of(s): s["start_ns"] / 1e9 for s in _rank0(spans, "checkpoint stage ", since)}
    uploaded = {_step_of(s): s["end_ns"] / 1e9 for s in spans
                if s["name"].startswith("upload ") and s["start_ns"] / 1e9 >= since}
    staged.pop(None, None)
    uploaded.pop(None, None)
    if not (staged and uploaded):
        staged = {e["step"]: e["ts"] for e in events if e["kind"] == "checkpoint_saved"
                  and e["ts"] >= since and e.get("step") is not None}
        uploaded = {e["step"]: e["ts"] for e in events if e["kind"] == "checkpoint_committed"
                    and e["ts"] >= since and e.get("step") is not None}
    return sorted(({"step": k, "s": uploaded[k] - staged[k]} for k in staged
                   if k in uploaded and uploaded[k] >= staged[k]), key=lambda c: c["step"])


def _step_of(span: dict) -> int | None:
    """The step a `checkpoint stage N` or `upload N` span names (None: not a step)."""
    tail = span["name"].rsplit(" ", 1)[-1]
    return int(tail) if tail.isdigit() else None


def predict(span: dict, prefix: float = PREFIX, fault_s: float = 0.0) -> dict:
    """Predicted training seconds from what the first `prefix` of the steps showed, against
    the actual and against the actual less `fault_s`, the badput the record's faults caused.

    Seconds per step: over the later half of the prefix, from the first mark at or past its
    middle (or earlier, to keep two intervals) to the last (checkpoint pauses in that
    stretch included: they recur). Per segment: its head (segment_started to the last
    mark, less its steps at that rate: dispatch, start-up, restore, the first steps slowed
    by the segment's own start-up work) and its tail, a segment ending by committing its
    last checkpoint and waiting for the upload (trainer/checkpoint_manager.py, finish): the
    median stage-to-durable time of the prefix's checkpoints after the first (whose upload
    pays the writer process's start)."""
    total = span["total_steps"]
    cutoff = max(1, math.ceil(prefix * total))
    found = [(source, seen) for source, seen in (
        ("spans", [m for m in span.get("step_spans") or [] if m["last"] <= cutoff]),
        ("windows", [m for m in span["windows"] if m["last"] <= cutoff])) if len(seen) >= 2]
    if not found:
        raise BadConfig("--from-run", f"the record has under two step marks (train_metrics "
                        f"windows or step spans) in its first {cutoff} steps",
                        "pick a run at least twenty metrics windows long (ops.metrics_every), "
                        "or one whose first segment reached 10 % of its steps")
    source, seen = found[0]  # the spans' exact times where there are two, else the windows'
    # the rate over the later half of the prefix: a segment's first steps share the cores
    # with its own start-up work (the next standby's imports, the checkpoint writer's
    # start, the scrub), so they run slower than the rest; their excess counts in the head.
    # At least two intervals where there are, so no single mark's time sets the rate.
    middle = next(i for i, m in enumerate(seen) if m["last"] >= seen[-1]["last"] / 2)
    first, last = seen[max(0, min(middle, len(seen) - 3))], seen[-1]
    per_step = (last["ts"] - first["ts"]) / (last["last"] - first["last"])
    head = max(0.0, last["ts"] - span["start_ts"] - per_step * last["last"])
    later = [c["s"] for c in span.get("commits") or [] if c["step"] <= last["last"]][1:]
    tail = statistics.median(later) if later else 0.0
    segments = math.ceil(total / span["segment_steps"]) if span["segment_steps"] > 0 else 1
    predicted = segments * (head + tail) + per_step * total
    actual = span["end_ts"] - span["start_ts"]
    return {"seen_steps": last["last"], "total_steps": total, "marks_from": source,
            "seconds_per_step": per_step, "startup_s": head, "tail_s": tail,
            "start_ts": span["start_ts"], "seen_ts": last["ts"], "segments": segments,
            "segment_steps": span["segment_steps"],
            "predicted_s": predicted, "actual_s": actual,
            "error": (predicted - actual) / actual if actual > 0 else None,
            "fault_badput_s": fault_s, "error_without_faults":
                (predicted - (actual - fault_s)) / (actual - fault_s)
                if actual - fault_s > 0 else None,
            "finished": span["finished"], "faults": span["faults"]}


def predicted_at(step: int, p: dict) -> float:
    """Pure: the training seconds `predict`'s figures `p` foresee by the end of `step`: the
    heads of the segments begun, the tails of those ended, the steps at their rate. At the
    last step it is `p["predicted_s"]`."""
    seg = p["segment_steps"] if p["segment_steps"] > 0 else p["total_steps"]
    begun = max(1, math.ceil(step / seg))
    ended = begun if step >= p["total_steps"] else begun - 1
    return begun * p["startup_s"] + ended * p["tail_s"] + p["seconds_per_step"] * step


def from_events(run_id: str, events: list[dict], spans: list[dict]) -> dict:
    """The prediction `--from-run` prints, from a run's events and spans as the durable
    store holds them (benchmarks/plan_from_run.py calls this on the runs it records)."""
    from ops.goodput import from_record

    badput = from_record(events, spans)["badput_s"]
    fault_s = sum(badput.get(c) or 0.0 for c in FAULT_CAUSES)
    return {"run_id": run_id, **predict(training_span(events, spans), fault_s=fault_s)}


def read_run(store: str, run_id: str, flag: str = "--from-run") -> list[dict]:
    """A recorded run's events; BadConfig naming `flag` when the store has none for it."""
    from storage.events import read_events

    events = read_events(store, run_id)
    if not events:
        raise BadConfig(flag, f"no events for run {run_id!r} in {store}",
                        "give the run id and its --store (durable storage URL)")
    return events


def cmd_from_run(args: argparse.Namespace) -> int:
    from storage.spans import read_spans

    events = read_run(args.store, args.from_run)
    result = from_events(args.from_run, events, read_spans(args.store, args.from_run))
    if args.json:
        from ops.cli_output import json_line

        print(json_line(result))
        return 0
    sys.stdout.write(
        f"run {result['run_id']}: from its first {result['seen_steps']} of "
        f"{result['total_steps']} steps (its {result['marks_from']}: "
        f"{result['seconds_per_step']:.3g} s a step, {result['startup_s']:.3g} s to start and "
        f"{result['tail_s']:.3g} s to end each of {result['segments']} segments) the "
        f"plan predicts {result['predicted_s']:.0f} s of training; it took "
        f"{result['actual_s']:.0f} s ({result['error']:+.1%}"
        f"{'' if result['finished'] else ', unfinished'}); {result['faults']} faults cost "
        f"{result['fault_badput_s']:.0f} s, which the prediction does not foresee: without "
        f"them it is off by {result['error_without_faults']:+.1%}\n")
    return 0


def run_mfu(run_id: str, events: list[dict], spec: dict | None, spans: list[dict]) -> dict:
    """The MFU a recorded run measured, as `plan` takes it: the step-weighted harmonic mean
    of its train_metrics windows (total step time over total FLOPs at the run's peak, the
    way a plan spends it: FLOPs / (peak x MFU)), the windows' 10th and 90th percentiles as
    its range, on the run's accelerators (an end-to-end figure at that count: the plan
    backs its communication out). Its peak is the run's `train.peak_tflops` where the spec
    set one; otherwise the trainer probed a matmul ceiling the record does not keep."""
    from ops.report_map import accelerators

    windows = [e["payload"] for e in events if e["kind"] == "train_metrics"]
    measured = [(int(w.get("steps") or 1), float(w["mfu"])) for w in windows
                if isinstance(w.get("mfu"), (int, float)) and math.isfinite(w["mfu"])
                and w["mfu"] > 0]
    if not measured:
        raise BadConfig("--mfu-from-run", f"run {run_id!r} recorded no MFU figures "
                        f"({len(windows)} train_metrics windows, none with an mfu)",
                        "pick a run that reached training, or give --mfu")
    steps = sum(n for n, _ in measured)
    mfu = steps / sum(n / m for n, m in measured)
    values = [m for _, m in measured]
    low, high = (statistics.quantiles(values, n=10, method="inclusive")[::8]
                 if len(values) > 1 else (mfu, mfu))
    at, at_from = accelerators(spec, spans)
    peak = float(((spec or {}).get("train") or {}).get("peak_tflops") or 0.0) or None
    against = (f"a peak of {peak:g} TFLOP/s (its train.peak_tflops)" if peak else
               "the matmul ceiling its trainer probed (not in the record: give that as "
               "--peak-tflops)")
    return {"mfu": mfu, "low": min(low, mfu), "high": max(high, mfu), "at": at,
            "peak_tflops": peak, "windows": len(measured), "steps": steps,
            "source": f"run {run_id}: step-weighted over {len(measured)} train_metrics "
                      f"windows ({steps} steps), range their 10th-90th percentile, on {at} "
                      f"accelerators ({at_from}), against {against}"}


def mfu_from_run(store: str, run_id: str) -> dict:
    """`run_mfu` of a run in the durable store (BadConfig when the store has no events)."""
    from storage.runs import stored_spec
    from storage.spans import read_spans

    events = read_run(store, run_id, "--mfu-from-run")
    return run_mfu(run_id, events, stored_spec(store, run_id), read_spans(store, run_id))
