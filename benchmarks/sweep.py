"""The sweep's pruning on real trials: `pruning_saving` at a winner within 1 % of the unpruned one.

    .venv/bin/python benchmarks/sweep.py [--trials 12] [--trial-steps 54] [--jobs 2] [--quick]
                                         [--workdir DIR]

Corpus and model: those of benchmarks/spikes.py (the standard library's sources through the
project's data prep; its tiny Llama-style GPT), each trial the real `trainer.segment` under
torchrun (CPU, gloo, one process), run by that benchmark's `run` helper, started fresh.

The unpruned sweep: `--trials` points over the learning rate (log range LR_RANGE), trial 0
the scaling-law prior, the rest optuna's TPE asked `--jobs` at a time from the trials so far
(sweep/suggest.py, as the suggest_trials activity asks it), each trial trained whole to
`--trial-steps` with online evaluation every first-rung steps; its winner is the lowest
held-out loss at the last step.

The pruned sweep: the same points with sweep.pruning (`--rungs`, `--eta`; by default one
boundary, at a third of the trial, then the end), each trial's held-out loss at a rung
boundary being the online evaluation at that step — what a trial trained in rungs measures
there, since a resumed segment trains exactly as an unbroken one (bitwise on CPU). The real
pruner (sweep/prune.py, optuna's SuccessiveHalvingPruner) decides at each boundary from the
trials before it, in trial order (the Sweep workflow with sweep.parallel 1). A pruned trial
counts the steps up to its boundary. Same points on purpose: the figure is what pruning
alone saves and costs (a pruned sweep's sampler, seeing PRUNED trials, may pick other
points; not measured here).

Then what the sweep earns: the main run (`--main-steps`, the run whose tokens set the
prior's D) trained twice from scratch with the same seed, once at the pruned sweep's winner
and once at the scaling-law prior alone (trial 0's point, sweep/prior.py); `sweep_gain` is
the winner's final held-out loss over the prior's (< 0.97 earns the sweep its cost), and
`sweep_cost_fraction` the pruned sweep's trial steps over the main run's (each trial step
costs what a main-run step does: the same model, batch and ranks).

One JSON line: `pruning_saving` (sweep/saving.py: 1 - steps trained / planned), the two
winners' losses and `loss_gap`, `meets_target` (>= 30 % saved, gap <= 1 %), per trial its
lr, rung losses, final loss and where it was pruned; `sweep_gain`, its two main runs'
losses and lrs, and `sweep_cost_fraction`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import structlog

from benchmarks.spikes import CORPUS, INPUTS, run
from dataprep.pipeline import prepare_dataset
from spec import DataConfig, RunSpec
from spec.sweep import rung_steps
from sweep.prior import prior_lr
from sweep.prune import Trial, decide
from sweep.saving import pruning_figure
from sweep.suggest import Record, distributions_json, suggest, sweep_space
from workflows.sweep_plan import trial_spec, with_params

RUNGS, ETA = 2, 3  # defaults of --rungs, --eta: one boundary, at a third of the trial
LR_RANGE = (1e-3, 1e-1)
MAIN_STEPS = 2000  # the run the sweep warms up: sets the prior's D (tokens)


def main_spec(trials: int, trial_steps: int, rungs: int, eta: int) -> RunSpec:
    return RunSpec(run_id="bench-sweep", seed=0).replace(**{
        **INPUTS, "train.total_steps": MAIN_STEPS, "train.segment_steps": MAIN_STEPS,
        "sweep.enabled": True, "sweep.trials": trials, "sweep.trial_steps": trial_steps,
        "sweep.space": {"lr": {"low": LR_RANGE[0], "high": LR_RANGE[1], "log": True}},
        "sweep.pruning": {"rungs": rungs, "reduction_factor": eta}})


def train_trials(root: Path, dataset: str, spec: RunSpec, points: list[dict], first: int,
                 jobs: int, timeout: float) -> list[dict]:
    """Each point as a whole trial (trial_spec, as the Sweep workflow builds it), evaluated
    online at every first-rung step."""
    every = rung_steps(spec.sweep.pruning, spec.sweep.trial_steps)[0]
    specs = [trial_spec(spec, first + i, p).replace(**{
        "storage.durable": str(root / f"{spec.run_id}-trial-{first + i}" / "store"),
        "train.eval_every": every}) for i, p in enumerate(points)]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(lambda s: run(root, dataset, s, timeout), specs))


def prune_in_order(spec: RunSpec, curves: list[dict[int, float]]) -> list[Trial]:
    """The pruned sweep's records: each trial judged at each boundary by the real pruner,
    from the trials before it."""
    cfg, steps = spec.sweep.pruning, spec.sweep.trial_steps
    bounds = rung_steps(cfg, steps)
    done: list[Trial] = []
    for curve in curves:
        rungs: list[tuple[int, float]] = []
        status = "running"
        for b in bounds[:-1]:
            rungs.append((b, curve.get(b, math.nan)))
            if decide(cfg, steps, [*done, Trial("running", tuple(rungs))], len(done)).prune:
                status = "pruned"
                break
        final = curve.get(steps, math.nan)
        if status != "pruned":
            status = "complete" if math.isfinite(final) else "diverged"
        done.append(Trial(status, tuple(rungs), final if status == "complete" else None))
    return done


def main_runs(root: Path, dataset: str, spec: RunSpec, lrs: dict[str, float], steps: int,
              jobs: int) -> dict[str, dict]:
    """The main run at each named learning rate, `steps` steps from scratch, the same seed,
    evaluated at its end: name -> the run (benchmarks/spikes.py `run`)."""
    specs = {name: with_params(spec, {"lr": lr}).replace(**{
        "run_id": f"bench-main-{name}", "train.total_steps": steps,
        "train.segment_steps": steps, "train.eval_every": steps, "sweep.enabled": False,
        "storage.durable": str(root / f"bench-main-{name}" / "store")})
        for name, lr in lrs.items()}
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        done = pool.map(lambda s: run(root, dataset, s, 300 + 1.0 * steps), specs.values())
        return dict(zip(specs, done))


def gain_figure(runs: dict[str, dict], steps: int, trained_steps: int) -> dict:
    """Pure: the winner's final held-out loss over the prior's, and the sweep's cost."""
    winner, prior = (runs[k]["evals"].get(steps) for k in ("winner", "prior"))
    ok = winner is not None and prior is not None and math.isfinite(winner) \
        and math.isfinite(prior) and prior > 0
    return {"sweep_gain": round(winner / prior, 4) if ok else None,
            "main_loss_winner": winner, "main_loss_prior": prior, "main_steps": steps,
            "sweep_cost_fraction": round(trained_steps / steps, 4) if steps else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--trial-steps", type=int, default=54)
    ap.add_argument("--rungs", type=int, default=RUNGS, help="sweep.pruning.rungs")
    ap.add_argument("--eta", type=int, default=ETA, help="sweep.pruning.reduction_factor")
    ap.add_argument("--jobs", type=int, default=2, help="trials run side by side")
    ap.add_argument("--main-steps", type=int, default=MAIN_STEPS,
                    help="the main run trained at the winner and at the prior (0: not run)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 9 trials of 27 steps, main runs of 300")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(),
                                                      "mainspring-bench-sweep"))
    args = ap.parse_args(argv)
    trials, trial_steps = (9, 27) if args.quick else (args.trials, args.trial_steps)
    main_steps = min(300, args.main_steps) if args.quick else args.main_steps
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    t0 = time.time()
    root = Path(args.workdir)
    dataset, manifest, _ = prepare_dataset(DataConfig(corpus=CORPUS, workers=1),
                                           str(root / "data"), seed=0)  # cached after once
    spec = main_spec(trials, trial_steps, args.rungs, args.eta)
    dims = sweep_space(spec.sweep)
    dists = distributions_json(dims)
    records: list[Record] = []
    runs: list[dict] = []
    timeout = 300 + 2.0 * trial_steps
    while len(records) < trials:
        count = min(max(1, args.jobs), trials - len(records))
        points = suggest(dims, records, count, seed=spec.seed, prior={"lr": prior_lr(spec)},
                         startup=max(2, len(dims) + 1))
        done = train_trials(root, dataset, spec, points, len(records), args.jobs, timeout)
        for p, r in zip(points, done):
            loss = r["evals"].get(trial_steps)
            records.append(Record(p, dists, loss if loss is not None and math.isfinite(loss)
                                  else None))
        runs += done
    curves = [{int(k): float(v) for k, v in r["evals"].items()} for r in runs]
    pruned = prune_in_order(spec, curves)
    bounds = rung_steps(spec.sweep.pruning, trial_steps)
    pruned_records = [{"steps": t.rungs[-1][0] if t.status == "pruned" else trial_steps,
                       "status": t.status, "result": t.val_loss if t.val_loss is not None
                       else (t.rungs[-1][1] if t.rungs else math.nan)} for t in pruned]
    unpruned_records = [{"steps": trial_steps, "status": "complete",
                         "result": c.get(trial_steps, math.nan)} for c in curves]
    fig = pruning_figure(pruned_records, unpruned_records, trial_steps)

    def r4(x):
        return round(x, 4) if x is not None and math.isfinite(x) else None

    # what the sweep earns: the main run at the pruned sweep's winner and at the prior alone
    best = min((i for i, t in enumerate(pruned) if t.status == "complete"),
               key=lambda i: pruned[i].val_loss, default=None)
    lrs = {"winner": records[best].params["lr"] if best is not None else prior_lr(spec),
           "prior": prior_lr(spec)}
    mains = main_runs(root, dataset, spec, lrs, main_steps, args.jobs) if main_steps else {}
    gain = gain_figure(mains, main_steps, fig.trained_steps) if mains else {}

    print(json.dumps({
        "figure": "pruning_saving", "pruning_saving": round(fig.saving, 4),
        "trained_steps": fig.trained_steps, "planned_steps": fig.planned_steps,
        "trials_pruned": fig.trials_pruned, "winner_loss": r4(fig.winner_loss),
        "unpruned_winner_loss": r4(fig.reference_loss),
        "loss_gap": r4(fig.loss_gap), "meets_target": fig.meets_target,
        "trials": [{"lr": r4(rec.params["lr"]), "status": t.status,
                    "rungs": [[s, r4(v)] for s, v in t.rungs],
                    "final_loss": r4(c.get(trial_steps, math.nan))}
                   for rec, t, c in zip(records, pruned, curves)],
        **gain, "main_lrs": {k: r4(v) for k, v in lrs.items()},
        "winner_is_prior": best == 0,
        "errors": {r["name"]: r["error"] for r in [*runs, *mains.values()] if r["error"]},
        "inputs": {"trials": trials, "trial_steps": trial_steps, "rungs": args.rungs, "eta": args.eta,
                   "rung_steps": bounds, "lr_range": LR_RANGE, "jobs": args.jobs,
                   "model": {k[6:]: v for k, v in INPUTS.items() if k.startswith("model.")},
                   "micro_batch_tokens": INPUTS["train.micro_batch_tokens"],
                   "vocab_size": manifest.vocab_size, "corpus": CORPUS, "device": "cpu",
                   "load_average": os.getloadavg()[0]},
        "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
