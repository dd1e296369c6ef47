"""Throughput per layout: the real `trainer.segment` under torchrun (CPU, gloo) at data, tensor
and pipeline parallelism, what `benchmarks/throughput.py --layout` runs.

Each layout trains the same model on the same packed corpus (`benchmarks/resume_exact.py`'s
length-skewed documents) for `steps` steps on two ranks, every step's micro-batches of the
same size; its step profiler (`ops.profile_every`) profiles every PROFILE_EVERY-th step for
the exposed communication (trainer/overlap.py: the collectives' time no compute overlapped,
over the step). From the segment's own `progress.jsonl`: the median step time of the steps
after WARMUP (a profiled step runs slower under the profiler and is left out), tokens/s at
that step time (the step's tokens: every data replica's micro-batches), and the mean exposed
fraction of the profiled steps. The pipeline bubble is 1F1B's idle share,
(p - 1) / (m + p - 1) for p stages and m micro-batches (Narayanan et al. 2021, §2.2), the
fraction of a step each stage waits; DeepSpeed's engine does not time it.

    dp2   two data-parallel ranks, ZeRO 0
    tp2   one replica of two tensor shards (train.layout {tp: 2}), ZeRO 0
    pp2   one pipeline of two stages (train.layout {pp: 2}), ZeRO 0
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from benchmarks.resume_exact import skewed_dataset
from ops.plan import bubble_fraction
from tests.trainer.helpers import run_segment, tiny_spec, write_spec

# name: (train.layout, data replicas) on WORLD ranks
LAYOUTS = {"dp2": ("dp", 2), "tp2": ({"tp": 2, "pp": 1, "zero": 0}, 1),
           "pp2": ({"tp": 1, "pp": 2, "zero": 0}, 1)}
WORLD = 2
MICRO_BATCHES = 4  # a step's micro-batches per replica (1F1B: at least the stages)
MODEL = {"model.d_model": 128, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.seq_len": 64, "train.micro_batch_tokens": 512}
PROFILE_EVERY = 5
WARMUP = 5  # steps left out of the step time: the first ones share the cores with start-up


def figures(lines: list[dict], tokens_per_step: int) -> dict:
    """Pure: a segment's progress lines -> its median steady step time, tokens/s at it and
    the exposed communication of its profiled steps."""
    steps = [x for x in lines if x.get("type") == "step"]
    profiled = [x["comm_exposed_frac"] for x in steps if x.get("comm_exposed_frac") is not None]
    steady = [x["step_time_s"] for x in steps
              if x["step"] > WARMUP and x.get("comm_exposed_frac") is None]
    if not steady:
        raise ValueError(f"no step after the first {WARMUP} in {len(steps)} step lines")
    step_s = statistics.median(steady)
    return {"step_time_s": round(step_s, 4), "tokens_per_s": round(tokens_per_step / step_s, 1),
            "comm_exposed_frac": round(statistics.fmean(profiled), 4) if profiled else None,
            "profiled_steps": len(profiled), "steady_steps": len(steady)}


def measure(name: str, steps: int, root: Path, dataset: str) -> dict:
    layout, replicas = LAYOUTS[name]
    over = {**MODEL, "train.procs_per_node": WORLD, "train.zero_stage": 0,
            "train.packing": True, "train.grad_accum": MICRO_BATCHES,
            "train.total_steps": steps, "train.segment_steps": steps,
            "train.checkpoint_every": steps, "train.eval_every": 0,
            "ops.profile_every": PROFILE_EVERY}
    if layout != "dp":
        over["train.layout"] = layout
    spec = tiny_spec(root / name, **over)
    workdir = root / f"w-{name}"
    proc = run_segment(write_spec(spec, root / f"{name}.json"), dataset, steps, workdir,
                       world=WORLD, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: {proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in (workdir / "progress.jsonl").read_text().splitlines() if x]
    tokens = replicas * MICRO_BATCHES * spec.train.micro_batch_tokens
    pp = layout["pp"] if isinstance(layout, dict) else 1
    return {"layout": name, "world_size": WORLD, "data_replicas": replicas,
            "tokens_per_step": tokens, **figures(lines, tokens),
            "bubble_fraction": round(bubble_fraction(pp, MICRO_BATCHES), 4)}


def run_layouts(names: list[str], steps: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="mainspring-layouts-"))
    dataset = skewed_dataset(root)
    rows = [measure(name, steps, root, dataset) for name in names]
    return {"figure": "throughput_by_layout", "layouts": rows,
            "inputs": {"model": MODEL, "micro_batches": MICRO_BATCHES, "steps": steps,
                       "warmup_steps": WARMUP, "profile_every": PROFILE_EVERY,
                       "device": "cpu", "backend": "gloo", "cpus": os.cpu_count(),
                       "load_average": round(os.getloadavg()[0], 2)}}
