"""prune_trial: whether a sweep trial stops at the rung boundary it reached, as a local
activity of the orchestrator.

optuna's pruner is optuna, which workflow code must not import (DESIGN §5); as a local
activity the decision is recorded in the workflow's history, so a replay reuses it, and a
retry, rebuilding the same study from the same records, decides the same (sweep/prune.py).
"""

from __future__ import annotations

from temporalio import activity

from activities.contracts import PRUNE_TRIAL, PruneInput, PruneResult
from activities.errors import classified
from spec.codec import build
from spec.sweep import PruningConfig
from sweep.prune import Trial, decide


@activity.defn(name=PRUNE_TRIAL)
@classified
def prune_trial(inp: PruneInput) -> PruneResult:
    cfg = build(PruningConfig, inp.pruning, "sweep.pruning")
    trials = [Trial(t.status, tuple((int(s), float(v)) for s, v in t.rungs), t.val_loss)
              for t in inp.trials]
    d = decide(cfg, inp.trial_steps, trials, inp.index)
    return PruneResult(prune=d.prune, rung=d.rung, step=d.step, val_loss=d.val_loss,
                       competing=d.competing, better=d.better)
