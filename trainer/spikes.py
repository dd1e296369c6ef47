"""Loss-spike detector: a pure function of (state, step, loss) -> (state, Verdict).

Robust running statistics over the last `window` *accepted* losses: the baseline is
their median and the spread the larger of 1.4826 x MAD (the normal-consistent scale,
Rousseeuw & Croux 1993) and their standard deviation; spikes are never accepted, so one
cannot drag the baseline or the spread towards itself. Verdicts:

- `ok`       — within `skip_threshold` robust deviations, or still warming up;
- `skip`     — a non-finite loss, or one outlier: do not apply this batch's update;
- `rollback` — `patience` outliers inside the window: a sustained spike; restore the last
               checkpoint before `onset` and skip the data window around it (PaLM, §5.1),
               or what the spike's diagnosis names instead (`what_to_skip`).

After an outlier the loss must *return towards the baseline* (within `return_threshold`
robust deviations): a loss above that but under the skip threshold still counts as an
outlier (`no_return_to_baseline`), so a bad update whose damage decays slowly still ends in
a rollback. `patience` returned losses in a row forget the outliers, so an isolated skip
(a NaN, one bad batch) never joins a later, unrelated spike.

The state is a small frozen dataclass, saved in every checkpoint with the TrainState, so
resume reproduces the same verdicts as never stopping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from statistics import median

from spec import SpikeConfig

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution x 1.4826 = its standard deviation


@dataclass(frozen=True, kw_only=True)
class DetectorState:
    history: tuple[float, ...] = ()  # last `window` accepted losses, oldest first
    seen: int = 0  # losses observed (accepted or not)
    outliers: tuple[int, ...] = ()  # steps of recent outliers, inside the window
    calm: int = 0  # losses back near the baseline in a row since the last outlier

    def to_dict(self) -> dict:
        return {"history": list(self.history), "seen": self.seen, "outliers": list(self.outliers),
                "calm": self.calm}

    @classmethod
    def from_dict(cls, raw: dict) -> DetectorState:
        return cls(history=tuple(raw["history"]), seen=raw["seen"],
                   outliers=tuple(raw["outliers"]), calm=int(raw.get("calm", 0)))


@dataclass(frozen=True, kw_only=True)
class Verdict:
    action: str  # ok | skip | rollback
    step: int
    loss: float
    baseline: float | None = None
    spread: float | None = None
    threshold: float | None = None
    reason: str = ""
    onset: int | None = None  # rollback: the first outlier step of the sustained spike
    evidence: dict = field(default_factory=dict)


def robust_stats(values: tuple[float, ...], min_spread: float) -> tuple[float, float]:
    """(median, spread): the spread is the larger of 1.4826 x MAD and the standard deviation
    of the accepted losses, floored so a flat history cannot make z infinite.

    MAD alone ignores the heavy right tail that per-batch losses of real text have (hard
    documents cluster): with small batches it made one clean batch in ~2000 a 6-sigma
    "outlier" (benchmarks/spikes.py). Outliers never enter the history, so the standard
    deviation stays robust to the spikes themselves.
    """
    mid = median(values)
    mad = median(abs(v - mid) for v in values)
    return mid, max(MAD_TO_SIGMA * mad, std(values), min_spread * max(abs(mid), 1.0))


def std(values: tuple[float, ...]) -> float:
    """Population standard deviation, two passes over exact float sums (math.fsum). The
    step loop calls it every step: statistics.pstdev's exact rational arithmetic cost
    ~45 us over a 50-loss window, this ~6 us, equal to it within a few ulps."""
    n = len(values)
    mean = math.fsum(values) / n
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / n)


def observe(state: DetectorState, step: int, loss: float,
            cfg: SpikeConfig) -> tuple[DetectorState, Verdict]:
    """Judge one training loss; return the new state and the verdict with its evidence."""
    recent = tuple(s for s in state.outliers if step - s < cfg.window)
    if not math.isfinite(loss):
        return _outlier(state, step, loss, recent, "non_finite_loss", {}, cfg)
    if state.seen < cfg.warmup or len(state.history) < 2:
        return _accept(state, loss, cfg, recent), Verdict(action="ok", step=step, loss=loss,
                                                          reason="warming_up")
    baseline, spread = robust_stats(state.history, cfg.min_spread)
    threshold = baseline + cfg.skip_threshold * spread
    judged = {"baseline": baseline, "spread": spread, "threshold": threshold}
    if loss > threshold:
        return _outlier(state, step, loss, recent, "outlier", judged, cfg)
    if recent and loss > baseline + cfg.return_threshold * spread:
        return _outlier(state, step, loss, recent, "no_return_to_baseline", judged, cfg)
    calm = state.calm + 1 if recent else 0
    if calm >= cfg.patience:  # back to normal: forget the outliers
        recent, calm = (), 0
    new = replace(_accept(state, loss, cfg, recent), calm=calm)
    return new, Verdict(action="ok", step=step, loss=loss, **judged)


def _outlier(state: DetectorState, step: int, loss: float, recent: tuple[int, ...],
             reason: str, judged: dict, cfg: SpikeConfig) -> tuple[DetectorState, Verdict]:
    """Not accepted into the baseline; `patience` of them inside the window -> rollback."""
    outliers = recent + (step,)
    new = replace(state, seen=state.seen + 1, outliers=outliers, calm=0)
    if len(outliers) >= cfg.patience:
        return new, Verdict(action="rollback", step=step, loss=loss, onset=outliers[0],
                            reason="sustained_spike",
                            evidence={"outlier_steps": list(outliers), "last_reason": reason},
                            **judged)
    return new, Verdict(action="skip", step=step, loss=loss, reason=reason, **judged)


def _accept(state: DetectorState, loss: float, cfg: SpikeConfig,
            recent: tuple[int, ...]) -> DetectorState:
    return DetectorState(history=(state.history + (loss,))[-cfg.window:], seen=state.seen + 1,
                         outliers=recent, calm=state.calm)


def reset_window(state: DetectorState) -> DetectorState:
    """After a rollback: forget the outliers (the baseline of accepted losses stays)."""
    return replace(state, outliers=(), calm=0)


def skip_range(onset: int, cfg: SpikeConfig, times_in_region: int = 1,
               batches_per_step: int = 1) -> tuple[int, int]:
    """Data batches [start, end) to skip around a spike whose onset step read batch `onset`.

    `skip_before` steps before the onset and `skip_window` steps from there, in batches
    (`batches_per_step` = gradient accumulation); a repeat in the same region doubles it.
    """
    width = cfg.skip_window * batches_per_step * (2 ** (times_in_region - 1))
    start = max(0, onset - cfg.skip_before * batches_per_step)
    return start, start + width


def times_in_region(skip_ranges: list[tuple[int, int]], onset: int, cfg: SpikeConfig,
                    batches_per_step: int = 1) -> int:
    """1 + the skip ranges already within one skip window of this onset (same bad region)."""
    near = cfg.skip_window * batches_per_step
    return 1 + sum(1 for a, b in skip_ranges if a - near <= onset <= b + near)


def maskable(tokens: int, batch_tokens: int, seq_len: int) -> bool:
    """Pure: documents of `tokens` tokens together can be masked (no target on their tokens)
    and every micro-batch of `batch_tokens` slots still keeps at least one sequence's worth
    of other tokens to score: a micro-batch left with no target at all would make a NaN
    loss, which the detector would take for another spike."""
    return 0 < tokens <= batch_tokens - seq_len


def what_to_skip(verdict: str | None, documents: tuple[int, ...] | list[int], *,
                 maskable: bool, repeat: bool) -> str:
    """What a rollback skips, from its spike's diagnosis (trainer/diagnosis.py; None: none
    was possible): "documents" (a `data` verdict that accuses documents, few enough to mask:
    they train nothing from now on, the window's other data trains), "nothing" (an
    `optimisation` verdict: the update was bad, not the data; `numerics`: the arithmetic
    was) or "window" (the data window: bad batches, unclear, no diagnosis). A spike again in the region of an
    earlier rollback that skipped no window gets the window: the verdict did not get past it.
    """
    if repeat:
        return "window"
    if verdict == "data" and documents and maskable:
        return "documents"
    if verdict in ("optimisation", "numerics"):
        return "nothing"
    return "window"


def uncovered(window: tuple[int, int], ranges: list[tuple[int, int]]) -> int:
    """How many cursors of `window` no range in `ranges` covers."""
    lo, hi = window
    covered = sum(max(0, min(b, hi) - max(a, lo)) for a, b in merge_ranges(ranges))
    return hi - lo - covered


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching [start, end) ranges joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overfitting(evals: list[list[float]], k: int) -> bool:
    """Validation loss rose and training loss fell across each of the last k evaluations.

    `evals` rows are [step, train_loss, val_loss], oldest first.
    """
    if len(evals) < k + 1:
        return False
    tail = evals[-(k + 1):]
    return all(b[2] > a[2] and b[1] < a[1] for a, b in zip(tail, tail[1:]))
