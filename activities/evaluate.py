"""evaluate: the held-out loss of chosen checkpoints, from a `trainer.evaluate` child (the
worker never loads a model itself), recorded as `eval` events. Each attempt is a span."""

from __future__ import annotations

import json
import math
import os
import sys

from temporalio import activity

from activities import nodes
from activities.contracts import EVALUATE, EvalPoint, EvaluateInput, EvaluateResult
from activities.errors import classified
from activities.supervise import Supervision, child_env, run_child
from activities.tracing import activity_span
from common.telemetry import child_trace_env
from spec import RunSpec
from storage import fast_tier
from storage.events import EventLog


@activity.defn(name=EVALUATE)
@classified
def evaluate(inp: EvaluateInput) -> EvaluateResult:
    spec = nodes.on_this_node(RunSpec.from_dict(inp.spec))
    with nodes.occupying(f"{spec.run_id} evaluate", activity.heartbeat), \
            activity_span("evaluate", spec, steps=",".join(map(str, inp.steps))), \
            fast_tier.lease(spec.storage.fast, spec.run_id, spec.storage.durable):
        result = _evaluate(spec, inp)
        # Training is over: this machine's fast tier of the run is a cache of durable
        # commits. Deleted while the lease is held, as every deletion there is.
        fast_tier.release(spec.storage.fast, spec.run_id)
    return result


def _evaluate(spec: RunSpec, inp: EvaluateInput) -> EvaluateResult:
    workdir = os.path.join(fast_tier.run_dir(spec.storage.fast, spec.run_id), "eval",
                           f"attempt-{activity.info().attempt}")
    os.makedirs(workdir, exist_ok=True)
    spec_file, out = os.path.join(workdir, "spec.json"), os.path.join(workdir, "eval.json")
    with open(spec_file, "w") as f:
        json.dump(inp.spec, f)
    cmd = [sys.executable, "-m", "trainer.evaluate",
           "--spec", spec_file, "--dataset", inp.dataset_uri,
           "--steps", ",".join(map(str, inp.steps)), "--workdir", workdir, "--out", out]
    run_child(cmd, workdir, child_env(child_trace_env()),
              Supervision(heartbeat=activity.heartbeat, is_cancelled=activity.is_cancelled))
    with open(out) as f:
        points = [EvalPoint(**r) for r in json.load(f)["results"]]
    with EventLog(spec.storage.durable, spec.run_id, "evaluator") as events:
        for p in points:
            events.emit("eval", step=p.step, event_id=f"eval/{p.step}", val_loss=p.val_loss,
                        perplexity=p.perplexity if math.isfinite(p.perplexity) else None)
    return EvaluateResult(results=points)
