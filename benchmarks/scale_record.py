"""The read tools over a long run's record: a synthetic run record of `--nodes` nodes for
`--days` simulated days written through the real writers, then each read tool timed as an
operator runs it.

    .venv/bin/python benchmarks/scale_record.py [--nodes 1024] [--days 30] [--scale 1.0]
        [--step-s 5] [--metrics-every 10] [--checkpoint-every 300] [--segment-steps 3000]
        [--durable file:///tmp/dir] [--timeout-s 300] [--keep]

The record: the run's claim (RUN.json with its spec: `--nodes` nodes of 8 accelerators, the
tokens of a step that `--step-s` and the train_metrics' tokens/s agree on, so explain prices
a fault's replayed steps as a real run's would), run_started, the prepare_data and train
stages, then segments of
`--segment-steps` steps, each written by its own `EventLog` (one per trainer process, as a
real segment is) and flushed at every checkpoint: segment_started/finished, train_metrics
every `--metrics-every` steps, checkpoint_saved/committed every `--checkpoint-every`, and
rank 0's `steps a-b` window span per checkpoint interval and a `startup` span per launch
(storage/spans.py's writer, the span layout trainer/tracing.py writes). Faults come at
Llama 3's published rate scaled to the node count (419 in 54 days on 2,048 nodes of 8
GPUs), exponential gaps from a fixed seed; each is a `fault` (kinds rotating through those
a large run sees), its `recovered`, and a new segment from the last committed checkpoint.
A killed trainer exports no span for its open window (the process is gone), as in a real
run. Events carry simulated timestamps (EventLog stamps wall time; the emitted dict is the
buffered one, so it is re-stamped before the flush). Only node 0 writes (the supervisor
of a gang's node 0): the event rate grows with nodes through the fault rate only.
`--scale` shortens the simulated span (0.01: 1 % of `--days`) for a quick run.

Figures (one JSON line): inputs; the record's events, spans, batch objects and bytes, and
lines and bytes per simulated day; per tool (`events` full dump, `events --follow`
catch-up, `explain --incident 1`, `report`, `trace --json`, `goodput --json`) its wall
seconds, the seconds to its first line of output (a follower that streams prints its first
events long before its last), peak RSS MB (os.wait4 on that child alone), exit code,
whether it timed out, and
`within_bound` against the bounds the scale work set (report <= 30 s and <= 1 GB, explain
<= 2 s; the others have none, null); `goodput`: from the record vs the simulation's ground
truth (productive step time ÷ run wall time) and their relative error (bound 1 %).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from spec import preset  # noqa: E402
from storage.events import EventLog  # noqa: E402
from storage.runs import claim_run  # noqa: E402
from storage.spans import DurableSpanExporter  # noqa: E402

LLAMA3_FAULTS, LLAMA3_DAYS, LLAMA3_NODES = 419, 54, 2048  # 16,384 GPUs, 8 a node
FAULT_KINDS = ("rank_lost", "worker_lost", "hang", "nccl", "ecc", "preempted", "crash")
T0 = 1_700_000_000.0  # simulated start: a fixed epoch, so reruns write the same record
DATA_S, STARTUP_S, DETECTION_S, RESTART_S = 600.0, 90.0, 30.0, 60.0
BOUNDS = {"report": (30.0, 1024.0), "explain": (2.0, None)}  # (seconds, MB)
PROCS_PER_NODE, MICRO_BATCH_TOKENS, GRAD_ACCUM = 8, 8192, 2


@dataclass(frozen=True)
class Shape:
    nodes: int = 1024
    days: float = 30.0
    scale: float = 1.0
    step_s: float = 5.0
    metrics_every: int = 10
    checkpoint_every: int = 300
    segment_steps: int = 3000
    seed: int = 0

    @property
    def sim_s(self) -> float:
        return self.days * self.scale * 86400.0

    @property
    def faults_per_day(self) -> float:
        return LLAMA3_FAULTS / LLAMA3_DAYS * self.nodes / LLAMA3_NODES

    @property
    def tokens_per_s(self) -> float:
        """The throughput a step of `step_s` means for the spec's batch (`run_spec`)."""
        return (MICRO_BATCH_TOKENS * GRAD_ACCUM * self.nodes * PROCS_PER_NODE / self.step_s)


def run_spec(shape: Shape, run_id: str) -> dict:
    """The spec the run's claim stores: the demo preset's, at the shape's nodes and batch
    (as JSON, unchecked: a readers' benchmark needs the fields they read, not a model that
    fits 8,192 accelerators)."""
    spec = {**preset("demo").to_dict(), "run_id": run_id}  # `7.5d` is not a run id a spec takes
    spec["train"].update(nodes=shape.nodes, procs_per_node=PROCS_PER_NODE,
                         micro_batch_tokens=MICRO_BATCH_TOKENS, grad_accum=GRAD_ACCUM)
    return spec


@dataclass(frozen=True)
class Truth:
    steps: int
    productive_s: float
    wall_s: float
    faults: int
    lost_s: tuple[float, ...]  # per fault: detection + restart + startup + replayed steps
    counts: dict

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s


def fault_times(shape: Shape, start: float, end: float) -> list[float]:
    """Pure: fault instants in [start, end), exponential gaps at the scaled Llama 3 rate."""
    rng, rate, out, t = random.Random(shape.seed), shape.faults_per_day / 86400.0, [], start
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return out
        out.append(t)


class Writer:
    """The record's writers: one EventLog per process (workflow, each segment) and one span
    exporter per trainer process; counts what it emitted for the ground truth."""

    def __init__(self, url: str, run_id: str) -> None:
        self.url, self.run_id = url, run_id
        self.counts: dict[str, int] = {}
        self.spans = 0

    def log(self, name: str) -> EventLog:
        return EventLog(self.url, self.run_id, name)

    def emit(self, log: EventLog, kind: str, ts: float, step: int | None = None, /,
             **payload) -> dict:  # positional-only: a fault's payload has a `kind` too
        event = log.emit(kind, payload, step=step)
        event["ts"] = ts  # simulated time; the dict is the one buffered for the flush
        self.counts[kind] = self.counts.get(kind, 0) + 1
        return event

    def span(self, exporter: DurableSpanExporter, name: str, start: float, end: float,
             pid: int, attributes: dict) -> None:
        rec = {"trace_id": f"{pid:032x}", "span_id": f"{self.spans + 1:016x}",
               "parent_id": None, "name": name, "start_ns": int(start * 1e9),
               "end_ns": int(end * 1e9), "status": "ok", "status_message": "",
               "service": "mainspring-trainer", "pid": pid, "parent_hint": None,
               "attributes": {"rank": 0, **attributes}, "events": [], "links": []}
        self.spans += 1
        exporter._write(self.url, self.run_id, [rec])  # the exporter's own batch writer


def write_record(shape: Shape, url: str, run_id: str) -> Truth:
    """Write the run's record; return what really happened (module docstring)."""
    claim_run(url, run_id, "0" * 16, run_spec(shape, run_id))
    w = Writer(url, run_id)
    wf = w.log("workflow")
    end = T0 + shape.sim_s
    w.emit(wf, "run_started", T0, spec_hash="0" * 16)
    # just after run_started, as a real run records it
    w.emit(wf, "stage_started", T0 + 0.001, stage="prepare_data")
    w.emit(wf, "stage_finished", T0 + DATA_S, stage="prepare_data", cache_hit=True)
    t = T0 + DATA_S
    w.emit(wf, "stage_started", t, stage="train")
    wf.flush()
    faults = fault_times(shape, t, end)
    lost: list[float] = []
    committed, step, segment, pid, kinds = 0, 0, 0, 1000, 0
    while t + STARTUP_S + shape.step_s <= end:
        segment, pid = segment + 1, pid + 1
        seg = w.log("supervisor")
        exporter = DurableSpanExporter("trainer", run=(url, run_id))
        step, to_step = committed, committed + shape.segment_steps
        w.emit(seg, "segment_started", t, step, from_step=step, to_step=to_step,
               attempt=1)
        w.span(exporter, "startup", t, t + STARTUP_S, pid, {"badput": "startup"})
        t += STARTUP_S
        window: list[float] = []
        fault = None
        while step < to_step and t + shape.step_s <= end:
            if faults and faults[0] <= t + shape.step_s:
                fault = faults.pop(0)
                break
            t += shape.step_s
            step += 1
            window.append(shape.step_s)
            if step % shape.metrics_every == 0:
                w.emit(seg, "train_metrics", t, step, segment=segment, attempt=1, seq=step,
                       first_step=step - shape.metrics_every + 1, last_step=step,
                       steps=shape.metrics_every, loss_mean=2.0, loss_min=1.9,
                       loss_max=2.1, nonfinite=0, lr=3e-4, tokens_per_s=shape.tokens_per_s,
                       mfu=0.4, skipped=0, peak_mem_bytes=70 << 30)
            if step % shape.checkpoint_every == 0 or step == to_step:
                close_window(w, seg, exporter, pid, step, window, t)
                committed, window = step, []
        if fault is None:  # the segment reached its end, or the simulated span did
            if window:  # the run's last steps: a final checkpoint at the stage's end
                close_window(w, seg, exporter, pid, step, window, t)
                committed = step
            w.emit(seg, "segment_finished", t, step, from_step=step - len(window),
                   to_step=to_step, attempt=1, train_loss=2.0, resumed_from=committed)
            seg.flush()
            continue
        kind = FAULT_KINDS[kinds % len(FAULT_KINDS)]
        kinds += 1
        replayed = step - committed
        ev = w.emit(seg, "fault", fault, step, kind=kind, injected=False,
                    evidence=f"simulated {kind}", fault_ts=fault,
                    detected_ts=fault + DETECTION_S, detection_s=DETECTION_S,
                    attempt=1, last_step=step, segment=[committed, to_step],
                    detected_by="supervisor")
        seg.flush()  # the supervisor outlives its trainer: its fault reaches the store
        # what the fault cost: the steps since the last commit, the part-step it cut,
        # detection, the restart and the next launch's start-up
        lost.append(replayed * shape.step_s + (fault - t) + DETECTION_S + RESTART_S
                    + STARTUP_S)
        t = fault + DETECTION_S + RESTART_S
        nxt = w.log("supervisor")
        w.emit(nxt, "recovered", t + STARTUP_S + shape.step_s, committed,
               fault_event_id=ev["event_id"], resumed_step=committed, last_step_seen=step,
               lost_steps=replayed, detection_s=DETECTION_S, restart_s=RESTART_S,
               restore_s=STARTUP_S, mttr_s=t + STARTUP_S + shape.step_s - fault,
               attempt=2, tier="fast")
        nxt.flush()
    w.emit(wf, "stage_finished", t, stage="train", final_step=committed, segments=segment)
    # a moment later, as the workflow's next activity writes it (`events --follow` ends
    # on it, tie or not: tests/ops/test_cli_events_follow.py)
    w.emit(wf, "run_finished", t + 0.001, status="completed")
    wf.flush()
    return Truth(steps=committed, productive_s=committed * shape.step_s, wall_s=t - T0,
                 faults=len(lost), lost_s=tuple(lost), counts=dict(w.counts))


def close_window(w: Writer, log: EventLog, exporter: DurableSpanExporter, pid: int,
                 step: int, window: list[float], t: float) -> None:
    """A checkpoint: its events, rank 0's `steps a-b` span, and the log's flush."""
    first = step - len(window) + 1
    w.emit(log, "checkpoint_saved", t, step, tier="fast", pause_s=0.0, waited_s=0.0)
    w.emit(log, "checkpoint_committed", t, step, uri=f"ckpt/{step:08d}", bytes=1 << 40)
    w.span(exporter, f"steps {first}-{step}", t - sum(window), t, pid,
           {"goodput": True, "first_step": first, "last_step": step, "step": step,
            "step_times_s": list(window), "skipped_steps": []})
    log.flush()


@dataclass(frozen=True)
class Timed:
    seconds: float
    first_line_s: float | None
    peak_mb: float
    rc: int | None
    timed_out: bool
    stdout_lines: int
    stdout_tail: str
    stderr_tail: str


def run_tool(argv: list[str], timeout_s: float, caught_up: int = 0) -> Timed:
    """Run one CLI command as an operator would; its wall time and its own peak RSS
    (os.wait4 reports that child alone); killed (its process group) at the timeout, or
    once it has printed `caught_up` lines (a follower that has the whole record)."""
    env = {**os.environ, "MAINSPRING_LOG_LEVEL": "warning"}
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    out = {"lines": 0, "tail": b"", "err": b""}

    def drain_out() -> None:  # counted, not kept: a 30-day dump is large
        for line in proc.stdout:
            out.setdefault("first_s", time.monotonic() - t0)
            out["lines"] += 1
            out["tail"] = line[-100_000:]  # goodput's one JSON line is read from it
            if caught_up and out["lines"] >= caught_up:
                out["caught_up_s"] = time.monotonic() - t0
                os.killpg(proc.pid, signal.SIGKILL)

    def drain_err() -> None:
        out["err"] = proc.stderr.read()[-600:]

    readers = [threading.Thread(target=f, daemon=True) for f in (drain_out, drain_err)]
    for r in readers:
        r.start()
    timer = threading.Timer(timeout_s, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = out.get("caught_up_s", time.monotonic() - t0)
    timed_out = not timer.is_alive() and seconds >= timeout_s
    timer.cancel()
    for r in readers:
        r.join(5)
    proc.returncode = os.waitstatus_to_exitcode(status)
    first = out.get("first_s")
    return Timed(seconds=round(seconds, 3), first_line_s=None if first is None else round(first, 3),
                 peak_mb=round(usage.ru_maxrss / 1024, 1),
                 rc=proc.returncode, timed_out=timed_out, stdout_lines=out["lines"],
                 stdout_tail=out["tail"].decode(errors="replace").strip(),
                 stderr_tail=out["err"].decode(errors="replace").strip()[-600:])


def tool_commands(url: str, run_id: str, out_dir: str) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "ops.cli"]
    at = ["--durable", url]
    return {
        "events": [*cli, "events", run_id, *at, "--json"],
        # the run has finished: --follow catches up and ends at run_finished on its own
        "events_follow": [*cli, "events", run_id, *at, "--json", "--follow", "--poll-s", "1"],
        "explain": [*cli, "explain", run_id, *at, "--incident", "1", "--json"],
        "report": [*cli, "report", run_id, *at, "--out", out_dir],
        "trace": [*cli, "trace", run_id, *at, "--json"],
        "goodput": [*cli, "goodput", run_id, *at, "--json"],
    }


def within(tool: str, t: Timed) -> bool | None:
    if tool not in BOUNDS:
        return None
    secs, mb = BOUNDS[tool]
    return (t.rc == 0 and not t.timed_out and t.seconds <= secs
            and (mb is None or t.peak_mb <= mb))


def record_size(url: str, run_id: str) -> dict:
    """Objects, lines and bytes of the run's events and spans in the store."""
    from storage.fs import join, resolve

    fs, root = resolve(url)
    out = {}
    for part in ("events", "spans"):
        paths = fs.find(join(root, "runs", run_id, part))
        datas = fs.cat(paths) if paths else {}
        out[part] = {"objects": len(paths), "bytes": sum(len(d) for d in datas.values()),
                     "lines": sum(d.count(b"\n") for d in datas.values())}
    return out


def goodput_figure(timed: Timed, truth: Truth) -> dict:
    try:
        measured = json.loads(timed.stdout_tail)["goodput"]
    except (ValueError, KeyError, TypeError):
        measured = None
    err = None if measured is None else abs(measured - truth.goodput) / truth.goodput
    return {"from_record": measured, "ground_truth": truth.goodput, "rel_error": err,
            "within_1pct": None if err is None else err <= 0.01}


def parse(argv: list[str] | None) -> tuple[Shape, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in asdict(Shape()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--durable", default="", help="a file:// (default: a temp dir) or s3:// URL")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per read tool")
    p.add_argument("--keep", action="store_true", help="keep the record (temp dir)")
    args = p.parse_args(argv)
    shape = Shape(**{k: getattr(args, k) for k in asdict(Shape())})
    return shape, args


def main(argv: list[str] | None = None) -> int:
    from common import telemetry

    telemetry.configure_logging("warning")
    shape, args = parse(argv)
    tmp = tempfile.mkdtemp(prefix="scale_record-")
    url = args.durable or f"file://{tmp}/store"
    run_id = f"scale-{shape.nodes}n-{shape.days * shape.scale:g}d"
    t0 = time.monotonic()
    truth = write_record(shape, url, run_id)
    write_s = time.monotonic() - t0
    size = record_size(url, run_id)
    sim_days = shape.sim_s / 86400.0
    tools = {}
    events = sum(truth.counts.values())
    for tool, argv_ in tool_commands(url, run_id, os.path.join(tmp, "report")).items():
        tools[tool] = run_tool(argv_, args.timeout_s,
                               caught_up=events if tool == "events_follow" else 0)
    result = {
        "benchmark": "scale_record", **asdict(shape), "sim_days": sim_days,
        "run_id": run_id, "durable": url, "write_s": round(write_s, 2),
        "record": size,
        "per_day": {p: {"lines": round(v["lines"] / sim_days),
                        "bytes": round(v["bytes"] / sim_days)} for p, v in size.items()},
        "truth": {"steps": truth.steps, "faults": truth.faults, "wall_s": truth.wall_s,
                  "productive_s": truth.productive_s, "goodput": truth.goodput,
                  "lost_s_mean": (sum(truth.lost_s) / len(truth.lost_s)) if truth.lost_s
                  else 0.0, "events": truth.counts},
        "tools": {k: {"seconds": t.seconds, "first_line_s": t.first_line_s,
                      "peak_mb": t.peak_mb, "rc": t.rc,
                      "timed_out": t.timed_out, "stdout_lines": t.stdout_lines,
                      "complete": t.stdout_lines == events if k.startswith("events") else None,
                      "within_bound": within(k, t),
                      **({"stderr_tail": t.stderr_tail} if t.rc else {})}
                  for k, t in tools.items()},
        "goodput": goodput_figure(tools["goodput"], truth),
    }
    print(json.dumps(result, default=str))
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if all(math.isfinite(v["seconds"]) for v in result["tools"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
