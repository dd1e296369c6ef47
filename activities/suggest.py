"""suggest_trials: the sweep's next trial points, as a local activity of the orchestrator.

optuna's samplers are CPU work and numpy, which workflow code must not do or import
(DESIGN §5: yield within 2 s); as a local activity the result is also recorded in the
workflow's history, so a replay reuses it instead of recomputing it, and a retry, rebuilding
the same study from the same records with the same seed, suggests the same points
(sweep/suggest.py). Trial 0 is the prior: Step Law's learning rate (sweep/prior.py) and the
main run's own value of every other swept parameter (spec/sweep.py main_values), clipped
into the space.
"""

from __future__ import annotations

from temporalio import activity

from activities.contracts import (
    SOURCE_PRIOR,
    SUGGEST_TRIALS,
    SuggestInput,
    SuggestResult,
)
from activities.errors import classified
from spec import RunSpec, SweepConfig
from spec.codec import build
from spec.sweep import accumulation_tokens, main_values
from sweep.prior import prior_lr
from sweep.suggest import Record, distributions_json, suggest, sweep_space


@activity.defn(name=SUGGEST_TRIALS)
@classified
def suggest_trials(inp: SuggestInput) -> SuggestResult:
    cfg = build(SweepConfig, inp.sweep, "sweep")
    spec = RunSpec.from_dict(inp.spec) if inp.spec is not None else None
    # older histories (no spec) never swept the batch: its unit does not matter there
    dims = sweep_space(cfg, accumulation_tokens(spec.train) if spec else 1)
    own = distributions_json(dims)
    records = [Record(o.params, o.distributions or own, o.val_loss, o.dead, o.pruned,
                      tuple((int(step), float(v)) for step, v in o.rungs))
               for o in inp.observed]
    prior = None
    if spec is not None:
        prior = {**main_values(spec.train), "lr": prior_lr(spec)}
    points = suggest(dims, records, inp.count, seed=inp.seed, kind=cfg.sampler, prior=prior,
                     startup=max(2, len(dims) + 1))
    sources = [SOURCE_PRIOR if prior and not records and i == 0 else cfg.sampler
               for i in range(len(points))]
    return SuggestResult(points=points, source=cfg.sampler, sources=sources, distributions=own)
