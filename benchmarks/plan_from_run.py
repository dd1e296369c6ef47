"""`mainspring plan --from-run` held against real runs: three runs of different lengths
through the real workflow, each predicted from its first 10 % of steps by the same code the
command runs (ops/plan_run.from_events), against the training time it took.

    .venv/bin/python benchmarks/plan_from_run.py [--steps 800 1600 3200] [--segment-steps 400]
        [--quick] [--save-raw FILE | --from-raw FILE]

The runs: TrainingRuns (sweep off) one after another on one private Temporal dev server,
worker fleet and SeaweedFS S3 durable tier (benchmarks/harness.py), the e2e run shape at
W=1 with one torch thread, a checkpoint every 10 steps, the demo preset's cadences
otherwise (a train_metrics window every 10 steps). The segment length is the same for all
three, so the runs differ in how many segments they pay a start-up for as well as in
steps: two, four and eight. The dataset is prepared by the first run; the others find it
cached (the prediction covers the train stage only, as the command does).

Figures (one JSON line): per run its steps, segments, the prediction's inputs (the steps
it saw, seconds per step, start-up per segment), predicted and actual training seconds
(first segment_started to last segment_finished), `error` = predicted / actual - 1; then
`max_abs_error` and `within_15pct` over the three. The cores are shared with other jobs
whose load the first 10 % cannot foresee: beside each run, the other jobs' runnable
scheduling groups during its first 10 % and during the rest (sampled every 100 ms,
benchmarks/scaling.py), and `load_adjusted_error`, the error once the time after the first
10 % is stretched by the plan's CPU-sharing rule for that change (`adjusted`), to tell the
model's error from the machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = 0.15  # the acceptance bound on |predicted / actual - 1|
# A segment's first 40-80 steps here (3-6 s) share the two cores with its own start-up
# work (the next standby's imports, 3-7 s of CPU; the checkpoint writer's start; the
# scrub), and run up to 15 % slower than the rest. A prediction from the first 10 % needs
# that 10 % to reach past them: the full runs' shortest prefix is 80 steps. A 400-step
# run's (40 steps, 3 s) lies wholly inside them and over-predicts by about as much (+15.5 %
# measured: benchmarks/HISTORY.md). The quick runs' shortest (40 steps) does not reach
# past them either: quick is a smoke run of the pipeline, not the figure.
STEPS, QUICK_STEPS = (800, 1600, 3200), (400, 800, 1600)
SEGMENT_STEPS, QUICK_SEGMENT_STEPS = 400, 200
# A checkpoint every 10 steps: the trainer's `steps a-b` spans, whose ends are the exact
# times the prediction reads, are the steps between two checkpoints, and the prediction
# needs two of them inside the first 10 % (the shortest quick run's first 20 steps).
CHECKPOINT_EVERY = 10


def run_lengths(args: argparse.Namespace) -> tuple[tuple[int, ...], int]:
    """(steps per run, segment steps): --quick halves both, so segments stay the same count."""
    if args.quick:
        return QUICK_STEPS, QUICK_SEGMENT_STEPS
    return tuple(args.steps), args.segment_steps


def record_runs(lengths: tuple[int, ...], segment_steps: int) -> dict:
    """The runs, one after another, and what `plan --from-run` reads of each: its events and
    spans as the durable store holds them (so --from-raw can predict again without running)."""
    from benchmarks.harness import BASE, Services, bench_spec, load_1m, log, run_workflow
    from benchmarks.scaling import GroupSampler
    from storage.events import read_events
    from storage.spans import read_spans

    # one torch thread per trainer, as benchmarks/overhead.py runs it: a single thread
    # slows evenly when other jobs share the cores, two spin-waiting OpenMP threads
    # collapse, and `adjusted` counts the trainer as one thread
    services = Services(s3=True, env={"OMP_NUM_THREADS": "1"}).start()
    runs, loads = [], [load_1m()]
    sampler = GroupSampler()  # other jobs' load, beside the runs (see `adjusted`)
    try:
        for steps in lengths:
            spec = bench_spec(f"plan-{steps}-{int(time.time())}", services, **{
                "train.total_steps": steps, "train.segment_steps": min(steps, segment_steps),
                "train.segments_per_run": -(-steps // segment_steps),
                "train.checkpoint_every": CHECKPOINT_EVERY})
            started = time.time()
            result = asyncio.run(run_workflow(services.temporal.address, spec, 3600))
            time.sleep(3.0)  # the last spans leave the exporters (every 2 s)
            log.info("run_recorded", run_id=spec.run_id, status=result.get("status"),
                     wall_s=round(time.time() - started, 1))
            runs.append({"run_id": spec.run_id, "status": result.get("status"),
                         "events": read_events(spec.storage.durable, spec.run_id),
                         "spans": read_spans(spec.storage.durable, spec.run_id)})
            loads.append(load_1m())
    finally:
        sampler.stop()
        services.stop()
        services.remove()
    return {"runs": runs, "loads": loads, "segment_steps": segment_steps,
            "background": sampler.samples,
            "checkpoint_every": CHECKPOINT_EVERY,
            "cpus": os.cpu_count(),
            "model": {k.split(".")[1]: v for k, v in BASE.items() if k.startswith("model.")}}


ADJUSTED = ("background_prefix", "background_rest", "stretch", "load_adjusted_predicted_s",
            "load_adjusted_error")
KEEP = ("total_steps", "segments", "seen_steps", "marks_from", "seconds_per_step",
        "startup_s", "tail_s", "predicted_s", "actual_s", "error", "faults", "finished")


def adjusted(p: dict, samples: list[tuple[float, int]], start_ts: float, end_ts: float,
             cores: int) -> dict:
    """Pure: how much of the error the other jobs on the machine explain. The machine's
    cores are shared with other jobs whose load the first 10 % cannot foresee; `samples`
    are (time, other jobs' runnable scheduling groups), benchmarks/scaling.py's count. The
    trainer, one group, gets `cpu_share(1, cores, 1, b)` of a core beside b of them (the
    plan's own CPU-sharing rule, ops/plan.py), so the time after the prefix is stretched
    by the share during the prefix over the share during the rest."""
    from benchmarks.scaling import background
    from ops.plan import cpu_share
    from ops.plan_run import predicted_at

    before = background(samples, [start_ts, p["seen_ts"]])
    after = background(samples, [p["seen_ts"], end_ts])
    stretch = cpu_share(1, cores, 1, before) / cpu_share(1, cores, 1, after)
    seen = predicted_at(p["seen_steps"], p)
    predicted = seen + (p["predicted_s"] - seen) * stretch
    return {"background_prefix": before, "background_rest": after, "stretch": stretch,
            "load_adjusted_predicted_s": predicted,
            "load_adjusted_error": predicted / p["actual_s"] - 1}


def figures(predictions: list[dict]) -> dict:
    """Pure: each run's row (ops/plan_run.predict's figures that the benchmark reports, and
    `adjusted`'s where the raw record has them) and the worst error over them against the
    15 % bound."""
    rows = [{k: p[k] for k in (*KEEP, *ADJUSTED) if k in p} | {"run_id": p["run_id"]}
            for p in predictions]
    worst = max(abs(r["error"]) for r in rows)
    out = {"runs": rows, "max_abs_error": worst, "within_15pct": worst <= TARGET}
    if all("load_adjusted_error" in r for r in rows):
        out["max_abs_load_adjusted_error"] = max(abs(r["load_adjusted_error"]) for r in rows)
    return out


def report(raw: dict) -> dict:
    from benchmarks.harness import rounded
    from ops.plan_run import from_events

    predictions = [from_events(r["run_id"], r["events"], r["spans"]) for r in raw["runs"]]
    if raw.get("background"):
        predictions = [p | adjusted(p, raw["background"], p["start_ts"],
                                    p["start_ts"] + p["actual_s"], raw["cpus"])
                       for p in predictions]
    return {"figure": "plan_from_run", **rounded(figures(predictions)), "target": TARGET,
            "statuses": [r["status"] for r in raw["runs"]],
            "inputs": {"segment_steps": raw["segment_steps"],
                       "checkpoint_every": raw["checkpoint_every"], "model": raw["model"],
                       "world_size": 1, "cpus": raw["cpus"], "load_avg_1m": raw["loads"]}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, nargs="+", default=list(STEPS),
                   help="each run's total steps")
    p.add_argument("--segment-steps", type=int, default=SEGMENT_STEPS)
    p.add_argument("--quick", action="store_true",
                   help=f"runs of {'/'.join(map(str, QUICK_STEPS))} steps in "
                        f"{QUICK_SEGMENT_STEPS}-step segments")
    p.add_argument("--save-raw", default="", help="also write what the runs left to this file")
    p.add_argument("--from-raw", default="", help="predict from saved runs instead of running")
    args = p.parse_args(argv)
    from benchmarks.harness import raw_run

    raw = raw_run(args, lambda: record_runs(*run_lengths(args)))
    print(json.dumps(report(raw)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
