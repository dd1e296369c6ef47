"""The arithmetic of benchmarks/recovery.py, pure: what the durable record, the spans and the
workers' log lines say about each strike, cut at the marks its docstring defines, and the
per-kind summary against the recovery targets."""

from __future__ import annotations

import math

KINDS = ("kill_worker", "kill_rank", "hang")
MARKS = ("strike", "detected", "launched", "restore_began", "restored", "first_step")
PARTS = ("detection", "scheduling", "startup", "restore", "first_step")
# the finer cuts of each part (launch_marks), summarised per kind
DETAIL_S = ("detected_after_heartbeat_s", "heartbeat_age_at_strike_s", "detection_timeout_s",
            "dispatch_s", "prepare_s", "pre_init_s", "process_group_init_s", "post_init_s",
            "before_first_step_s", "first_step_time_s")


# ---- pure: the arithmetic ---------------------------------------------------------------
def percentile(values, q: float) -> float | None:
    """The q-th percentile by linear interpolation between order statistics (numpy's
    default); None values are left out, None when nothing is left."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def split(marks: dict[str, float | None]) -> dict[str, float | None]:
    """MTTR (strike -> first_step) as PARTS between consecutive MARKS; a part with a missing
    end is None and its time is in `unaccounted`, so the parts always sum to the MTTR."""
    ts = [marks.get(m) for m in MARKS]
    parts = {p: (b - a if a is not None and b is not None else None)
             for p, a, b in zip(PARTS, ts, ts[1:])}
    parts["unaccounted"] = ts[-1] - ts[0] - sum(v for v in parts.values() if v is not None)
    return parts


def target_s(kind: str, heartbeat_s: float, fault_payload: dict) -> float | None:
    """The recovery target for one fault: T + 3 s, 6 s, the hang's own timeout + 3 s."""
    if kind == "kill_worker":
        return heartbeat_s + 3.0
    if kind == "kill_rank":
        return 6.0
    timeout = fault_payload.get("timeout_s")
    return timeout + 3.0 if timeout is not None else None


def summarize(faults: list[dict]) -> dict:
    """Per kind: MTTR p50/p95/max (strike-based, and the events' own), each part's p50, the
    breakdown of the median fault (which sums to its MTTR), the target and whether the p50
    meets it (the p50 of each fault's MTTR - its own target <= 0)."""
    out = {}
    for kind in sorted({f["kind"] for f in faults}):
        items = [f for f in faults if f["kind"] == kind]
        rec = sorted((f for f in items if f.get("recovered")), key=lambda f: f["mttr_s"])
        mttr = [f["mttr_s"] for f in rec]
        over = [f["mttr_s"] - f["target_s"] for f in rec if f.get("target_s") is not None]
        median = rec[(len(rec) - 1) // 2] if rec else None
        out[kind] = {
            "n": len(items), "recovered": len(rec),
            "mttr_p50_s": percentile(mttr, 50), "mttr_p95_s": percentile(mttr, 95),
            "mttr_max_s": max(mttr) if mttr else None,
            "mttr_event_p50_s": percentile([f.get("mttr_event_s") for f in rec], 50),
            "breakdown_p50_s": {p: percentile([f["breakdown"][p] for f in rec], 50)
                                for p in (*PARTS, "unaccounted")},
            "breakdown_of_median_fault": median["breakdown"] if median else None,
            "detail_p50_s": {k: percentile([f.get("detail", {}).get(k) for f in rec], 50)
                             for k in DETAIL_S if any(f.get("detail", {}).get(k) is not None
                                                      for f in rec)},
            "target_s": percentile([f.get("target_s") for f in rec], 50),
            "met": bool(over) and percentile(over, 50) <= 0,
            "within_target": sum(o <= 0 for o in over),
            "in_place": sum(bool(f.get("in_place")) for f in rec),
            "warm_launches": sum(f.get("warm") is True for f in rec),
            "tiers": {t: sum(f.get("tier") == t for f in rec) for t in
                      sorted({str(f.get("tier")) for f in rec})},
            "lost_steps_max": max((f.get("lost_steps") or 0 for f in rec), default=None),
            "recorded": {k: sum(f.get("recorded") == k for f in items)
                         for k in sorted({str(f.get("recorded")) for f in items})}}
    return out


# ---- pure: what the record says about one fault -----------------------------------------
def real_faults(events: list[dict]) -> list[dict]:
    return [e for e in events if e["kind"] == "fault" and not e["payload"].get("injected")]


def answer(strike: dict, events: list[dict], until_ts: float) -> tuple[dict | None, dict | None]:
    """The first real fault recorded after the strike (and before the next one) and the
    `recovered` event naming it."""
    fault = next((e for e in real_faults(events) if strike["ts"] <= e["ts"] < until_ts), None)
    if fault is None:
        return None, None
    rec = next((e for e in events if e["kind"] == "recovered"
                and e["payload"].get("fault_event_id") == fault["event_id"]), None)
    return fault, rec


def rank0(span: dict) -> bool:
    return str(span.get("attributes", {}).get("rank")) == "0" and bool(span.get("end_ns"))


def first_span(spans: list[dict], name: str, after: float) -> dict | None:
    """Rank 0's first finished span called `name` that starts at or after `after` (s)."""
    return next((s for s in spans if s["name"] == name and rank0(s)
                 and s["start_ns"] / 1e9 >= after), None)


def same_process(spans: list[dict], name: str, of: dict | None) -> dict | None:
    """The span called `name` of the process that emitted `of`. A process's `startup` span
    starts at its create time as psutil computes it (boot time + start ticks), which reads
    ~0.5 s early here: it cannot be picked by its start time."""
    return next((s for s in spans if of is not None and s["name"] == name and rank0(s)
                 and s.get("pid") == of.get("pid")
                 and s.get("trace_id") == of.get("trace_id")), None)


def seconds(span: dict | None) -> float | None:
    return (span["end_ns"] - span["start_ns"]) / 1e9 if span else None


def launch_marks(strike: dict, fault: dict, rec: dict, lines: list[dict], spans: list[dict],
                 logs: list[dict]) -> tuple[dict, dict, dict]:
    """(marks, the source of each, details) of the relaunch that answered `fault`: the
    launch is the recovered event's (attempt, restart); lines are progress lines, spans the
    run's stored spans, logs the trainer workers' parsed log lines (ts, event, file, ...)."""
    p, r = fault["payload"], rec["payload"]
    attempt, restart = r.get("attempt"), r.get("restart", 0)
    detected = p.get("detected_ts")
    start = next((s for s in lines if s["type"] == "start" and s.get("attempt") == attempt
                  and s.get("restart", 0) == restart and s["ts"] > strike["ts"]), None)
    first = next((s for s in lines if s["type"] == "step" and start is not None
                  and s["ts"] > start["ts"]), None)
    since = detected if detected is not None else strike["ts"]
    launch = next((x for x in logs if x["event"] == "child_started" and x["ts"] >= since
                   and (start is None or x["ts"] <= start["ts"])), None)
    restore = first_span(spans, "restore", launch["ts"] if launch else since)
    startup, pg = (same_process(spans, n, restore) for n in ("startup", "process_group_init"))
    launched = launch["ts"] if launch else startup["start_ns"] / 1e9 if startup else None
    marks = {"strike": strike["ts"], "detected": detected, "launched": launched,
             "restore_began": restore["start_ns"] / 1e9 if restore else
             (start["ts"] - start.get("restore_s", 0.0) if start else None),
             "restored": restore["end_ns"] / 1e9 if restore else start["ts"] if start else None,
             "first_step": first["ts"] if first else None}
    sources = {"strike": "chaos", "detected": "fault event detected_ts",
               "launched": "worker log child_started" if launch else
               "span startup (rank 0 process start)" if startup else None,
               "restore_began": "span restore" if restore else "progress start line",
               "restored": "span restore" if restore else "progress start line",
               "first_step": "progress step line"}
    segment = next((s for s in spans if s["name"].startswith("segment ") and not restart
                    and s.get("attributes", {}).get("attempt") == attempt
                    and s["start_ns"] / 1e9 >= strike["ts"]), None)
    at = lambda s, end=False: s[("end_ns" if end else "start_ns")] / 1e9  # noqa: E731
    step_s = first.get("step_time_s") if first else None
    detail = {
        "warm": launch.get("warm") if launch else None,
        "waited_for_standby": bool(launch) and any(
            x["event"] == "standby_ready" and x["file"] == launch["file"]
            and since <= x["ts"] <= launch["ts"] for x in logs),
        # detection of a lost worker: after its last heartbeat (T, then the retry backoff)
        "detected_after_heartbeat_s": detected - p["heartbeat_ts"]
        if p.get("heartbeat_ts") and detected else None,
        "heartbeat_age_at_strike_s": strike["ts"] - p["heartbeat_ts"]
        if p.get("heartbeat_ts") else None,
        "detection_timeout_s": p.get("timeout_s"),
        # scheduling of a retry: the server's dispatch, then the supervisor's preparation
        "dispatch_s": at(segment) - detected if segment and detected else None,
        "prepare_s": launched - at(segment) if segment and launched else None,
        # start-up: launch -> process_group_init (fork, tracing, deepspeed), the span itself
        # (process group, model, engine), then -> restore (batches, meter)
        "pre_init_s": at(pg) - launched if pg and launched else None,
        "process_group_init_s": seconds(pg),
        "post_init_s": at(restore) - at(pg, True) if pg and restore else None,
        # first step: restored -> the step's own start, then its step_time_s
        "before_first_step_s": marks["first_step"] - marks["restored"] - step_s
        if step_s is not None and marks["restored"] and marks["first_step"] else None,
        "first_step_time_s": step_s}
    return marks, sources, detail


def fault_report(strike: dict, events: list[dict], until_ts: float, lines: list[dict],
                 spans: list[dict], logs: list[dict], heartbeat_s: float) -> dict:
    """One strike's row of the JSON line."""
    fault, rec = answer(strike, events, until_ts)
    row = {"kind": strike["kind"], "segment": strike.get("segment"),
           "step_at_strike": strike.get("step"), "recorded": None, "recovered": False,
           "load_1m": strike.get("load_1m")}
    if fault is None or rec is None:
        return {**row, "recorded": fault["payload"]["kind"] if fault else None}
    marks, sources, detail = launch_marks(strike, fault, rec, lines, spans, logs)
    r = rec["payload"]
    row.update(recorded=fault["payload"]["kind"], recovered=marks["first_step"] is not None,
               attempt=r.get("attempt"), restart=r.get("restart", 0),
               in_place=bool(r.get("in_place")), warm=detail.pop("warm"), tier=r.get("tier"),
               lost_steps=r.get("lost_steps"), mttr_event_s=r.get("mttr_s"),
               event_split_s={k: r.get(k) for k in ("detection_s", "restart_s", "restore_s")},
               target_s=target_s(strike["kind"], heartbeat_s, fault["payload"]))
    if not row["recovered"]:
        return row
    return {**row, "mttr_s": marks["first_step"] - marks["strike"], "breakdown": split(marks),
            "sources": sources, "detail": detail}


def unexplained(strikes: list[dict], events: list[dict]) -> list[dict]:
    """Real faults no strike caused (a false hang, a heartbeat timeout under load)."""
    ends = [s["ts"] for s in strikes[1:]] + [math.inf]
    caused = {answer(s, events, e)[0]["event_id"] for s, e in zip(strikes, ends)
              if answer(s, events, e)[0] is not None}
    return [{"kind": e["payload"]["kind"], "step": e["step"], "ts": e["ts"]}
            for e in real_faults(events) if e["event_id"] not in caused]


def report(raw: dict) -> dict:
    strikes, events, cfg = raw["strikes"], raw["events"], raw["inputs"]
    ends = [s["ts"] for s in strikes[1:]] + [math.inf]
    faults = [fault_report(s, events, e, raw["lines"], raw["spans"], raw["logs"],
                           cfg["heartbeat_timeout_s"]) for s, e in zip(strikes, ends)]
    steps = [s["step_time_s"] for s in raw["lines"] if s["type"] == "step"]
    hangs = [f["detail"]["detection_timeout_s"] for f in faults if f.get("detail")
             and f["kind"] == "hang"]
    return {"figure": "recovery_mttr", "heartbeat_timeout_s": cfg["heartbeat_timeout_s"],
            "hang_detection_timeout_s": {"floor_s": cfg["hang_floor_s"], "step_factor": 10.0,
                                         "used_s": hangs},
            "per_kind": summarize(faults), "faults": faults,
            "unexplained_faults": unexplained(strikes, events),
            "parts": {"detection": "strike -> fault detected_ts", "scheduling": "detected -> "
                      "child_started (retry dispatch + preparation, or in-place teardown)",
                      "startup": "launched -> restore span start (fork, process_group_init)",
                      "restore": "restore span", "first_step": "restored -> first step line"},
            "inputs": {**cfg, "step_time_p50_s": percentile(steps, 50),
                       "step_time_p99_s": percentile(steps, 99)},
            "load_avg_1m": raw["loads"], "worker_restarts": raw["worker_restarts"],
            # aborted once every strike was done (the evaluation after it measures nothing)
            "run_end": "aborted" if raw.get("aborted") else raw.get("error") or raw.get("result")}
