"""Goodput and recovery under faults: a soak run through the real workflow with a fault
every `--every` seconds and no human in the loop.

    .venv/bin/python benchmarks/goodput.py [--quick] [--every|--fault-every 45] [--steps N]
        [--world 2]
        [--outage-s 15] [--server-down-s 20] [--kinds kill_worker,drain_worker,...]
        [--save-raw FILE | --from-raw FILE]

The run: a TrainingRun (sweep off) on a private Temporal dev server, a restarting worker
fleet and a SeaweedFS S3 durable tier (CPU priority 19), world size 2 under torchrun, four
segments with continue-as-new after two, 2048 tokens a micro-batch (16 sequences: enough
for a reliable gap between the full and the halved micro-batch under the memory limit
below). Hang detection is the supervisor's automatic timeout (ops.hang_timeout_s "auto":
max(hang_floor_s, 10 x p99 step time)) with a 30 s floor; the start-up timeout is a fixed
120 s (a CPU trainer starts in 10-15 s; "auto" would allow 600 s). Faults:
- from outside, on a timer (ops/chaos.py), rotating through `--kinds` (default: all):
  worker SIGKILL, worker drain (SIGTERM: the segment commits and fails over at once), rank
  SIGKILL, hang (SIGSTOP a rank; the hang timeout fires), corrupt checkpoint (a byte
  flipped in the newest committed checkpoint on both tiers, then the ranks crash so resume
  must read it), S3 outage (SeaweedFS stopped for `--outage-s`), Temporal server restart
  (stopped, started again `--server-down-s` later on the same database; the trainer trains
  on, and with the 5 s heartbeat timeout the server times the attempt out when it is back:
  the old attempt commits its current step, the retry resumes there). A fault fires
  `--every` s after the previous one, once training has run `--min-train-s` since it
  recovered, and not around the memory limit's step, so each fault is measured on its own.
- from inside, at steps (RunSpec faults, trainer/faults.py): corrupted batches (a sustained
  spike -> rollback + skip window), a NaN loss, an LR burst, and an out-of-memory: a real
  RLIMIT_DATA from the last segment's first step on, OOM_MB above what each rank holds
  then (calibrated: the full micro-batch fails within tens of steps, the halved one fits
  for hundreds), so the workflow halves the micro-batch (`oom_adapted`, same global batch)
  and the run goes on.

Figures (one JSON line; definitions in ops/goodput.py): `value` = goodput = productive step
time (the final trajectory's applied updates) ÷ the train stage's wall time, at
`faults_per_min`; `time_budget` itemises that wall time; per fault (the OOM included) its
recovery (fault -> end of the first step after the restart), lost steps (last step reached -
step resumed from) and the real faults the run recorded for it (`recorded`: kinds from the
event log, e.g. a drain is `preempted`, a server restart `server_unavailable`), summarised
per kind against its detection timeout + 10 s (DESIGN §8: worker SIGKILL <= T + 10 s, T the
heartbeat timeout; the hang's own timeout from its fault event, with how long its detection
took; the outage + T for a server restart; 0 for what the supervisor sees at once);
`oom_adapted` (the micro-batch and accumulation before and after); `projected_goodput` at
one fault per 10 min / hour with this run's cost per fault; spike faults and how they were
handled; `human_actions` (operator / needs_attention events) and `unexplained_restarts`
(restarts no injected fault caused), both expected 0.

The same run measured a second way, from its durable record alone (the event log and the
trainer's spans, ops/goodput.from_record, as `mainspring report` shows it): `record_goodput`
(the train stage's), `record_vs_external_pp` (record - `value`, percentage points),
`record_badput_s` (the record's badput table, whole run), `record_faults` (real faults per
kind with MTTR), `record_steps`; the two should agree within a point or two.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (
    Services,
    bench_spec,
    checkpoint_pauses,
    load_1m,
    progress_lines,
    raw_run,
    rounded,
    run_workflow,
    stage_window,
)
from ops.chaos import CHAOS_KINDS, SERVER_DOWN_S, Chaos
from ops.goodput import (
    downtime,
    fault_outcome,
    from_record,
    human_actions,
    longest_gap,
    projected_goodput,
    spike_outcomes,
    summarize_recoveries,
    time_budget,
    went_back,
)
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from storage.spans import read_spans

log = structlog.get_logger(__name__)

HEARTBEAT_S = 5.0  # heartbeats from a thread of their own, sent every second
HANG_FLOOR_S, STARTUP_S = 30.0, 120.0  # ops.hang_floor_s (hang_timeout_s "auto"), fixed start-up
# 16 sequences of 128 tokens per rank, and the memory limit's headroom, calibrated on the
# real trainer (W=2, CPU, SeaweedFS, the limit at a segment's first step, each rank holding
# ~495 MiB then; 2026-12-01). A rank's data segment keeps growing while it trains (~+100 MiB
# over 200 steps at 1024 or 2048 tokens, RSS too; not in a bare GPT + AdamW loop), so no
# headroom fits the halved micro-batch for ever and fails the full one at once: with
# M = 100 MiB 16 sequences failed at their 2nd step and 8 at their 110th; with 130, 16
# failed at their 44th and 8 ran the 175 left; with 160, 16 failed at their 176th.
# (Without S3 and over 10 steps: 16 failed at 95 and fitted at 120, 8 fitted at 70.)
MICRO_BATCH_TOKENS, OOM_MB = 2048, 130
OOM_WAIT_STEPS = 150  # no chaos this long past the limit's step while its OOM is due
# (kind, fraction of the run, steps, LR factor), off the checkpoint grid like benchmarks/spikes.py
SPIKES = [("corrupt_batches", 0.30, 4, 1.0), ("nan_loss", 0.50, 1, 1.0),
          ("lr_burst", 0.70, 2, 100.0)]


def spike_faults(total: int) -> list[dict]:
    out = []
    for kind, frac, steps, factor in SPIKES:
        fault = {"kind": kind, "at_step": int(frac * total) + 3, "steps": steps}
        out.append({**fault, "factor": factor} if kind == "lr_burst" else fault)
    return out


def memory_limit_step(total: int, segment_steps: int) -> int:
    """The last segment's first step (past the spikes: no rollback restores under the limit).
    A fresh trainer applies the limit there, before a step has run: the step's allocations
    must grow its data segment, where a rank mid-segment would reuse what its heap kept."""
    return (total // segment_steps - 1) * segment_steps + 1


def inside_faults(total: int, segment_steps: int) -> list[dict]:
    return spike_faults(total) + [{"kind": "memory_limit", "mb": OOM_MB,
                                   "at_step": memory_limit_step(total, segment_steps)}]


# kinds whose recovery restarts the trainer; the soak waits for that before the next fault
RESTARTING = ("kill_worker", "drain_worker", "kill_rank", "hang", "corrupt_checkpoint")
# a server restart outlasting the heartbeat timeout restarts it too, once the server is back
RESTART_AFTER = {"server_restart": 60.0}  # seconds after restarted_ts to wait for it


def settled(last: dict, lines: list[dict], now: float, every_s: float,
            min_train_s: float) -> bool:
    """Whether the previous fault is over: recovered (restarted, for the kinds that restart),
    `every_s` after it and `min_train_s` of training since its recovery."""
    o = fault_outcome(last["ts"], lines)
    if not o["recovered"]:
        return False
    if not o["restarted"]:
        if last["kind"] in RESTARTING and now - last["ts"] < 300:  # else: none came after all
            return False
        if last["kind"] in RESTART_AFTER and now < last["restarted_ts"] + RESTART_AFTER[
                last["kind"]]:
            return False
    return now >= max(last["ts"] + every_s, o["first_step_ts"] + min_train_s)


def soak(chaos: Chaos, spec, kinds: list[str], cfg: dict, done: threading.Event) -> None:
    """Inject `kinds` in rotation (module doc: when), while a trainer is stepping, until the
    run is within a few checkpoint intervals of its end. None from two checkpoint intervals
    before the memory limit's step until its OOM was adapted to (or OOM_WAIT_STEPS past it):
    the OOM is then the previous fault, measured alone like the others."""
    margin = 3 * spec.train.checkpoint_every
    limit_at = memory_limit_step(spec.train.total_steps, spec.train.segment_steps)
    quiet = (limit_at - 2 * spec.train.checkpoint_every, limit_at + OOM_WAIT_STEPS)
    seconds = {"s3_outage": cfg["outage_s"], "server_restart": cfg["server_down_s"]}
    last, i, oom_seen, poll_at = None, 0, False, 0.0
    while not done.is_set():
        time.sleep(0.5)
        lines = progress_lines(spec)
        steps = [s for s in lines if s["type"] == "step"]
        if steps and steps[-1]["step"] >= spec.train.total_steps - margin:
            return
        now = time.time()
        if not steps or now - steps[-1]["ts"] > 2:
            continue
        if not oom_seen and quiet[0] <= steps[-1]["step"] < quiet[1]:
            if now >= poll_at:
                poll_at, adapted = now + 5.0, oom_adapted_event(spec)
                if adapted is not None:
                    oom_seen, last = True, {"kind": "oom", "ts": adapted["ts"]}
            continue
        if last is not None and not settled(last, lines, now, cfg["every_s"],
                                            cfg["min_train_s"]):
            continue
        if last is None and now < steps[0]["ts"] + cfg["every_s"]:
            continue
        kind = kinds[i % len(kinds)]
        record = chaos.apply(kind, **({"seconds": seconds[kind]} if kind in seconds else {}))
        if "skipped" not in record:
            last, i = record, i + 1


def oom_adapted_event(spec) -> dict | None:
    """The run's first `oom_adapted` event, if there is one yet (None while unreadable)."""
    try:
        found = read_events(spec.storage.durable, spec.run_id, kinds=("oom_adapted",))
    except Exception as exc:  # noqa: BLE001 - the soak asks again; it must not stop here
        log.warning("events_not_read", run_id=spec.run_id, error=repr(exc)[:200])
        return None
    return found[0] if found else None


def injected(chaos_log: list[dict], events: list[dict]) -> list[dict]:
    """The faults the soak caused, in time order: the chaos log's, and each out-of-memory the
    memory limit caused (its real `fault` event: when the rank failed)."""
    ooms = [{"kind": "oom", "ts": e["payload"].get("fault_ts") or e["ts"], "step": e["step"]}
            for e in events if e["kind"] == "fault" and e["payload"].get("kind") == "oom"]
    return sorted([f for f in chaos_log if "skipped" not in f] + ooms, key=lambda f: f["ts"])


def real_faults(events: list[dict], t0: float, t1: float) -> list[dict]:
    return [e for e in events if e["kind"] == "fault" and not e["payload"].get("injected")
            and t0 <= e["ts"] < t1]


def outcomes(faults: list[dict], lines: list[dict], events: list[dict],
             end_ts: float) -> list[dict]:
    """Each injected fault's recovery, up to the next fault (ops/goodput.fault_outcome), and
    the real faults the run recorded meanwhile."""
    out = []
    for f, nxt in zip(faults, [g["ts"] for g in faults[1:]] + [end_ts]):
        o = {"kind": f["kind"], "ts": f["ts"], **fault_outcome(f["ts"], lines, until_ts=nxt)}
        recorded = real_faults(events, f["ts"], nxt)
        o["recorded"] = [e["payload"]["kind"] for e in recorded]
        if f["kind"] in ("s3_outage", "server_restart"):  # trained through: how long a stall?
            o["longest_step_gap_s"], o["stall_ends_ts"] = stall(lines, f["ts"], min(
                nxt, f["restarted_ts"] + 60))
        if f["kind"] == "corrupt_checkpoint":
            o["corrupted"] = f["corrupted"]
        if f["kind"] == "hang":
            o.update(hang_detection(f, recorded))
        if f["kind"] == "oom":
            o.update(rescheduled(f["ts"], o, lines, nxt))
        o.pop("first_step_ts", None)
        out.append({k: round(v, 2) if isinstance(v, float) else v for k, v in o.items()})
    return out


def stall(lines: list[dict], t0: float, t1: float) -> tuple[float, float]:
    """The longest time without a finished step in [t0, t1] and when it ended."""
    gap = longest_gap(lines, t0, t1)
    ends = [s["ts"] for s in lines if s["type"] == "step" and t0 < s["ts"] < t1] + [t1]
    before = [t0] + ends[:-1]
    return gap, next((b for a, b in zip(before, ends) if b - a >= gap), t1)


def hang_detection(fault: dict, recorded: list[dict]) -> dict:
    """The hang's timeout as its fault event states it (auto: from the measured step time)
    and how long after the SIGSTOP the supervisor called it a hang."""
    hung = next((e["payload"] for e in recorded if e["payload"]["kind"] == "hang"), None)
    if hung is None:
        return {"hang_timeout_s": None}
    return {"hang_timeout_s": hung.get("timeout_s"), "hang_timeout_auto": hung.get("auto"),
            "hang_timeout_how": hung.get("timeout_how"),
            "hang_detected_after_s": hung["detected_ts"] - fault["ts"]}


def rescheduled(ts: float, o: dict, lines: list[dict], until_ts: float) -> dict:
    """An OOM's restart: the workflow schedules the segment anew (attempt 1) from its newest
    commit, which fault_outcome (and the restart count) sees as a new segment when that is
    where training was; a trainer restart all the same, for the downtime and lost steps."""
    start = next((s for s in lines if s["type"] == "start" and ts < s["ts"] <= until_ts), None)
    if not o.get("recovered") or o["restarted"] or start is None:
        return {}
    resumed = start.get("resumed_from") or 0
    return {"restarted": True, "resumed_from": resumed,
            "lost_steps": max(0, o["last_step_before"] - resumed)}


def oom_adaptations(events: list[dict]) -> list[dict]:
    return [{"step": e["step"], **{k: e["payload"].get(k) for k in (
        "micro_batch", "grad_accum", "global_batch_sequences", "micro_split")}}
            for e in events if e["kind"] == "oom_adapted"]


def durable_catch_up(chaos_log: list[dict], events: list[dict]) -> list[float | None]:
    """Seconds from each S3 restart to the next durable commit."""
    out = []
    for f in (f for f in chaos_log if f["kind"] == "s3_outage"):
        nxt = [e["ts"] for e in events
               if e["kind"] == "checkpoint_committed" and e["ts"] > f["restarted_ts"]]
        out.append(round(min(nxt) - f["restarted_ts"], 2) if nxt else None)
    return out


def run_soak(cfg: dict) -> dict:
    """Services up, the run started, faults injected until it nears its end; what it left
    (with `error` when the run did not complete)."""
    services = Services(s3=True).start()
    loads = [load_1m()]
    try:
        steps = cfg["steps"]
        spec = bench_spec(f"goodput-{int(time.time())}", services, **{
            "train.total_steps": steps, "train.segment_steps": cfg["segment_steps"],
            "train.segments_per_run": 2, "train.checkpoint_every": cfg["checkpoint_every"],
            "train.procs_per_node": cfg["world_size"],
            "train.micro_batch_tokens": cfg["micro_batch_tokens"],
            "ops.heartbeat_timeout_s": HEARTBEAT_S, "ops.hang_timeout_s": "auto",
            "ops.hang_floor_s": HANG_FLOOR_S, "ops.startup_timeout_s": STARTUP_S,
            "faults": inside_faults(steps, cfg["segment_steps"])})
        chaos = Chaos(worker_pid=lambda: services.fleet.procs["trainer"].pid,
                      durable=CheckpointStore(spec.storage.durable, spec.run_id),
                      fast_root=os.path.join(spec.storage.fast, spec.run_id),
                      s3_down=services.seaweed.stop, s3_up=services.restart_s3,
                      temporal_restart=services.temporal.restart)
        done, box = threading.Event(), {}

        def run() -> None:
            try:
                box["result"] = asyncio.run(run_workflow(services.temporal.address, spec, 7200))
            except Exception as exc:  # noqa: BLE001 - reported below; the soak must stop
                box["error"] = repr(exc)
            finally:
                done.set()
        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        soak(chaos, spec, cfg["kinds"], cfg, done)
        loads.append(load_1m())
        runner.join()
        loads.append(load_1m())
        inputs = {**cfg, "inside_faults": spec.to_dict()["faults"],
                  "tokens_per_step": spec.train.micro_batch_tokens * spec.train.world_size,
                  "model": {k: v for k, v in spec.to_dict()["model"].items()
                            if k in ("d_model", "n_layers", "n_heads", "seq_len")},
                  "cpus": os.cpu_count()}
        return {"inputs": inputs, "result": box.get("result"), "error": box.get("error"),
                "chaos": chaos.log, "loads": loads,
                "events": read_events(spec.storage.durable, spec.run_id),
                "spans": read_spans(spec.storage.durable, spec.run_id),
                "lines": progress_lines(spec), "worker_restarts": dict(services.fleet.restarts)}
    finally:
        services.stop()
        services.remove()


def segment_startups(events: list[dict], lines: list[dict], faults: list[dict]) -> float:
    """Seconds from each segment's first dispatch (segment_started, attempt 1) to the end of
    its first step: the cost of cutting the run into segments, faults aside (a start inside
    a restarted fault's recovery is that fault's downtime already; one whose trainer failed
    before its first step counts up to the fault, the rest is the fault's)."""
    down = [(f["ts"], f["ts"] + f["recovery_s"]) for f in faults if f.get("restarted")]
    # a trained-through fault's stall (counted as outage_stall_s) may hold a segment's start
    down += [(f["stall_ends_ts"] - f["longest_step_gap_s"], f["stall_ends_ts"])
             for f in faults if not f.get("restarted") and "stall_ends_ts" in f]
    started = sorted(e["ts"] for e in events if e["kind"] == "segment_started")
    total = 0.0
    for e in (e for e in events if e["kind"] == "segment_started" and e["payload"]["attempt"] == 1
              and not any(a <= e["ts"] <= b for a, b in down)):
        first = next((s for s in lines if s["type"] == "step" and s["ts"] > e["ts"]), None)
        cut = [t for t in started if t > e["ts"]] + [a for a, _ in down if a > e["ts"]]
        end = min([first["ts"]] + cut) if first else e["ts"]
        total += end - e["ts"]
    return total


def breakdown(budget: dict, faults: list[dict], lines: list[dict], startup_s: float) -> dict:
    """The train stage's wall time, itemised (fault downtime ends at the first new step)."""
    parts = {"productive_s": budget["productive_s"], "replayed_s": budget["replayed_s"],
             "skipped_s": budget["skipped_s"], "checkpoint_pause_s": budget["checkpoint_pause_s"],
             "fault_downtime_s": sum(downtime(f["ts"], f["recovery_s"], lines)
                                     for f in faults if f.get("restarted")),
             # S3 outages, and a server restart that restarted nothing: trained through
             "outage_stall_s": sum(f.get("longest_step_gap_s", 0.0) for f in faults
                                   if not f.get("restarted")),
             "segment_startup_s": startup_s}
    return {"wall_s": budget["wall_s"], **parts, "rest_s": budget["wall_s"] - sum(parts.values())}


def detection_timeouts(cfg: dict, faults: list[dict]) -> dict[str, float]:
    """Each kind's detection timeout (summarize_recoveries adds 10 s): the heartbeat timeout
    for a lost worker, the hang's own (the largest its fault events state), the outage plus
    the heartbeat timeout for a server restart, 0 for what the supervisor sees at once."""
    hangs = [f["hang_timeout_s"] for f in faults if f.get("hang_timeout_s") is not None]
    t = cfg["heartbeat_timeout_s"]
    return {"kill_worker": t, "hang": max(hangs) if hangs else cfg.get("hang_floor_s", 30.0),
            "server_restart": cfg.get("server_down_s", 20.0) + t, "drain_worker": 0.0,
            "kill_rank": 0.0, "corrupt_checkpoint": 0.0, "oom": 0.0}


def report(raw: dict) -> dict:
    events, lines = raw["events"], raw["lines"]
    start, end = stage_window(events, "train")
    pauses = checkpoint_pauses(events)
    budget = time_budget([s for s in lines if s["type"] == "step"], end - start, pauses)
    faults = outcomes(injected(raw["chaos"], events), lines, events, end)
    cfg = raw["inputs"]
    spikes = spike_outcomes(events)
    kinds_seen = [e["kind"] for e in events]
    restarts = sum(s["type"] == "start" and (s.get("attempt", 1) > 1 or went_back(s, lines))
                   for s in lines)  # what fault_outcome counts as a restart
    return {
        "figure": "goodput_under_faults", "value": round(budget["goodput"], 4), "target": 0.95,
        "status": raw["result"]["status"], "human_actions": human_actions(events),
        "faults_per_min": round((len(faults) + len(spikes)) / (budget["wall_s"] / 60), 2),
        "time_budget": rounded(breakdown(budget, faults, lines,
                                         segment_startups(events, lines, faults))),
        "steps": {k: budget[k] for k in ("steps_executed", "steps_kept", "steps_replayed")},
        "recovery": rounded(summarize_recoveries([f for f in faults if f["kind"] != "s3_outage"],
                                                 detection_timeouts(cfg, faults))),
        "projected_goodput": rounded(projected_goodput(budget, faults, len(faults) + len(spikes),
                                                       (600.0, 3600.0))),
        "faults": [{k: v for k, v in f.items() if k not in ("ts", "stall_ends_ts")}
                   for f in faults],
        "oom_adapted": oom_adaptations(events),
        "s3_durable_catch_up_s": durable_catch_up(raw["chaos"], events),
        "spikes": spikes,
        "events": {k: kinds_seen.count(k) for k in ("fault", "recovered", "checkpoint_corrupt",
                                                      "rollback", "batch_skipped", "lr_adjusted",
                                                      "oom_adapted", "segment_started",
                                                      "checkpoint_committed")},
        "mttr_s_events": [e["payload"]["mttr_s"] for e in events if e["kind"] == "recovered"],
        "worker_restarts": raw["worker_restarts"],
        # trainer starts beyond one per segment that no injected fault explains (a false
        # hang detection, a heartbeat timeout under load, a crash): should be 0
        "unexplained_restarts": restarts - sum(f.get("attempts", 0) for f in faults),
        "load_avg_1m": raw["loads"], **record_figures(raw, budget["goodput"])}


def record_figures(raw: dict, external: float | None) -> dict:
    """Goodput from the durable record (events + spans) next to the external figure. A raw
    file saved before spans were kept has none: the record figures are then None."""
    rec = from_record(raw["events"], raw.get("spans") or [])
    ok = bool(raw.get("spans")) and rec["train"]["goodput"] is not None
    value = round(rec["train"]["goodput"], 4) if ok else None
    return {"record_goodput": value,
            "record_vs_external_pp": (round(100 * (value - external), 2)
                                      if ok and external is not None else None),
            "record_badput_s": rounded(rec["badput_s"]) if ok else None,
            "record_faults": rounded(rec["faults"]) if ok else None,
            "record_injected_faults": rec["injected_faults"],
            "record_steps": rec["steps"] if ok else None}


def settings(args: argparse.Namespace) -> dict:
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(CHAOS_KINDS)
    if unknown:
        raise SystemExit(f"unknown --kinds {sorted(unknown)}; use {','.join(CHAOS_KINDS)}")
    steps = args.steps or (1200 if args.quick else 2400)
    return {"steps": steps, "segment_steps": args.segment_steps or steps // 4,
            "checkpoint_every": args.checkpoint_every, "world_size": args.world,
            "micro_batch_tokens": MICRO_BATCH_TOKENS,
            "every_s": args.every or (30.0 if args.quick else 45.0), "min_train_s": args.min_train_s,
            "outage_s": args.outage_s, "server_down_s": args.server_down_s, "kinds": kinds,
            "heartbeat_timeout_s": HEARTBEAT_S, "hang_timeout_s": "auto",
            "hang_floor_s": HANG_FLOOR_S, "startup_timeout_s": STARTUP_S}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="1200 steps and a fault every 30 s (about 10 minutes)")
    p.add_argument("--every", "--fault-every", type=float, default=0.0,
                   help="seconds between faults (default 45; quick 30)")
    p.add_argument("--min-train-s", type=float, default=10.0,
                   help="training seconds after a recovery before the next fault")
    p.add_argument("--steps", type=int, default=0, help="total steps (default 2400; quick 1200)")
    p.add_argument("--segment-steps", type=int, default=0, help="default: steps / 4")
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--outage-s", type=float, default=15.0)
    p.add_argument("--server-down-s", type=float, default=SERVER_DOWN_S,
                   help="seconds the Temporal server stays down in a server_restart")
    p.add_argument("--kinds", default=",".join(CHAOS_KINDS))
    p.add_argument("--save-raw", default="", help="also write the run's events, spans, "
                   "progress lines and fault log to this JSON file (for --from-raw)")
    p.add_argument("--from-raw", default="", help="report on a saved run instead of running")
    args = p.parse_args(argv)
    raw = raw_run(args, lambda: run_soak(settings(args)))
    if raw.get("error") or raw.get("result") is None:
        raise SystemExit(f"the run did not complete: {raw.get('error')}")
    print(json.dumps({**report(raw), "inputs": raw["inputs"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
