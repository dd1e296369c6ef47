"""The warm-up sweep's plan: its rounds, each trial's run id and spec, and a spec with the
parameters a sweep chose. Deterministic and I/O-free; imported by the workflows inside the
sandbox.
"""

from __future__ import annotations

from spec import RunSpec, SweepConfig


def initial_trials(cfg: SweepConfig) -> int:
    """Round 0's size: the scaling-law prior and the sampler's start-up points (>= 2,
    >= dims + 1, as the suggest activity's n_startup_trials), at least one parallel round."""
    return min(cfg.trials, max(2, len(cfg.space) + 1, cfg.parallel))


def sweep_rounds(cfg: SweepConfig) -> list[int]:
    """Trials per round: the first round, then `parallel` suggestions at a time. Fixed in
    recorded histories (one suggest_trials local activity a round): keep it so, or patch."""
    rounds = [initial_trials(cfg)]
    while sum(rounds) < cfg.trials:
        rounds.append(min(cfg.parallel, cfg.trials - sum(rounds)))
    return rounds


def trial_run_id(run_id: str, index: int) -> str:
    return f"{run_id[:50]}-trial-{index}"


def trial_spec(spec: RunSpec, index: int, params: dict[str, float]) -> RunSpec:
    """A short run of its own (own run id and checkpoints), faults off, params applied."""
    steps = spec.sweep.trial_steps
    overrides = {f"train.{k}": (int(v) if k == "warmup_steps" else v) for k, v in params.items()}
    overrides.setdefault("train.warmup_steps", min(spec.train.warmup_steps, steps // 5))
    # one node (a trial is short), the run's global batch (workflows/gang.py)
    one_node = {"train.nodes": 1, "train.min_nodes": 0,
                "train.grad_accum": spec.train.grad_accum * spec.train.nodes}
    return spec.replace(**{"run_id": trial_run_id(spec.run_id, index), "faults": [],
                           "train.total_steps": steps, "train.segment_steps": steps,
                           "train.checkpoint_every": steps, **one_node, **overrides})


def with_params(spec: RunSpec, params: dict[str, float]) -> RunSpec:
    return spec.replace(**{f"train.{k}": (int(v) if k == "warmup_steps" else v)
                           for k, v in params.items()})
