"""Loss-spike handling on real data: false positives, recovery, loss cost, wasted steps.

    .venv/bin/python benchmarks/spikes.py [--steps 2000] [--seeds 3] [--jobs 2] [--quick]
                                          [--spikes '{"patience": 2}'] [--workdir DIR]

Corpus: this Python's standard-library top-level sources (`stdlib:*.py`), prepared once by
the project's own data prep (`dataprep.pipeline.prepare_dataset`: cleaning, dedup, a 2048-token
byte-level BPE) and cached under the work dir. Model: the Llama-style GPT of `trainer.model`
(see INPUTS / the printed `inputs`). Every run is the real `trainer.segment` under torchrun
(CPU, gloo, one process), started fresh from an empty store, with online evaluation every
`eval_every` steps on the same held-out batches. Runs:

- clean, handling on, on `--seeds` seeds: any `skip` or `rollback` verdict is a false
  positive (reported per 10k steps);
- injected, handling on, seed = the first clean seed: FAULTS at fixed fractions of the
  run, spaced more than `spikes.window` steps apart so each spike is judged on its own
  (a NaN skip and a later outlier inside one window form a "sustained spike"; see
  docs/decisions.md);
- the same injected run with handling off (`spikes.enabled=false`), and once more without
  the NaN faults (a NaN poisons an unhandled run for good; without it the damage of the
  other faults is visible).

The spike config is SpikeConfig's defaults unless `--spikes` overrides fields (for every
run alike, printed in `inputs.spike_overrides`).

Figures (one JSON line):

- `injected`: faults that fired (their `fault` events); the step each first fired at is
  the fault's onset `s0` (after a rollback's skip window, corrupted data arrives earlier).
- `recovered`: faults that were (a) handled: a NaN by a `skip` at s0; a corrupted window
  shorter than `spikes.patience` by a `skip` at each of its steps; a longer one by a
  rollback whose skip window covers every corrupted batch; an LR burst by a skip or
  rollback verdict in the steps its bad updates show in (s0+1 .. s0+steps+1) — and
  (b) returned: at one of the RETURN_WITHIN (4) evaluations from RETURN_AFTER (2)
  evaluation intervals after the fault's last step on, the held-out loss is within
  RETURN_TOLERANCE (2 %) of the clean run's at that step (one evaluation is not enough:
  once a rollback's skip window shifts the data order, the runs' held-out losses at a
  given step differ by ~2 % from the data order alone). Faults share one run, so damage a fault leaves stays
  in the comparison for the later ones: `recovered_vs_before` instead asks that the ratio
  came back to within 2 % of its value at the last evaluation before the fault.
- `false_positives_per_10k_steps`: skip/rollback verdicts in clean runs per 10k steps.
- `final_loss_ratio_vs_clean`: held-out loss at the last step, injected+handled run ÷
  clean run of the same seed; `final_train_loss_ratio_vs_clean`: the same for the mean of
  the last LAST_N accepted training losses (noisier: once a skip window shifts the data,
  the two runs read different batches at the same step). `clean_seed_spread` (max ÷ min final held-out
  loss over clean seeds) says how large a difference seeds alone make.
- `wasted_steps_per_spike`: step executions that did not become an applied update — steps
  re-run after rollbacks (the rolled-back trajectory) plus skipped (vetoed) steps — per
  injected fault. `skipped_data_batches`: batches inside rollback skip windows.
- `lr_burst_on_checkpoint` (diagnostic run): an LR burst starting on a checkpoint step,
  with the rollback allowance the workflow passes (budget.rollbacks); see on_checkpoint_run.
- `handling_off`: `final_loss_ratio_vs_clean` (null when non-finite), `diverged` (the final
  held-out loss is non-finite or more than DIVERGED_RATIO x the clean one),
  `nonfinite_from_step`; `without_nan_faults`: the same plus the worst held-out ratio.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import structlog

from dataprep.pipeline import prepare_dataset
from spec import DataConfig, RunSpec
from storage.events import read_events

REPO = Path(__file__).resolve().parents[1]
CORPUS = "stdlib:*.py"
INPUTS = {
    "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
    "model.seq_len": 64, "train.micro_batch_tokens": 512, "train.warmup_steps": 20,
    "train.checkpoint_every": 25, "train.eval_batches": 8, "sweep.enabled": False,
}
SPIKES: dict = {}  # spike-config overrides (none: SpikeConfig defaults, printed in inputs)
# (kind, fraction of the run, steps, LR factor): three kinds, five spikes.
FAULTS = [("nan_loss", 0.20, 1, 1.0), ("corrupt_batches", 0.35, 4, 1.0),
          ("lr_burst", 0.50, 2, 100.0), ("corrupt_batches", 0.65, 1, 1.0),
          ("corrupt_batches", 0.80, 2, 1.0)]
RETURN_TOLERANCE, RETURN_AFTER, RETURN_WITHIN, LAST_N, DIVERGED_RATIO = 0.02, 2, 4, 100, 1.10
OFF_GRID = 3  # fault steps lie off the checkpoint grid (every 25); see on_checkpoint_run()


def faults_for(steps: int, with_nan: bool = True) -> list[dict]:
    out = []
    for kind, frac, n, factor in FAULTS:
        if kind == "nan_loss" and not with_nan:
            continue
        fault = {"kind": kind, "at_step": int(frac * steps) + OFF_GRID, "steps": n}
        out.append({**fault, "factor": factor} if kind == "lr_burst" else fault)
    return out


def spec_for(root: Path, name: str, seed: int, steps: int, **over) -> RunSpec:
    return RunSpec(run_id=name, seed=seed).replace(**{
        **INPUTS, **{f"spikes.{k}": v for k, v in SPIKES.items()},
        "train.total_steps": steps, "train.segment_steps": steps,
        "train.eval_every": eval_every(steps), "storage.durable": str(root / name / "store"),
        **over})


def eval_every(steps: int) -> int:
    return max(10, steps // 40)


def run(root: Path, dataset: str, spec: RunSpec, timeout: float, extra: tuple = ()) -> dict:
    """One fresh segment 0 -> total_steps, as tests/trainer/helpers.run_segment runs it, on
    the spec's `train.procs_per_node` ranks."""
    base = root / spec.run_id
    shutil.rmtree(base, ignore_errors=True)  # a leftover store would resume, not start fresh
    base.mkdir(parents=True)
    (base / "spec.json").write_text(json.dumps(spec.to_dict()))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(spec.train.procs_per_node),
           "-m", "trainer.segment", "--spec", str(base / "spec.json"), "--dataset", dataset,
           "--to-step", str(spec.train.total_steps), "--workdir", str(base / "work"), *extra]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        error = "" if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-1500:]}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout:.0f} s"
    lines = [json.loads(x) for x in (base / "work" / "progress.jsonl").read_text().splitlines()] \
        if (base / "work" / "progress.jsonl").exists() else []
    result = json.loads((base / "work" / "result.json").read_text()) \
        if (base / "work" / "result.json").exists() else {}
    return {"name": spec.run_id, "spec": spec, "error": error, "seconds": time.time() - t0,
            "steps": [x for x in lines if x["type"] == "step"],
            "evals": {x["step"]: x["val_loss"] for x in lines if x["type"] == "eval"},
            "result": result,
            "params": next((x["params"] for x in lines if x["type"] == "start"), None),
            "events": read_events(spec.storage.durable, spec.run_id) if not error else []}


def final(r: dict) -> dict[int, dict]:
    """The kept trajectory: the last execution of each step (a rollback re-runs steps)."""
    return {s["step"]: s for s in r["steps"]}


def num(x) -> float:
    return math.nan if x is None else float(x)


def ratio(a, b) -> float | None:
    q = num(a) / num(b)
    return round(q, 4) if math.isfinite(q) else None


def train_tail(r: dict) -> float:
    kept = [s["loss"] for s in final(r).values() if s["verdict"] == "ok"]
    return sum(map(num, kept[-LAST_N:])) / max(1, len(kept[-LAST_N:]))


def verdict_steps(r: dict, lo: int, hi: int) -> list[str]:
    return [s["verdict"] for s in r["steps"] if lo <= s["step"] <= hi]


def judge_fault(r: dict, clean: dict, event: dict, patience: int) -> dict:
    """Handled and returned (module docstring) for one fired fault."""
    p, s0 = event["payload"], event["step"]
    n = p.get("steps") or 1
    rollbacks = r["result"].get("outcome", {}).get("rollbacks", [])
    if p["kind"] == "nan_loss":
        handled = "skip" in verdict_steps(r, s0, s0)
    elif p["kind"] == "lr_burst":
        handled = bool(set(verdict_steps(r, s0 + 1, s0 + n + 1)) & {"skip", "rollback"})
    elif n >= patience:
        c0, c1 = p["cursors"]
        handled = any(a <= c0 and c1 <= b for a, b in (rb["skip"] for rb in rollbacks
                                                         if rb.get("skip")))
    else:
        handled = all(v == "skip" for v in verdict_steps(r, s0, s0 + n - 1))
    every = r["spec"].train.eval_every
    due = s0 + n - 1 + RETURN_AFTER * every
    checks = sorted(s for s in r["evals"] if due <= s < due + RETURN_WITHIN * every)
    ratios = [(c, ratio(r["evals"].get(c), clean["evals"].get(c))) for c in checks or
              [max(r["evals"])]]
    before = max([s for s in r["evals"] if s < s0] or [min(r["evals"])])
    q0 = ratio(r["evals"].get(before), clean["evals"].get(before))
    ok = [(c, q) for c, q in ratios if q is not None and q <= 1 + RETURN_TOLERANCE]
    ok0 = [(c, q) for c, q in ratios if None not in (q, q0) and q <= q0 + RETURN_TOLERANCE]
    check, q = (ok or ratios)[0]
    return {"kind": p["kind"], "at_step": s0, "steps": n, "handled": handled,
            "val_ratio_before": q0, "val_ratio_at": check, "val_ratio": q,
            "returned": bool(ok), "returned_vs_before": bool(ok0),
            "verdicts": [v for v in verdict_steps(r, s0, s0 + n + 1)]}


def off_summary(r: dict, clean: dict) -> dict:
    last = max(clean["evals"])
    q = ratio(r["evals"].get(last), clean["evals"].get(last))
    bad = [s["step"] for s in r["steps"] if s["loss"] is None]
    worst = [ratio(v, clean["evals"].get(k)) for k, v in r["evals"].items()]
    return {"final_loss_ratio_vs_clean": q, "diverged": q is None or q > DIVERGED_RATIO,
            "nonfinite_from_step": bad[0] if bad else None,
            "worst_val_ratio": None if None in worst else max(worst, default=None),
            "error": r["error"] or None}


def on_checkpoint_run(root: Path, steps: int) -> tuple[RunSpec, tuple[str, ...]]:
    """Diagnostic: an LR burst whose first (bad) update lands on a checkpoint step. The
    spike shows one step later, the rollback restores at_or_before onset - 1 = that
    checkpoint, which holds the bad update, so the segment rolls back to it again and again;
    the workflow's budget (--max-rollbacks, as workflows/training_run.py passes it) ends it."""
    every = INPUTS["train.checkpoint_every"]
    at = max(every, round(0.5 * steps / every) * every)
    spec = spec_for(root, "lr-burst-on-checkpoint", 1, steps,
                    faults=[{"kind": "lr_burst", "at_step": at, "steps": 2, "factor": 100.0}])
    return spec, ("--max-rollbacks", str(spec.spikes.budget.rollbacks))


def on_checkpoint_summary(r: dict) -> dict:
    sp = r["result"].get("outcome", {})
    return {"at_step": r["spec"].faults[0].at_step, "rollbacks": len(sp.get("rollbacks", [])),
            "to_steps": sorted({rb["to_step"] for rb in sp.get("rollbacks", [])}),
            "stopped": sp.get("stopped"), "final_step": r["result"].get("final_step"),
            "max_rollbacks": r["spec"].spikes.budget.rollbacks, "error": r["error"] or None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2, help="segments run side by side")
    ap.add_argument("--quick", action="store_true", help="smoke run: 400 steps, 1 seed")
    ap.add_argument("--spikes", type=json.loads, default={},
                    help='spike-config overrides for every run, JSON: {"patience": 2}')
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(),
                                                      "mainspring-bench-spikes"))
    args = ap.parse_args(argv)
    steps, seeds = (400, 1) if args.quick else (args.steps, args.seeds)
    SPIKES.update(args.spikes)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    t0 = time.time()
    root = Path(args.workdir)
    dataset, manifest, _ = prepare_dataset(DataConfig(corpus=CORPUS, workers=1),
                                           str(root / "data"), seed=0)  # cached after once
    specs = [spec_for(root, f"clean-s{s}", s, steps) for s in range(1, seeds + 1)]
    specs += [spec_for(root, "injected-on", 1, steps, faults=faults_for(steps)),
              spec_for(root, "injected-off", 1, steps, faults=faults_for(steps),
                       **{"spikes.enabled": False}),
              spec_for(root, "injected-off-no-nan", 1, steps, faults=faults_for(steps, False),
                       **{"spikes.enabled": False})]
    jobs = [(s, ()) for s in specs] + [on_checkpoint_run(root, steps)]
    timeout = 120 + 0.3 * steps * max(1, args.jobs)
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        runs = {r["name"]: r for r in pool.map(lambda j: run(root, dataset, *j[:1], timeout, j[1]),
                                                jobs)}
    clean = [runs[s.run_id] for s in specs if s.run_id.startswith("clean")]
    on, base = runs["injected-on"], runs["clean-s1"]
    patience = on["spec"].spikes.patience
    fired = [e for e in on["events"] if e["kind"] == "fault"]
    faults = [judge_fault(on, base, e, patience) for e in fired]
    fp = sum(1 for r in clean for s in r["steps"] if s["verdict"] != "ok")
    clean_steps = sum(len(r["steps"]) for r in clean)
    kept_ok = sum(1 for s in final(on).values() if s["verdict"] == "ok")
    rbs = on["result"].get("outcome", {}).get("rollbacks", [])
    finals = [num(r["evals"].get(steps)) for r in clean]
    print(json.dumps({
        "figure": "spike_handling",
        "recovered": sum(f["handled"] and f["returned"] for f in faults),
        "injected": len(fired),
        "recovered_vs_before": sum(f["handled"] and f["returned_vs_before"] for f in faults),
        "false_positives_per_10k_steps": round(fp / max(1, clean_steps) * 1e4, 2),
        "final_loss_ratio_vs_clean": ratio(on["evals"].get(steps), base["evals"].get(steps)),
        "final_train_loss_ratio_vs_clean": ratio(train_tail(on), train_tail(base)),
        "wasted_steps_per_spike": round((len(on["steps"]) - kept_ok) / max(1, len(fired)), 2),
        "handling_off": {**off_summary(runs["injected-off"], base),
                         "without_nan_faults": off_summary(runs["injected-off-no-nan"], base)},
        "lr_burst_on_checkpoint": on_checkpoint_summary(runs["lr-burst-on-checkpoint"]),
        "faults": faults, "rollbacks": rbs,
        "skipped_steps": on["result"].get("outcome", {}).get("skipped_steps", []),
        "skipped_data_batches": sum(b - a for a, b in (rb["skip"] for rb in rbs
                                                       if rb.get("skip"))),
        "skipped": [rb.get("skipped", "window") for rb in rbs],
        "false_positive_verdicts": fp, "clean_steps": clean_steps,
        "clean_final_val_loss": [round(x, 4) for x in finals],
        "clean_seed_spread": round(max(finals) / min(finals), 4)
        if all(map(math.isfinite, finals)) else None,
        "errors": {n: r["error"] for n, r in runs.items() if r["error"]},
        "inputs": {"model": {k[6:]: v for k, v in INPUTS.items() if k.startswith("model.")},
                   "params": base["params"],
                   "vocab_size": manifest.vocab_size, "corpus": CORPUS,
                   "train_tokens": manifest.tokens("train"), "val_tokens": manifest.tokens("val"),
                   "steps": steps, "seeds": list(range(1, seeds + 1)), "injected_seed": 1,
                   "micro_batch_tokens": INPUTS["train.micro_batch_tokens"],
                   "checkpoint_every": INPUTS["train.checkpoint_every"],
                   "eval_every": eval_every(steps), "lr": on["spec"].train.lr,
                   "spikes": {k: v for k, v in on["spec"].to_dict()["spikes"].items()
                              if k != "budget"}, "spike_overrides": SPIKES,
                   "faults": faults_for(steps), "return_tolerance": RETURN_TOLERANCE,
                   "return_after_evals": RETURN_AFTER, "return_within_evals": RETURN_WITHIN, "jobs": args.jobs, "device": "cpu",
                   "seconds_per_run": {n: round(r["seconds"], 1) for n, r in runs.items()},
                   "load_average": os.getloadavg()[0]},
        "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
