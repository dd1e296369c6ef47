"""Recovery time per fault kind, with every second of it accounted for.

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
Targets: worker kill <= T + 3 s (T the heartbeat timeout); rank kill <= 6 s;
hang <= its detection timeout (the fault event's timeout_s) + 3 s; `met` compares the p50.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.recovery_marks import KINDS, report
from ops.chaos import Chaos, process_tree, rank_pids
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from storage.spans import read_spans

MIN_STEPS_IN = 5  # a strike waits until the launch has run this many steps
MICRO_BATCH_TOKENS = 2048  # per rank: ~0.15 s steps at world size 2 on 2 cores
LOG_EVENTS = ("child_started", "standby_ready", "standby_failed", "standby_not_ready",
              "standby_not_matching", "workers_started")


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
    from common.commands import Abort
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
