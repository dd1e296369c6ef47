"""Recovery time per fault kind, with every second of it accounted for (issue 16).

    .venv/bin/python benchmarks/recovery.py [--quick] [--repeats 5] [--heartbeat-timeout-s 5]
        [--hang-floor-s 2] [--segment-steps 300] [--checkpoint-every 10] [--settle-steps 20]
        [--save-raw FILE | --from-raw FILE]

Real services (benchmarks/harness.py: the Temporal dev server, SeaweedFS as the durable
tier at CPU priority 19), two trainer workers (a lost worker's retry goes to the other, or
to its own replacement), one TrainingRun at world size 2 with its sweep off. From outside
(ops/chaos.py), one fault at a time, in rotation: SIGKILL the trainer worker that runs the
segment (`kill_worker`: only the heartbeat timeout sees it), SIGKILL its highest rank
(`kill_rank`), SIGSTOP it (`hang`: the auto hang timeout, max(ops.hang_floor_s, 10 x p99
step), fires). A strike waits until the trainer is stepping mid-segment, its worker's warm
standby is ready again (faults days apart always find one; activities/standby.py) and, for
a worker kill, the segment has not lost a worker yet (Temporal's retry backoff grows with
each attempt of one activity: 1 s, 2 s, 4 s ...); after it, until the fault's `recovered`
event is in the durable log and `--settle-steps` more steps ran. Once every strike is done
the run is aborted (signal `abort`): the evaluation after training measures nothing here.

MTTR = the strike (the real fault time) -> the end of the first step after the relaunch.
It is cut at five marks, so its parts add up to it:
- detection: strike -> detected (the fault event's detected_ts: the supervisor saw the rank
  die or the hang timeout fire; for a lost worker the retry's scheduled time, after the
  heartbeat timeout and the retry backoff);
- scheduling: detected -> launched (the supervisor's `child_started` log line: the retry
  dispatched and its supervisor's preparation, or the in-place restart's teardown, checks
  and the standby hand-over); fallback: rank 0's `startup` span start (its process start);
- start-up: launched -> restore began (rank 0's `restore` span; fallback: the start line's
  ts - restore_s): the fork, `process_group_init` (process group, model, engine), batches;
- restore: the `restore` span (fallback: the start line's restore_s);
- first step: restored -> the first step line after the launch's start line.
A part whose mark is missing is None and its seconds go to `unaccounted_s`. Each fault says
which source each mark came from, and the recovered event's own mttr_s (from the fault's
fault_ts: the last heartbeat for a lost worker, the last progress line for a hang).
Targets (issue 16): worker kill <= T + 3 s (T the heartbeat timeout); rank kill <= 6 s;
hang <= its detection timeout (the fault event's timeout_s) + 3 s; `met` compares the p50.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import math
import os
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ops.chaos import Chaos, process_tree, rank_pids
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from storage.spans import read_spans

KINDS = ("kill_worker", "kill_rank", "hang")
MARKS = ("strike", "detected", "launched", "restore_began", "restored", "first_step")
PARTS = ("detection", "scheduling", "startup", "restore", "first_step")
MIN_STEPS_IN = 5  # a strike waits until the launch has run this many steps
MICRO_BATCH_TOKENS = 2048  # per rank: ~0.15 s steps at world size 2 on 2 cores
# the finer cuts of each part (launch_marks), summarised per kind
DETAIL_S = ("detected_after_heartbeat_s", "heartbeat_age_at_strike_s", "detection_timeout_s",
            "dispatch_s", "prepare_s", "pre_init_s", "process_group_init_s", "post_init_s",
            "before_first_step_s", "first_step_time_s")
LOG_EVENTS = ("child_started", "standby_ready", "standby_failed", "standby_not_ready",
              "standby_not_matching", "workers_started")


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
    """Issue 16's bound for one fault: T + 3 s, 6 s, the hang's own timeout + 3 s."""
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


# ---- the run -----------------------------------------------------------------------------
def parse_logs(paths: list[str], run_id: str) -> list[dict]:
    """The trainer workers' log lines that matter here (LOG_EVENTS), with a unix ts."""
    out = []
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                if not line.startswith("{"):
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("event") not in LOG_EVENTS or rec.get("run_id", run_id) != run_id:
                    continue
                ts = datetime.fromisoformat(rec["timestamp"]).timestamp()
                out.append({**{k: rec.get(k) for k in ("event", "warm", "pid", "attempt")},
                            "ts": ts, "file": path})
    return sorted(out, key=lambda x: x["ts"])


def newest_progress(spec) -> dict | None:
    """Where training is: the newest progress file's segment, its last step and the steps
    run since its last start line."""
    paths = glob.glob(os.path.join(spec.storage.fast, spec.run_id, "segments", "*",
                                   "progress.jsonl"))
    if not paths:
        return None
    path = max(paths, key=os.path.getmtime)
    lo, hi = (int(x) for x in os.path.basename(os.path.dirname(path)).split("-"))
    last, since = None, 0
    with open(path) as f:
        for line in f:
            if line.startswith('{"type": "start"'):
                since = 0
            elif line.startswith('{"type": "step"') and line.rstrip().endswith("}"):
                last, since = json.loads(line), since + 1
    return {"segment": (lo, hi), "step": last["step"], "ts": last["ts"],
            "since_start": since} if last else None


class Bench:
    """The services, the run and the strikes."""

    def __init__(self, services, spec, cfg: dict) -> None:
        self.services, self.spec, self.cfg = services, spec, cfg
        self.chaos = Chaos(worker_pid=self.busy_pid,
                           durable=CheckpointStore(spec.storage.durable, spec.run_id),
                           fast_root=os.path.join(spec.storage.fast, spec.run_id))
        self.strikes: list[dict] = []
        self.loads: list[float] = []

    def trainers(self) -> list[tuple[str, object]]:
        return [(os.path.join(f.log_dir, "worker-trainer.log"), f.procs["trainer"])
                for f in self.services.trainer_fleets()]

    def busy(self) -> tuple[str, object] | None:
        return next(((log, p) for log, p in self.trainers()
                     if rank_pids(process_tree(p.pid))), None)

    def busy_pid(self) -> int:
        found = self.busy()
        return (found or self.trainers()[0])[1].pid

    def standbys_ready(self, kind: str) -> bool:
        """The busy worker's standby is ready again after its last launch; for a worker kill
        every other trainer worker is up with one ready too."""
        import psutil

        logs = parse_logs([log for log, _ in self.trainers() if os.path.exists(log)],
                          self.spec.run_id)
        busy = self.busy()
        for log, proc in self.trainers():
            if proc.poll() is not None:
                return False
            if kind != "kill_worker" and (busy is None or log != busy[0]):
                continue
            since = max([psutil.Process(proc.pid).create_time()] + [
                x["ts"] for x in logs if x["file"] == log and x["event"] == "child_started"])
            if not any(x["file"] == log and x["event"] == "standby_ready" and x["ts"] > since
                       for x in logs):
                return False
        return True

    def ready(self, kind: str, lost_worker_in: set, after_step: int) -> dict | None:
        at = newest_progress(self.spec)
        if at is None or time.time() - at["ts"] > 1.0 or at["since_start"] < MIN_STEPS_IN:
            return None
        lo, hi = at["segment"]
        if at["step"] < after_step or at["step"] > hi - self.spec.train.checkpoint_every - 5:
            return None
        if kind == "kill_worker" and (lo, hi) in lost_worker_in:
            return None
        return at

    def strike_all(self, done: threading.Event) -> None:
        from benchmarks.harness import load_1m, log

        kinds = [KINDS[i % len(KINDS)] for i in range(self.cfg["repeats"] * len(KINDS))]
        lost_worker_in: set = set()
        after_step = 0
        for kind in kinds:
            waiting_since = None
            while not done.is_set():
                time.sleep(0.25)
                at = self.ready(kind, lost_worker_in, after_step)
                if at is None:
                    continue
                waiting_since = waiting_since or time.monotonic()
                standby = self.standbys_ready(kind)
                if not standby and time.monotonic() - waiting_since < self.cfg["standby_wait_s"]:
                    continue
                record = self.chaos.apply(kind)
                if "skipped" not in record:
                    break
            if done.is_set():
                return
            record.update(segment=list(at["segment"]), step=at["step"], load_1m=load_1m(),
                          standby_ready=standby)
            self.strikes.append(record)
            if kind == "kill_worker":
                lost_worker_in.add(at["segment"])
            first = self.wait_recovered(record, done)
            if first is None:
                log.warning("not_recovered", kind=kind, ts=record["ts"])
                return
            after_step = first + self.cfg["settle_steps"]

    def wait_recovered(self, strike: dict, done: threading.Event) -> int | None:
        """Until a launch after the strike has run a step and the durable log holds a
        `recovered` event after the strike; the step that first step had."""
        from benchmarks.harness import log, progress_lines

        deadline = time.monotonic() + 300
        first = None
        while first is None and time.monotonic() < deadline and not done.is_set():
            time.sleep(0.5)
            lines = progress_lines(self.spec)
            start = next((s for s in lines if s["type"] == "start" and s["ts"] > strike["ts"]),
                         None)
            first = next((s for s in lines if start and s["type"] == "step"
                          and s["ts"] > start["ts"]), None)
        while first is not None and time.monotonic() < deadline:
            seen = read_events(self.spec.storage.durable, self.spec.run_id,
                               kinds=("recovered",))
            if any(e["ts"] >= strike["ts"] for e in seen):
                log.info("recovered", kind=strike["kind"], first_step=first["step"],
                         mttr_s=round(first["ts"] - strike["ts"], 2))
                return first["step"]
            time.sleep(1.0)
        return None


async def abort(address: str, run_id: str) -> None:
    from activities.contracts import Abort
    from ops.client import connect

    client = await connect(address)
    await client.get_workflow_handle(run_id).signal(
        "abort", Abort(who="benchmarks/recovery.py", note="every strike done").to_dict())


def run_bench(cfg: dict) -> dict:
    from benchmarks.harness import Services, bench_spec, load_1m, log, progress_lines, run_workflow

    services = Services(s3=True, trainers=2).start()
    try:
        seg = cfg["segment_steps"]
        spec = bench_spec(f"recovery-{int(time.time())}", services, **{
            "train.total_steps": seg * (cfg["repeats"] + 3), "train.segment_steps": seg,
            "train.segments_per_run": cfg["repeats"] + 3,
            "train.checkpoint_every": cfg["checkpoint_every"],
            "train.procs_per_node": cfg["world_size"],
            "train.micro_batch_tokens": cfg["micro_batch_tokens"],
            "ops.heartbeat_timeout_s": cfg["heartbeat_timeout_s"],
            "ops.hang_timeout_s": "auto", "ops.hang_floor_s": cfg["hang_floor_s"],
            # a bounded window of commits, as a real run keeps: listings stay short
            "storage.keep_last": 5})
        bench = Bench(services, spec, cfg)
        bench.loads.append(load_1m())
        done, box = threading.Event(), {}

        def run() -> None:
            try:
                box["result"] = asyncio.run(run_workflow(services.temporal.address, spec, 7200))
            except Exception as exc:  # noqa: BLE001 - the abort ends it as a failure
                box["error"] = repr(exc)[:300]
            finally:
                done.set()
        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        bench.strike_all(done)
        bench.loads.append(load_1m())
        aborted = not done.is_set()
        if aborted:
            asyncio.run(abort(services.temporal.address, spec.run_id))
        runner.join(600)
        time.sleep(5.0)  # the last spans leave the exporters (every 2 s)
        logs = [os.path.join(f.log_dir, "worker-trainer.log") for f in services.trainer_fleets()]
        log.info("reading_the_record", run_id=spec.run_id)
        model = {k: v for k, v in spec.to_dict()["model"].items()
                 if k in ("d_model", "n_layers", "n_heads", "seq_len")}
        return {"inputs": {**cfg, "total_steps": spec.train.total_steps, "model": model,
                           "tokens_per_step": cfg["micro_batch_tokens"] * cfg["world_size"],
                           "trainer_workers": 2, "cpus": os.cpu_count()},
                "strikes": bench.strikes, "loads": bench.loads,
                "events": read_events(spec.storage.durable, spec.run_id),
                "spans": read_spans(spec.storage.durable, spec.run_id),
                "lines": progress_lines(spec),
                "logs": parse_logs([p for p in logs if os.path.exists(p)], spec.run_id),
                "worker_restarts": sum(sum(f.restarts.values())
                                       for f in services.trainer_fleets()),
                "result": box.get("result", {}).get("status") if box.get("result") else None,
                "error": box.get("error"), "aborted": aborted}
    finally:
        services.stop()
        services.remove()


def code_version() -> dict:
    """The commit measured, and how many files differ from it (a shared working tree)."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[1],
                                  capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "changed_files": len(git("status", "--porcelain").splitlines())}


def settings(args: argparse.Namespace) -> dict:
    return {"repeats": 3 if args.quick and not args.repeats else args.repeats or 5,
            "heartbeat_timeout_s": args.heartbeat_timeout_s, "hang_floor_s": args.hang_floor_s,
            "hang_timeout_s": "auto", "segment_steps": args.segment_steps,
            "checkpoint_every": args.checkpoint_every, "settle_steps": args.settle_steps,
            "standby_wait_s": args.standby_wait_s, "world_size": 2,
            "micro_batch_tokens": MICRO_BATCH_TOKENS, "code": code_version()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 faults of each kind")
    p.add_argument("--repeats", type=int, default=0, help="faults of each kind (default 5)")
    p.add_argument("--heartbeat-timeout-s", type=float, default=5.0)
    p.add_argument("--hang-floor-s", type=float, default=2.0,
                   help="ops.hang_floor_s (the auto hang timeout's floor)")
    p.add_argument("--segment-steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--settle-steps", type=int, default=20,
                   help="steps after a recovery before the next strike")
    p.add_argument("--standby-wait-s", type=float, default=60.0,
                   help="at most this long waiting for the warm standby before a strike")
    p.add_argument("--save-raw", default="", help="also write what the run left to this file")
    p.add_argument("--from-raw", default="", help="report on a saved run instead of running")
    args = p.parse_args(argv)
    from benchmarks.harness import raw_run, rounded

    raw = raw_run(args, lambda: run_bench(settings(args)))

    print(json.dumps(rounded(report(raw))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
