"""A run's static summary and details: what the Temporal Web UI lists for a TrainingRun the
starter named (`mainspring run start`, ops/client.py:start_run; any client may pass the same
to `temporal workflow start --static-summary/--static-details`). Fixed at start; the live
headline is the workflow's memo and current details (workflows/headline.py). Pure, stdlib.
"""

from __future__ import annotations

from spec.run import RunSpec


def static_summary(spec: RunSpec) -> str:
    """One line: `my-run: 160 steps of a 2×128 GPT on stdlib:*.py, sweep 2×15 steps`."""
    m, t = spec.model, spec.train
    sweep = (f", sweep {spec.sweep.trials}×{spec.sweep.trial_steps} steps"
             if spec.sweep.enabled else "")
    nodes = f" on {t.nodes} nodes" if t.nodes > 1 else ""
    return (f"{spec.run_id}: {t.total_steps} steps of a {m.n_layers}×{m.d_model} GPT on "
            f"{spec.data.corpus}{nodes}{sweep}")


def static_details(spec: RunSpec) -> str:
    """Markdown: where the run's record is, how to follow and steer it, its spec hash, and
    a layout other than "dp" with the planner's reasons where "auto" chose it."""
    rid = spec.run_id
    lay = spec.train.layout
    layout = [] if isinstance(lay, str) else [
        f"layout: TP {lay.tp} × PP {lay.pp}, ZeRO {lay.zero}"
        + (" — planned: " + "; ".join(lay.why[1:]) if lay.why else "")]
    return "\n\n".join([
        f"**{rid}** · spec `{spec.spec_hash()}` · store `{spec.storage.durable}`", *layout,
        "live headline: the memo and Current Details (`temporal workflow metadata "
        f"--workflow-id {rid}`); status: `temporal workflow query --workflow-id {rid} "
        "--type status`",
        f"events: `mainspring events {rid} --durable {spec.storage.durable}`; "
        f"report: `mainspring report {rid} --durable {spec.storage.durable}`"])
