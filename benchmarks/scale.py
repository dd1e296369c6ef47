"""The orchestrator at scale, on the real services: N simulated nodes under one TrainingRun
for simulated days, faults at Llama 3's rate, and what it costs.

    .venv/bin/python benchmarks/scale.py [--quick] [--nodes 16,64] [--days 1] [--compress 72]
        [--step-s 15] [--fault-boost 0 (auto)] [--want-faults 6] [--timeout-s 3000]
        [--plots DIR] [--save-raw FILE]

Real: the Temporal dev server, SeaweedFS S3 as the durable tier (CPU priority 19), an
orchestrator and a data worker (`mainspring worker`), the TrainingRun workflow with
`train.nodes` = N (workflows/gang.py: one train_segment per node on its queue, all or
nothing), the node registry, the train_segment activity with everything it does. Simulated:
the trainer child only (benchmarks/scale_nodes.py: the seam, the progress protocol, real
checkpoint commits with tiny payloads), N nodes plus spares hosted in one process.

Time is compressed (benchmarks/scale_plan.py): `--compress` simulated seconds per real one
for the step time (`--step-s` simulated, 15 s: a Llama 3 405B step, 16 M tokens at ~40 %
MFU on 16 K H100s) and for the gaps between faults; what the orchestrator takes (heartbeat
timeouts, relaunches) is real time. Faults: Llama 3's 419 interruptions in 54 days on 2,048
nodes, scaled to N, times `--fault-boost` (auto: enough for `--want-faults` a run; the JSON
says which), kinds in rotation: node_lost, rank_lost, hang, server_restart. A node lost
stays lost (spares take its place). Once the train stage has run its simulated days the
run is aborted: the evaluation after it needs real weights.

Figures, one JSON line (per node count, with the inputs): recovery per fault (strike ->
the workflow's next train_segment scheduled, -> the replacement launch's first step; p50,
p99); host CPU and RSS per node, heartbeat and activity-task rates; the orchestrator
worker's and the Temporal server's CPU; history events per simulated day, continue-as-new
cadence and the largest history against Temporal's limits (also the node registry's);
event-log and span lines and bytes per simulated day; goodput from the record
(ops/goodput.py from_record) against the simulation's ground truth (rank 0's step
executions, the harness's own clock). `machine` says how many nodes one such machine hosts
at the measured per-node cost, and what binds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

from benchmarks.harness import BASE, load_1m, log, nice_tree, rounded
from benchmarks.scale_plan import (
    DAY_S,
    FAULT_KINDS,
    Compression,
    draw_strikes,
    even_strikes,
    fault_boost,
    faults_per_node_day,
    history_figures,
    machine_limit,
    per_day,
    per_node_cost,
    recovery_marks,
    spares_for,
    spread,
    truth_goodput,
)

ROOT = Path(__file__).resolve().parents[1]
HOST_READY_S = 120.0
# what says the orchestrator or the registry is past its limit, counted in the logs
SIGNS = {"deadlock": "Potential deadlock detected",
         "slow_workflow_task": "Workflow task duration exceeded",
         "signal_limit": "exceeded workflow execution limit for signal events",
         "announce_failed": "node_announce_failed",
         "query_failed": "Unable to query workflow"}


@dataclass(frozen=True, kw_only=True)
class Shape:
    """One node count's run."""

    nodes: int
    days: float = 1.0
    compress: float = 72.0  # a simulated day in 20 minutes
    step_s: float = 15.0  # simulated seconds a step
    segment_steps: int = 240  # an hour of steps
    segments_per_run: int = 4  # continue-as-new cadence (train.segments_per_run)
    checkpoint_every: int = 40  # ten minutes of steps
    heartbeat_timeout_s: float = 10.0  # real
    # real; twice the heartbeat timeout, as the defaults are (30 s, 60 s): a lost node is
    # the heartbeat timeout's to see, not its stalled peers' hang watches
    hang_floor_s: float = 20.0
    startup_s: float = 0.5  # real: a launch's start-up before its first step
    fault_boost: float = 0.0  # 0: auto
    want_faults: int = 6
    kinds: tuple[str, ...] = FAULT_KINDS
    settle_s: float = 30.0  # real: least gap between strikes
    even: bool = False  # `want_faults` strikes spread evenly instead of drawn (--quick)
    polls: int = 1
    seed: int = 0
    timeout_s: float = 3000.0

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes: must be >= 1, got {self.nodes}; pass e.g. --nodes 16,64")
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"kinds: unknown {sorted(unknown)}; use some of "
                             f"{', '.join(FAULT_KINDS)}")
        Compression(factor=self.compress)

    @property
    def comp(self) -> Compression:
        return Compression(factor=self.compress)

    @property
    def total_steps(self) -> int:
        return max(1, round(self.days * DAY_S / self.step_s))


# ---- the services -----------------------------------------------------------------------
class Services:
    """Temporal, SeaweedFS and the orchestrator + data workers, shared by the node counts."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="mainspring-scale-")
        self.temporal = self.seaweed = self.fleet = None

    def start(self) -> Services:
        from common.procs import WorkerFleet
        from ops.services import SeaweedS3, TemporalDevServer, free_port

        self.temporal = TemporalDevServer(os.path.join(self.root, "temporal"), port=free_port(),
                                          headless=True).start()
        self.seaweed = SeaweedS3(os.path.join(self.root, "weed")).start()
        nice_tree(self.seaweed.proc.pid)
        os.environ.update(self.seaweed.env())
        self.fleet = WorkerFleet(self.temporal.address, roles=("orchestrator", "data"),
                                 log_dir=os.path.join(self.root, "logs"), restart=True,
                                 env=self.seaweed.env()).start()
        return self

    @property
    def durable(self) -> str:
        return f"s3://{self.seaweed.bucket}/scale"

    def stop(self) -> None:
        for part in (self.fleet, self.seaweed, self.temporal):
            if part is not None:
                part.stop()
        if os.environ.get("MAINSPRING_BENCH_KEEP") == "1":  # a post-mortem: logs, truth
            print(f"kept: {self.root}", file=sys.stderr)
        else:
            shutil.rmtree(self.root, ignore_errors=True)


def cpu_s(pid: int) -> float:
    """A process's CPU seconds with its children's."""
    try:
        p = psutil.Process(pid)
        total = sum(p.cpu_times()[:2])
        for c in p.children(recursive=True):
            try:
                total += sum(c.cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass
        return total
    except psutil.NoSuchProcess:
        return math.nan


def rss(pid: int) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.NoSuchProcess:
        return 0


# ---- one node count -----------------------------------------------------------------------
class Count:
    """One node count's run: the node host, the run, the strikes, what they left."""

    def __init__(self, svc: Services, shape: Shape) -> None:
        self.svc, self.shape = svc, shape
        self.boost = fault_boost(shape.nodes, shape.days, shape.want_faults, shape.fault_boost)
        self.strikes = even_strikes(shape.want_faults, shape.comp.real_s(shape.days * DAY_S),
                                    shape.kinds, shape.settle_s) if shape.even else draw_strikes(
            shape.nodes, shape.days, shape.comp, self.boost, shape.kinds, shape.seed,
            shape.settle_s)
        self.spares = spares_for(self.strikes)
        self.names = [f"c{shape.nodes}-{i:04d}" for i in range(shape.nodes + self.spares)]
        self.root = os.path.join(svc.root, f"nodes-{shape.nodes}")
        self.run_id = f"scale-{shape.nodes}n-{int(time.time())}"
        self.host: subprocess.Popen | None = None
        self.marks: dict[str, float] = {}
        self.samples: dict[str, dict] = {}
        self.server_restarts: list[dict] = []
        self.orch_log = os.path.join(svc.root, "logs", "worker-orchestrator.log")
        self.orch_log_at = os.path.getsize(self.orch_log) if os.path.exists(self.orch_log) \
            else 0

    def start_host(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        step_real = self.shape.comp.real_s(self.shape.step_s)
        cmd = [sys.executable, "-m", "benchmarks.scale_nodes", "--address",
               self.svc.temporal.address, "--names", ",".join(self.names), "--root", self.root,
               "--step-s", f"{step_real:.6f}", "--startup-s", str(self.shape.startup_s),
               "--polls", str(self.shape.polls)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MAINSPRING_LOG_LEVEL": "warning"}
        with open(os.path.join(self.root, "host.log"), "ab") as out:
            self.host = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + HOST_READY_S
        while not os.path.exists(os.path.join(self.root, "ready")):
            if self.host.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the node host did not start: see {self.root}/host.log")
            time.sleep(0.5)

    def stop_host(self) -> None:
        if self.host is not None and self.host.poll() is None:
            os.killpg(self.host.pid, signal.SIGKILL)
            self.host.wait(30)

    def spec(self):
        from ops.client import localize
        from spec import preset

        s = self.shape
        return localize(preset("demo", **{
            **BASE, "run_id": self.run_id, "storage.durable": self.svc.durable,
            "storage.fast": os.path.join(self.root, "fast"),
            "train.total_steps": s.total_steps, "train.segment_steps": s.segment_steps,
            "train.segments_per_run": s.segments_per_run,
            "train.checkpoint_every": s.checkpoint_every, "train.nodes": s.nodes,
            "train.procs_per_node": 1, "ops.heartbeat_timeout_s": s.heartbeat_timeout_s,
            "ops.hang_timeout_s": "auto", "ops.hang_floor_s": s.hang_floor_s,
            "ops.node_wait_s": 60.0}))

    def sample(self, name: str) -> None:
        temporal, orch = self.svc.temporal.proc.pid, self.svc.fleet.procs["orchestrator"].pid
        self.samples[name] = {"ts": time.time(), "temporal_cpu_s": cpu_s(temporal),
                              "orchestrator_cpu_s": cpu_s(orch), "orchestrator_rss": rss(orch),
                              "host_cpu_s": cpu_s(self.host.pid), "host_rss": rss(self.host.pid),
                              "load_1m": load_1m()}

    async def wait_registered(self, client) -> None:
        from activities.contracts import NODE_REGISTRY_ID, NodeInfo

        deadline = time.monotonic() + HOST_READY_S
        want = set(self.names)
        while time.monotonic() < deadline:
            try:
                nodes = await client.get_workflow_handle(NODE_REGISTRY_ID).query(
                    "nodes", result_type=list[NodeInfo])
                if want <= {n.name for n in nodes}:
                    return
            except Exception as exc:  # noqa: BLE001 - not started yet: the first announcement
                log.info("registry_not_ready", error=str(exc)[:100])
            await asyncio.sleep(1.0)
        raise RuntimeError(f"not every node announced itself within {HOST_READY_S:.0f}s: see "
                           f"{self.root}/host.log")

    async def stage(self, client) -> str:
        try:
            return (await client.get_workflow_handle(self.run_id).query("status"))["stage"]
        except Exception as exc:  # noqa: BLE001 - a server restart: ask again
            log.info("status_unavailable", error=str(exc)[:100])
            return ""

    async def run(self) -> dict:
        from common.commands import Abort
        from ops.client import connect, start_run

        client = await connect(self.svc.temporal.address)
        await self.wait_registered(client)
        spec = self.spec()
        self.marks["start"] = time.time()
        await start_run(client, spec)
        deadline = time.monotonic() + self.shape.timeout_s
        while await self.stage(client) != "train" and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        self.marks["train"] = time.time()
        self.sample("train")
        pending = list(self.strikes)
        stage = "train"
        while time.monotonic() < deadline:
            elapsed = time.time() - self.marks["train"]
            while pending and pending[0].at_s <= elapsed:
                client = await self.strike(pending.pop(0), client)
            stage = await self.stage(client) or stage
            if stage not in ("train", "waiting_for_nodes", "needs_attention", ""):
                break
            await asyncio.sleep(1.0)
        self.marks["train_end"] = time.time()
        self.sample("train_end")
        self.marks["stage_at_end"] = stage
        self.marks["strikes_left"] = len(pending)
        handle = client.get_workflow_handle(self.run_id)
        try:
            await handle.signal("abort", Abort(who="benchmarks/scale.py",
                                               note="the simulated days are done").to_dict())
            await asyncio.wait_for(handle.result(), 120)
        except Exception as exc:  # noqa: BLE001 - the abort ends it as a failure
            log.info("run_ended", how=repr(exc)[:200])
        self.marks["end"] = time.time()
        await asyncio.sleep(4.0)  # the host's last truth flush (every 2 s), the last spans
        return {"history": await histories(client, self.run_id),
                "registry": await histories(client, "mainspring-nodes", since=self.marks["start"])}

    async def strike(self, strike, client):
        """One fault: a line for the node host, or the Temporal server restarted here."""
        if strike.kind != "server_restart":
            with open(os.path.join(self.root, "control.jsonl"), "a") as f:
                f.write(json.dumps({"kind": strike.kind, "node": "*", "at_s": strike.at_s})
                        + "\n")
            return client
        from ops.client import connect

        began = time.time()
        self.svc.temporal.restart()
        self.server_restarts.append({"kind": "server_restart", "applied_ts": began,
                                     "down_s": time.time() - began, "at_s": strike.at_s})
        log.warning("server_restarted", down_s=round(time.time() - began, 2))
        return await connect(self.svc.temporal.address)


async def histories(client, workflow_id: str, since: float = 0.0) -> list[dict]:
    """Each run of a workflow id (continue-as-new chain): its events, bytes and the times
    its train_segment activities were scheduled."""
    out = []
    async for wf in client.list_workflows(f'WorkflowId = "{workflow_id}"'):
        if wf.start_time.timestamp() < since - 60:
            continue
        hist = await client.get_workflow_handle(workflow_id, run_id=wf.run_id).fetch_history()
        scheduled = [e.event_time.ToNanoseconds() / 1e9 for e in hist.events
                     if e.HasField("activity_task_scheduled_event_attributes")
                     and e.activity_task_scheduled_event_attributes.activity_type.name
                     == "train_segment"]
        out.append({"run_id": wf.run_id, "events": len(hist.events),
                    "bytes": sum(e.ByteSize() for e in hist.events),
                    "scheduled": scheduled})
    return out


def log_signs(path: str, offset: int = 0) -> dict[str, int]:
    """How often each of SIGNS appears in a log after `offset` bytes."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return {}
    return {k: text.count(v) for k, v in SIGNS.items()}


def read_truth(root: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"step": [], "launch": [], "strike": []}
    path = os.path.join(root, "truth.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    out.setdefault(rec["type"], []).append(rec)
    return out


def read_stats(root: str) -> list[dict]:
    path = os.path.join(root, "stats.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def launch_first_steps(truth: dict) -> list[tuple[float, float]]:
    """(launch_ts, its first step's end) per launch that stepped."""
    first: dict[float, float] = {}
    for s in truth["step"]:
        first[s["launch_ts"]] = min(first.get(s["launch_ts"], math.inf), s["end"])
    return sorted(first.items())


def recoveries(strikes: list[dict], decisions: list[float],
               launches: list[tuple[float, float]]) -> list[dict]:
    """Each applied strike's recovery marks (benchmarks/scale_plan.py recovery_marks)."""
    strikes = sorted((s for s in strikes if s.get("applied", True)),
                     key=lambda s: s["applied_ts"])
    out = []
    for i, s in enumerate(strikes):
        until = strikes[i + 1]["applied_ts"] if i + 1 < len(strikes) else math.inf
        firsts = [f for lt, f in launches if lt > s["applied_ts"]]
        out.append({"kind": s["kind"], "node": s.get("node"), "at_s": s.get("at_s"),
                    **recovery_marks(s["applied_ts"], decisions, firsts, until)})
    return out


def figures(c: Count, raw: dict) -> dict:
    """Everything one node count measured."""
    from benchmarks.scale_record import record_size
    from ops.goodput import from_record
    from storage.events import read_events
    from storage.spans import read_spans

    shape, m = c.shape, c.marks
    truth = read_truth(c.root)
    stats = read_stats(c.root)
    t0, t1 = c.samples["train"], c.samples["train_end"]
    wall = t1["ts"] - t0["ts"]
    in_train = [s for s in stats if t0["ts"] <= s["ts"] <= t1["ts"]] or stats[-2:]
    first, last = in_train[0], in_train[-1]
    stat_wall = max(1e-9, last["ts"] - first["ts"])
    hosted = len(c.names)
    host_cost = per_node_cost(last["cpu_s"] - first["cpu_s"], max(s["rss"] for s in in_train),
                              stat_wall, hosted, shape.comp)
    run_wall = m["end"] - m["start"]
    sim_days = shape.comp.sim_s(run_wall) / DAY_S
    train_sim_days = shape.comp.sim_s(wall) / DAY_S
    decisions = sorted(t for r in raw["history"] for t in r["scheduled"])
    recs = recoveries(truth["strike"] + c.server_restarts, decisions, launch_first_steps(truth))
    by_kind = {k: {"decision_s": spread([r["decision_s"] for r in recs if r["kind"] == k
                                         and r["decision_s"] is not None]),
                   "first_step_s": spread([r["first_step_s"] for r in recs if r["kind"] == k
                                           and r["first_step_s"] is not None])}
               for k in sorted({r["kind"] for r in recs})}
    events, spans = read_events(c.svc.durable, c.run_id), read_spans(c.svc.durable, c.run_id)
    record = from_record(events, spans)
    true = truth_goodput(truth["step"], run_wall)
    size = record_size(c.svc.durable, c.run_id)
    orch_cpu = t1["orchestrator_cpu_s"] - t0["orchestrator_cpu_s"]
    beats = last["heartbeats"] - first["heartbeats"]
    acts = last["activities"] - first["activities"]
    rel = (abs(record["goodput"] - true["goodput"]) / true["goodput"]
           if record["goodput"] and true["goodput"] else None)
    return {
        "nodes": shape.nodes, "spares": c.spares, "hosted_nodes": hosted, "run_id": c.run_id,
        "inputs": {**asdict(shape), "total_steps": shape.total_steps,
                   "step_real_s": shape.comp.real_s(shape.step_s), "fault_boost": c.boost,
                   "faults_per_sim_day": faults_per_node_day() * shape.nodes * c.boost,
                   "strikes_planned": [asdict(s) for s in c.strikes]},
        "ended": {"stage_at_end": m["stage_at_end"], "strikes_left": m["strikes_left"],
                  "run_wall_s": run_wall, "train_wall_s": wall, "sim_days": sim_days,
                  "train_sim_days": train_sim_days, "steps_kept": true["steps_kept"],
                  "load_1m": [t0["load_1m"], t1["load_1m"]]},
        "signs": {"orchestrator": log_signs(c.orch_log, c.orch_log_at),
                  "node_host": log_signs(os.path.join(c.root, "host.log"))},
        "recovery": {"per_fault": recs, "by_kind": by_kind,
                     "all": {"decision_s": spread([r["decision_s"] for r in recs
                                                   if r["decision_s"] is not None]),
                             "first_step_s": spread([r["first_step_s"] for r in recs
                                                     if r["first_step_s"] is not None])}},
        "cost": {
            "host": {**host_cost, "threads": last["threads"], "pollers_per_node": shape.polls,
                     "heartbeat_calls_per_s": beats / stat_wall,
                     "heartbeat_calls_per_node_s": beats / stat_wall / hosted,
                     "activity_tasks_per_s": acts / stat_wall,
                     "activity_tasks_per_sim_day": per_day(acts, shape.comp.sim_s(stat_wall)
                                                           / DAY_S)},
            "orchestrator": {"cpu_cores": orch_cpu / wall,
                             "cpu_s_per_sim_hour": orch_cpu / (shape.comp.sim_s(wall) / 3600),
                             "cpu_cores_per_node": orch_cpu / wall / shape.nodes,
                             "rss_mb": t1["orchestrator_rss"] / 2**20},
            "temporal_server": {"cpu_cores": (t1["temporal_cpu_s"] - t0["temporal_cpu_s"])
                                / wall if not c.server_restarts else None,
                                "restarted": bool(c.server_restarts)}},
        "history": {"run": history_figures(raw["history"], sim_days),
                    "registry": history_figures(raw["registry"], sim_days)},
        "record": {p: {"objects": v["objects"], "lines": v["lines"], "bytes": v["bytes"],
                       "lines_per_sim_day": per_day(v["lines"], sim_days),
                       "bytes_per_sim_day": per_day(v["bytes"], sim_days)}
                   for p, v in size.items()},
        "goodput": {"from_record": record["goodput"], "ground_truth": true["goodput"],
                    "rel_error": rel, "within_1pct": None if rel is None else rel <= 0.01,
                    "record_wall_s": record["wall_s"], "truth_wall_s": run_wall,
                    "record_productive_s": record["productive_s"],
                    "truth_productive_s": true["productive_s"],
                    "badput_s": record["badput_s"], "faults_recorded": record["faults"]},
    }


def run_count(svc: Services, shape: Shape) -> dict:
    c = Count(svc, shape)
    log.info("count_starting", nodes=shape.nodes, hosted=len(c.names),
             strikes=len(c.strikes), boost=round(c.boost, 2))
    c.start_host()
    try:
        c.sample("host_started")
        raw = asyncio.run(c.run())
    finally:
        c.stop_host()
    return figures(c, raw)


def machine(results: list[dict]) -> dict:
    """The largest count's per-node cost against this machine: the node host's, and the
    whole harness's (host + orchestrator worker + Temporal server, all on these cores)."""
    cores, mem_mb = os.cpu_count() or 1, psutil.virtual_memory().total / 2**20
    # a count that never trained measured idle nodes, not the cost of training ones
    ok = [r for r in results if "cost" in r and r["ended"]["steps_kept"] > 0]
    if not ok:
        return {}
    big = max(ok, key=lambda r: r["nodes"])
    cost = big["cost"]
    host = cost["host"]
    server = cost["temporal_server"]["cpu_cores"] or 0.0
    whole = (host["cores_per_node"] * big["hosted_nodes"] + cost["orchestrator"]["cpu_cores"]
             + server) / big["nodes"]
    return {"cores": cores, "mem_mb": round(mem_mb), "from_nodes": big["nodes"],
            "host_only": machine_limit(host["cores_per_node"], host["rss_mb_per_node"], cores,
                                       mem_mb),
            "cores_per_node_all": whole,
            **machine_limit(whole, host["rss_mb_per_node"], cores, mem_mb)}


def plots(results: list[dict], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        recs = r.get("recovery", {}).get("per_fault", [])
        xs = [f"{r['nodes']}n {x['kind']}" for x in recs]
        ax.bar(xs, [x["first_step_s"] or 0 for x in recs], label=f"{r['nodes']} nodes: first step")
        ax.bar(xs, [x["decision_s"] or 0 for x in recs], label=f"{r['nodes']} nodes: decision")
    ax.set_ylabel("seconds after the fault (real)")
    ax.tick_params(axis="x", rotation=60)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out, "scale_recovery.png"))
    fig.savefig(paths[-1], dpi=110)
    fig, ax = plt.subplots(figsize=(6, 4))
    ok = [r for r in results if "cost" in r]
    ax.plot([r["nodes"] for r in ok], [r["cost"]["host"]["cores_per_node"] * r["hosted_nodes"]
                                       for r in ok], "o-", label="node host (cores)")
    ax.plot([r["nodes"] for r in ok], [r["cost"]["orchestrator"]["cpu_cores"] for r in ok],
            "s-", label="orchestrator worker (cores)")
    ax.plot([r["nodes"] for r in ok], [r["cost"]["temporal_server"]["cpu_cores"] or 0
                                       for r in ok], "^-", label="Temporal server (cores)")
    ax.set_xlabel("nodes")
    ax.set_ylabel("CPU cores")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out, "scale_cost.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close("all")
    return paths


def shapes(args: argparse.Namespace) -> list[Shape]:
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if args.quick:
        base = Shape(nodes=8, days=0.06, compress=60.0, want_faults=3, even=True, settle_s=25.0,
                     kinds=("node_lost", "rank_lost", "hang"), timeout_s=args.timeout_s or 240)
        nodes = [int(n) for n in args.nodes.split(",")] if args.nodes else [8]
        return [replace(base, nodes=n) for n in nodes]
    return [Shape(nodes=int(n), days=args.days, compress=args.compress, step_s=args.step_s,
                  fault_boost=args.fault_boost, want_faults=args.want_faults, kinds=kinds,
                  settle_s=args.settle_s, even=args.even, polls=args.polls, seed=args.seed,
                  timeout_s=args.timeout_s or 3000.0)
            for n in (args.nodes or "16,64").split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 nodes, 1.4 hours simulated, 3 faults")
    p.add_argument("--nodes", default="", help="node counts, comma-separated (default 16,64)")
    p.add_argument("--days", type=float, default=1.0, help="simulated days of training")
    p.add_argument("--compress", type=float, default=72.0,
                   help="simulated seconds per real second")
    p.add_argument("--step-s", type=float, default=15.0, help="simulated seconds per step")
    p.add_argument("--fault-boost", type=float, default=0.0,
                   help="x Llama 3's fault rate (0: auto, enough for --want-faults)")
    p.add_argument("--want-faults", type=int, default=6)
    p.add_argument("--kinds", default=",".join(FAULT_KINDS), help="fault kinds in rotation")
    p.add_argument("--even", action="store_true",
                   help="--want-faults faults spread evenly, not drawn at the rate")
    p.add_argument("--settle-s", type=float, default=30.0, help="least real gap between faults")
    p.add_argument("--polls", type=int, default=1, help="activity pollers per node worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=0.0, help="per node count")
    p.add_argument("--plots", default="", help="write PNG plots here")
    p.add_argument("--save-raw", default="", help="also write the JSON line to this file")
    args = p.parse_args(argv)
    try:
        todo = shapes(args)
    except ValueError as exc:
        p.error(str(exc))
    svc = Services().start()
    results = []
    try:
        for shape in todo:
            try:
                results.append(run_count(svc, shape))
            except Exception as exc:  # noqa: BLE001 - reported: what limits this count
                log.exception("count_failed", nodes=shape.nodes)
                results.append({"nodes": shape.nodes, "error": repr(exc)[:500]})
    finally:
        svc.stop()
    out = {"benchmark": "scale", "quick": args.quick, "cpus": os.cpu_count(),
           "counts": results, "machine": machine(results)}
    if args.plots:
        out["plots"] = plots(results, args.plots)
    line = json.dumps(rounded(out), default=str)
    if args.save_raw:
        Path(args.save_raw).write_text(line + "\n")
    print(line)
    return 0 if results and all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
