"""Orchestration overhead: tokens/s of a run through Temporal + supervisor + checkpoints +
event log, divided by a bare DeepSpeed loop on the same model, data and steps; and the
whole per-step cost against a plain PyTorch loop, itemised by owner.

    .venv/bin/python benchmarks/overhead.py [--steps 300] [--segments 1] [--durable s3|file]
                                            [--world 1] [--threads 1] [--quick]

The three sides train the same GPT (`trainer.model`) on the same packed batches
(`trainer.segment.make_batches`) for the same steps with the same LR schedule
(`trainer.schedule.lr_at`), launched the same way (torchrun with the supervisor's child
environment, `activities.supervise`) with the same torch threads (`--threads`, default 1
per trainer process: a second core stays free for the services, as a GPU node's spare
cores are, and a single thread degrades evenly when another job shares the cores, where
two spin-waiting OpenMP threads collapse).

- orchestrated: a real TrainingRun (sweep off) on a private Temporal dev server, worker
  fleet and (default) SeaweedFS S3 durable tier at CPU priority 19 (in production S3 is
  other machines). Its dataset is prepared before the other runs, so prepare_data is a
  cache hit; the figures only use the train stage.
- bare: `python -m benchmarks.overhead --bare` under torchrun: the same DeepSpeed engine
  (`trainer.engine.build_engine`: config, our vetoable AdamW), then fetch -> forward ->
  backward -> step with a loss.item() per step; no checkpoints, no progress file, no
  events, no spike detector, no supervisor.
- plain: `python -m benchmarks.overhead --plain` under torchrun: no DeepSpeed, no
  orchestration — torch.optim.AdamW over the same parameter groups with the engine
  config's hyper-parameters (lr set per step, betas, eps, weight decay), forward ->
  backward -> torch.nn.utils.clip_grad_norm_(train.grad_clip) -> step -> zero_grad, a
  loss.item() per step (at W > 1 the model is wrapped in DistributedDataParallel on gloo).

Figures (one JSON line), all ratios reference ÷ orchestrated time = orchestrated ÷
reference tokens/s:
- `value`: end to end against the bare loop. Orchestrated: the train stage's wall time (its
  stage_started -> stage_finished events: activity dispatch, child start-up, restore check,
  step-0 commit, steps, checkpoint pauses, the writer process's uploads competing for the
  cores, the final drain, events). Bare: its process launch -> last step end (its own one
  start-up). With --segments K the run pays K start-ups, the bare loop one.
- `steady_state_ratio`: first step start -> last step end inside each segment (checkpoint
  pauses and upload contention included; start-up and the final drain excluded).
- `step_time_ratio`: sum of per-step compute times (the trainer's own step_time_s lines).
- `plain_ratio`: the median step of the plain loop ÷ the median *loop period* of the
  orchestrated run. A plain step is one iteration (set lr -> loss.item(); the loop does
  nothing else). The orchestrated loop period is the time between consecutive `step` lines
  of one launch (their `ts`, stamped as each line is made): one whole iteration of
  trainer/loop.py — train_step (whose own `step_time_s` leaves out its last probes) and
  every owner after it (the progress line, the rollback check, the checkpoint cadence,
  faults, evaluation, the stop check). A checkpoint's pause lands in one period; the median
  leaves such steps out, as it leaves out the plain loop's slowest. `plain_step_time_ratio`
  is the same with the trainer's `step_time_s` instead of the period.
- `itemised`: the orchestrated median period minus the plain median step, in milliseconds
  per step: `engine` (a): the bare DeepSpeed loop's median step minus the plain one's —
  DeepSpeed's bookkeeping (its hooks, gradient reduction, clipping, zero_grad, timers);
  then, from the trainer's own per-owner clock (trainer/step_metrics.py OwnerClock, the
  median per step over the segment, summed over segments by their steps), `probes` (b)
  StepProbe, `progress` (c) the step's progress line (Trainer.report), `spike_judge` (d)
  SpikeGuard.judge and after_step, `train_step_other` (e) the rest of train_step (the LR
  schedule and set_lr, the data cursor, the veto, the Meter, the StepResult), `loss_and_stop`
  (the loss's host sync and the stop-file check; the plain loop's loss.item() is its
  counterpart), `loop_owners` (resolve, checkpoints' cadence, faults, evaluator, stopper,
  medians: the checkpoint pauses are in `owner_mean_ms`), and `compute_vs_bare`: the
  trainer's forward_backward + update minus the bare loop's median step (the same engine
  work; what remains is the machine: the services and uploads sharing the cores, noise).
  `unexplained` closes the sum (medians of parts do not add up to the median of a whole).
- `segment_fixed_s`: orchestrated wall time outside the segments' step loops (dispatch,
  start-up, restore, step-0 commit, final drain), per segment, itemised for the first
  segment in `orchestrated.phases_s`; `projected_ratio_1h_segments`: steady_state_ratio with
  that fixed cost once per hour of training (weeks-long runs use hour-scale segments).
The reference loops run before and after the orchestrated run, alternating plain and bare
(plain, bare, orchestrated, bare, plain: the machine is shared; its load moves); each
reference is the mean of its two runs' figures and `bare_spread` / `plain_spread` say how
far apart they were.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
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
        write_reference(out, launched, first, times, loss.item())


def write_reference(out: str, launched: float, first: float, times: list[float],
                    loss: float) -> None:
    """A reference loop's timings (bare DeepSpeed or plain PyTorch), as run_reference reads
    them (torch is imported where the loops run, under torchrun, not by the benchmark)."""
    import torch

    Path(out).write_text(json.dumps({"launched": launched, "first_step_start": first,
                                     "last_step_end": time.time(), "step_times": times,
                                     "threads": torch.get_num_threads(), "loss": loss}))


# ---- the plain loop (runs under torchrun): no DeepSpeed, no orchestration -----------------
def plain_loop(spec: RunSpec, dataset: str, out: str) -> None:
    launched = float(os.environ["BENCH_LAUNCHED"])
    import torch
    import torch.distributed as dist

    from storage.dataset import load_manifest
    from trainer.model import GPT, param_groups
    from trainer.schedule import lr_at
    from trainer.segment import make_batches

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0)
                          or max(1, (os.cpu_count() or 1) // world))
    model = GPT(spec.model, load_manifest(dataset).vocab_size, seed=spec.seed)
    net = model
    if world > 1:
        dist.init_process_group("gloo")
        net = torch.nn.parallel.DistributedDataParallel(model)
    cfg = spec.train
    # the engine config's optimizer (trainer/schedule.py deepspeed_config), as torch's own
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                                  betas=tuple(cfg.betas), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay)
    batches = make_batches(spec, dataset, rank, world)
    torch.manual_seed(spec.seed + rank)
    cursor, times = 0, []
    first = time.time()
    for step in range(1, cfg.total_steps + 1):  # 1-based, as in the trainer
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        for _ in range(cfg.grad_accum):
            x, y, *packed = batches.get(cursor)
            _, loss = net(x, y, **dict(zip(("position_ids", "doc_ids"), packed)))
            (loss / cfg.grad_accum).backward()
            cursor += 1
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # a real loop looks at its loss
        times.append(time.perf_counter() - t0)
    if rank == 0:
        write_reference(out, launched, first, times, loss.item())


def run_reference(mode: str, spec: RunSpec, dataset: str, scratch: Path, name: str,
                  env: dict) -> dict:
    """One reference loop (`mode` bare | plain) under torchrun; its figures."""
    spec_file, out = scratch / f"{name}-spec.json", scratch / f"{name}.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    cmd = trainer_command("benchmarks.overhead", spec.train.world_size,
                          [f"--{mode}", "--spec", str(spec_file), "--dataset", dataset,
                           "--out", str(out)])
    env = child_env({**env, "BENCH_LAUNCHED": repr(time.time())})
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{mode} loop failed ({proc.returncode}): {proc.stderr[-2000:]}")
    ref = json.loads(out.read_text())
    return {"wall_s": ref["last_step_end"] - ref["launched"],
            "loop_s": ref["last_step_end"] - ref["first_step_start"],
            "steps_s": sum(ref["step_times"]),
            "median_step_s": statistics.median(ref["step_times"]),
            "start_s": ref["first_step_start"] - ref["launched"], "threads": ref["threads"]}


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
            "median_period_s": statistics.median(
                p for launch in launch_files(spec, "progress.jsonl") for p in loop_periods(
                    [line for line in launch if line.get("type") == "step"])),
            "median_step_time_s": statistics.median(s["step_time_s"] for s in steps),
            "owners": merged_owners(launch_files(spec, "step_owners.json")),
            "phases_s": phases(events, lines, start, end),
            "steps_s": sum(line["step_time_s"] for line in kept.values()),
            "executed_steps": len(steps), "segments": len(segments),
            "checkpoint_pause_s": pauses,
            "checkpoints": sum(e["kind"] == "checkpoint_committed" for e in events),
            "events": len(events), "first_step_after_s": min(s["ts"] for s in steps) - start}


def loop_periods(steps: list[dict]) -> list[float]:
    """Pure: seconds between consecutive step lines of one launch's progress file (after a
    rollback the replayed step does not follow its predecessor: no period across it)."""
    return [b["ts"] - a["ts"] for a, b in zip(steps, steps[1:]) if b["step"] == a["step"] + 1]


def launch_files(spec: RunSpec, name: str) -> list:
    """Each segment launch's `name` in its workdir: progress.jsonl as a list of lines, or
    step_owners.json (trainer/loop.py's per-owner step times) as a dict."""
    pattern = os.path.join(spec.storage.fast, spec.run_id, "segments", "*", name)
    out = []
    for path in sorted(glob.glob(pattern)):
        text = Path(path).read_text()
        out.append([json.loads(t) for t in text.splitlines() if t.strip().endswith("}")]
                   if name.endswith(".jsonl") else json.loads(text))
    return out


def merged_owners(summaries: list[dict]) -> dict:
    """Pure: the launches' per-owner milliseconds per step, weighted by their steps."""
    summaries = [s for s in summaries if s.get("steps")]
    steps = sum(s["steps"] for s in summaries)
    if not steps:
        return {"steps": 0, "median_ms": {}, "mean_ms": {}}
    def merge(kind: str) -> dict:
        owners = summaries[0][kind]
        return {o: sum(s[kind][o] * s["steps"] for s in summaries) / steps for o in owners}
    return {"steps": steps, "median_ms": merge("median_ms"), "mean_ms": merge("mean_ms")}


LOOP_OWNERS = ("resolve", "checkpoints", "faults", "evaluator", "stopper")


def itemise(plain_s: float, bare_s: float, period_s: float, owners: dict) -> dict:
    """Pure: the orchestrated median period minus the plain median step, in ms per step,
    by owner (the module docstring's `itemised`)."""
    med = owners["median_ms"]
    items = {"engine": (bare_s - plain_s) * 1e3, "probes": med["probe"],
             "progress": med["report"], "spike_judge": med["judge"],
             "train_step_other": med["other"], "loss_and_stop": med["loss_and_stop"],
             "loop_owners": sum(med[o] for o in LOOP_OWNERS),
             "compute_vs_bare": med["forward_backward"] + med["update"] - bare_s * 1e3}
    remainder = (period_s - plain_s) * 1e3
    return {"remainder": remainder, **items, "unexplained": remainder - sum(items.values())}


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


def ratios(bare: list[dict], plain: list[dict], orch: dict) -> dict:
    """Reference ÷ orchestrated time for each measure (the mean of each reference's runs)."""
    ref = {k: statistics.mean(b[k] for b in bare)
           for k in ("wall_s", "loop_s", "steps_s", "median_step_s")}
    plain_step = statistics.mean(p["median_step_s"] for p in plain)
    fixed = (orch["wall_s"] - orch["loop_s"]) / orch["segments"]
    steady = ref["loop_s"] / orch["loop_s"]
    return {"value": ref["wall_s"] / orch["wall_s"], "steady_state_ratio": steady,
            "step_time_ratio": ref["steps_s"] / orch["steps_s"], "segment_fixed_s": fixed,
            "projected_ratio_1h_segments": 3600.0 / (3600.0 / steady + fixed),
            "plain_ratio": plain_step / orch["median_period_s"],
            "plain_step_time_ratio": plain_step / orch["median_step_time_s"],
            "bare_spread": spread([b["median_step_s"] for b in bare]),
            "plain_spread": spread([p["median_step_s"] for p in plain])}


def spread(values: list[float]) -> float:
    return max(values) / min(values)


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
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--dataset", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.bare or args.plain:
        loop = bare_loop if args.bare else plain_loop
        loop(RunSpec.from_dict(json.loads(Path(args.spec).read_text())), args.dataset, args.out)
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
        plain = [run_reference("plain", spec, dataset, scratch, "plain-1", env)]
        bare = [run_reference("bare", spec, dataset, scratch, "bare-1", env)]
        loads.append(load_1m())
        orch = orchestrated(services, spec, timeout_s=3600)
        loads.append(load_1m())
        bare.append(run_reference("bare", spec, dataset, scratch, "bare-2", env))
        plain.append(run_reference("plain", spec, dataset, scratch, "plain-2", env))
        loads.append(load_1m())
    finally:
        services.stop()
        services.remove()
    figures = {k: round(v, 4) for k, v in ratios(bare, plain, orch).items() if v is not None}
    items = itemise(statistics.mean(p["median_step_s"] for p in plain),
                    statistics.mean(b["median_step_s"] for b in bare),
                    orch["median_period_s"], orch["owners"])
    print(json.dumps({
        "figure": "orchestration_overhead", **figures, "target": 0.97,
        "itemised": rounded(items), "owner_mean_ms": rounded(orch["owners"]["mean_ms"]),
        "orchestrated": {k: rounded(v) for k, v in orch.items() if k != "owners"},
        "bare": rounded(bare), "plain": rounded(plain),
        "steps": steps, "segments": args.segments, "checkpoint_every": spec.train.checkpoint_every,
        "tokens_per_step": spec.train.micro_batch_tokens * spec.train.world_size,
        "world_size": args.world, "durable": args.durable,
        "model": {k.split(".")[1]: v for k, v in MODEL.items() if k.startswith("model.")},
        "torch_threads": bare[0]["threads"], "cpus": os.cpu_count(), "load_avg_1m": loads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
