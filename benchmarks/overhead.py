"""Orchestration overhead: tokens/s of a run through Temporal + supervisor + checkpoints +
event log, divided by a bare DeepSpeed loop on the same model, data and steps.

    .venv/bin/python benchmarks/overhead.py [--steps 300] [--segments 1] [--durable s3|file]
                                            [--world 1] [--threads 1] [--quick]

Both sides train the same GPT (`trainer.model`) in the same DeepSpeed engine
(`trainer.engine.build_engine`: config, our vetoable AdamW) on the same packed batches
(`trainer.segment.make_batches`) for the same steps, launched the same way (torchrun with
the supervisor's child environment, `activities.supervise`) with the same torch threads
(`--threads`, default 1 per trainer process: a second core stays free for the services, as
a GPU node's spare cores are, and a single thread degrades evenly when another job shares
the cores, where two spin-waiting OpenMP threads collapse).

- orchestrated: a real TrainingRun (sweep off) on a private Temporal dev server, worker
  fleet and (default) SeaweedFS S3 durable tier at CPU priority 19 (in production S3 is
  other machines). Its dataset is prepared before the bare runs, so prepare_data is a
  cache hit; the figure only uses the train stage.
- bare: `python -m benchmarks.overhead --bare` under torchrun: build the engine, then
  fetch -> forward -> backward -> step with the same LR schedule and a loss.item() per
  step; no checkpoints, no progress file, no events, no spike detector, no supervisor.

Figures (one JSON line), all ratios bare ÷ orchestrated time = orchestrated ÷ bare tokens/s:
- `value`: end to end. Orchestrated: the train stage's wall time (its stage_started ->
  stage_finished events: activity dispatch, child start-up, restore check, step-0 commit,
  steps, checkpoint pauses, the writer process's uploads competing for the cores, the
  final drain, events). Bare: its process launch -> last step end (its own one start-up).
  With --segments K the run pays K start-ups, the bare loop one.
- `steady_state_ratio`: first step start -> last step end inside each segment (checkpoint
  pauses and upload contention included; start-up and the final drain excluded).
- `step_time_ratio`: sum of per-step compute times (the trainer's own step_time_s lines).
- `segment_fixed_s`: orchestrated wall time outside the segments' step loops (dispatch,
  start-up, restore, step-0 commit, final drain), per segment, itemised for the first
  segment in `orchestrated.phases_s`; `projected_ratio_1h_segments`: steady_state_ratio with
  that fixed cost once per hour of training (weeks-long runs use hour-scale segments).
The bare loop runs before and after the orchestrated run (the machine is shared; its load
moves); the reference is their mean and `bare_spread` says how far apart they were.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from activities.supervise import child_env, trainer_command
from spec import RunSpec

REPO = Path(__file__).resolve().parents[1]
# A step of ~0.1-0.2 s on 2 CPU cores: short enough for a few hundred steps in minutes,
# long enough that per-step bookkeeping is measured against real work.
MODEL = {"model.d_model": 128, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 4,
         "model.seq_len": 128, "train.micro_batch_tokens": 1024}


# ---- the bare loop (runs under torchrun) ------------------------------------------------
def bare_loop(spec: RunSpec, dataset: str, out: str) -> None:
    launched = float(os.environ["BENCH_LAUNCHED"])
    import deepspeed
    import torch

    from storage.dataset import load_manifest
    from trainer.engine import build_engine, set_lr
    from trainer.model import GPT
    from trainer.schedule import lr_at
    from trainer.segment import make_batches

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # The segment's thread rule (trainer/segment.py run_segment), so both sides match.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0)
                          or max(1, (os.cpu_count() or 1) // world))
    deepspeed.utils.logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo")
    model = GPT(spec.model, load_manifest(dataset).vocab_size, seed=spec.seed)
    engine = build_engine(spec, model)
    batches = make_batches(spec, dataset, rank, world)
    torch.manual_seed(spec.seed + rank)
    cfg, cursor, times = spec.train, 0, []
    first = time.time()
    for step in range(1, cfg.total_steps + 1):  # 1-based, as in the trainer
        t0 = time.perf_counter()
        set_lr(engine, lr_at(step, cfg))
        for _ in range(cfg.grad_accum):
            x, y, *packed = batches.get(cursor)
            _, loss = engine(x, y, **dict(zip(("position_ids", "doc_ids"), packed)))
            engine.backward(loss)
            engine.step()
            cursor += 1
        loss.item()  # a real loop looks at its loss; the trainer all-reduces and judges it
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"launched": launched, "first_step_start": first,
                                         "last_step_end": time.time(), "step_times": times,
                                         "threads": torch.get_num_threads(),
                                         "loss": loss.item()}))


def run_bare(spec: RunSpec, dataset: str, scratch: Path, name: str, env: dict) -> dict:
    spec_file, out = scratch / f"{name}-spec.json", scratch / f"{name}.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    cmd = trainer_command("benchmarks.overhead", spec.train.world_size,
                          ["--bare", "--spec", str(spec_file), "--dataset", dataset,
                           "--out", str(out)])
    env = child_env({**env, "BENCH_LAUNCHED": repr(time.time())})
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"bare loop failed ({proc.returncode}): {proc.stderr[-2000:]}")
    bare = json.loads(out.read_text())
    return {"wall_s": bare["last_step_end"] - bare["launched"],
            "loop_s": bare["last_step_end"] - bare["first_step_start"],
            "steps_s": sum(bare["step_times"]),
            "start_s": bare["first_step_start"] - bare["launched"], "threads": bare["threads"]}


# ---- the orchestrated run -----------------------------------------------------------------
def orchestrated(services, spec: RunSpec, timeout_s: float) -> dict:
    from benchmarks.harness import checkpoint_pauses, progress_lines, run_workflow, stage_window
    from ops.goodput import final_trajectory
    from storage.events import read_events

    result = asyncio.run(run_workflow(services.temporal.address, spec, timeout_s))
    events = read_events(spec.storage.durable, spec.run_id)
    start, end = stage_window(events, "train")
    lines = progress_lines(spec)
    steps = [line for line in lines if line["type"] == "step"]
    kept = final_trajectory(steps)
    segments = sorted({(e["payload"]["from_step"], e["payload"]["to_step"]) for e in events
                       if e["kind"] == "segment_started"})
    loop = 0.0
    for lo, hi in segments:  # first step start -> last step end, per segment
        inside = [kept[s] for s in range(lo + 1, hi + 1)]
        loop += inside[-1]["ts"] - (inside[0]["ts"] - inside[0]["step_time_s"])
    pauses = checkpoint_pauses(events)
    return {"status": result["status"], "wall_s": end - start, "loop_s": loop,
            "phases_s": phases(events, lines, start, end),
            "steps_s": sum(line["step_time_s"] for line in kept.values()),
            "executed_steps": len(steps), "segments": len(segments),
            "checkpoint_pause_s": pauses,
            "checkpoints": sum(e["kind"] == "checkpoint_committed" for e in events),
            "events": len(events), "first_step_after_s": min(s["ts"] for s in steps) - start}


def phases(events: list[dict], lines: list[dict], start: float, end: float) -> dict:
    """Where the first segment's start-up and the last one's ending go (wall seconds)."""
    seg0 = next(e["ts"] for e in events if e["kind"] == "segment_started")
    child = next(line["ts"] for line in lines if line["type"] == "start")
    steps = [line for line in lines if line["type"] == "step"]
    first = steps[0]["ts"] - steps[0]["step_time_s"]
    done = max(e["ts"] for e in events if e["kind"] == "segment_finished")
    return {"dispatch": seg0 - start, "child_start_to_restored": child - seg0,
            "restored_to_first_step": first - child,
            "last_step_to_segment_end": done - steps[-1]["ts"],
            "segment_end_to_stage_end": end - done}


def ratios(bare: list[dict], orch: dict) -> dict:
    """Bare ÷ orchestrated time for each measure (mean of the bare runs as reference)."""
    ref = {k: statistics.mean(b[k] for b in bare) for k in ("wall_s", "loop_s", "steps_s")}
    fixed = (orch["wall_s"] - orch["loop_s"]) / orch["segments"]
    steady = ref["loop_s"] / orch["loop_s"]
    return {"value": ref["wall_s"] / orch["wall_s"], "steady_state_ratio": steady,
            "step_time_ratio": ref["steps_s"] / orch["steps_s"], "segment_fixed_s": fixed,
            "projected_ratio_1h_segments": 3600.0 / (3600.0 / steady + fixed),
            "bare_spread": max(b["wall_s"] for b in bare) / min(b["wall_s"] for b in bare)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--segments", type=int, default=1, help="segments the run is cut into")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--durable", choices=("s3", "file"), default="s3")
    p.add_argument("--world", type=int, default=1, help="trainer processes (procs_per_node)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per trainer process on both sides (OMP_NUM_THREADS); "
                        "1 leaves a core to the services, as a GPU node's spare cores are, and "
                        "does not collapse when another job shares the cores (0: the trainer's "
                        "own rule, cores / world size)")
    p.add_argument("--quick", action="store_true", help="150 steps")
    p.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--dataset", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.bare:
        bare_loop(RunSpec.from_dict(json.loads(Path(args.spec).read_text())), args.dataset,
                  args.out)
        return 0
    from benchmarks.harness import Services, bench_spec, load_1m, rounded
    from dataprep.pipeline import prepare_dataset

    steps = 150 if args.quick else args.steps
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    services = Services(s3=args.durable == "s3", env=env).start()
    scratch = Path(services.root)
    loads = [load_1m()]
    try:
        spec = bench_spec(f"overhead-{int(time.time())}", services, **MODEL, **{
            "train.total_steps": steps, "train.segment_steps": -(-steps // args.segments),
            "train.segments_per_run": args.segments, "train.procs_per_node": args.world,
            "train.checkpoint_every": min(args.checkpoint_every, -(-steps // args.segments))})
        dataset, _, _ = prepare_dataset(spec.data, spec.storage.durable, spec.seed)
        bare = [run_bare(spec, dataset, scratch, "bare-1", env)]
        loads.append(load_1m())
        orch = orchestrated(services, spec, timeout_s=3600)
        loads.append(load_1m())
        bare.append(run_bare(spec, dataset, scratch, "bare-2", env))
        loads.append(load_1m())
    finally:
        services.stop()
        services.remove()
    figures = {k: round(v, 4) for k, v in ratios(bare, orch).items() if v is not None}
    print(json.dumps({
        "figure": "orchestration_overhead", **figures, "target": 0.97,
        "orchestrated": {k: rounded(v) for k, v in orch.items()},
        "bare": rounded(bare),
        "steps": steps, "segments": args.segments, "checkpoint_every": spec.train.checkpoint_every,
        "tokens_per_step": spec.train.micro_batch_tokens * spec.train.world_size,
        "world_size": args.world, "durable": args.durable,
        "model": {k.split(".")[1]: v for k, v in MODEL.items() if k.startswith("model.")},
        "torch_threads": bare[0]["threads"], "cpus": os.cpu_count(), "load_avg_1m": loads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
