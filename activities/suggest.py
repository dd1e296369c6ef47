"""suggest_trials: the sweep's next trial points, as a local activity of the orchestrator.

The GP fit and the Expected Improvement search are CPU work, which workflow code must not
do (DESIGN §5: yield within 2 s); as a local activity the result is also recorded in the
workflow's history, so a replay reuses it instead of recomputing it.
"""

from __future__ import annotations

from temporalio import activity

from activities.contracts import (
    SOURCE_GP,
    SOURCE_INITIAL,
    SUGGEST_TRIALS,
    SuggestInput,
    SuggestResult,
)
from activities.errors import classified
from spec import SearchDim, SweepConfig
from sweep.suggest import initial_design, suggest, sweep_space


@activity.defn(name=SUGGEST_TRIALS)
@classified
def suggest_trials(inp: SuggestInput) -> SuggestResult:
    raw = dict(inp.sweep)
    space = {name: SearchDim(**dim) for name, dim in raw.pop("space").items()}
    dims = sweep_space(SweepConfig(space=space, **raw))
    if not inp.observed:
        return SuggestResult(points=initial_design(dims, inp.count), source=SOURCE_INITIAL)
    observed = [(o.params, o.val_loss) for o in inp.observed]
    return SuggestResult(points=suggest(dims, observed, inp.count, inp.seed), source=SOURCE_GP)
