"""The scale harness's pure parts (benchmarks/scale.py): the fault draw, time compression,
and the figures made from samples. No services, no I/O: the unit tests feed them literals.

Time: the simulation runs `compress` simulated seconds per real second. Step time and the
gaps between faults are simulated quantities and shrink by `compress`; what the
orchestrator itself takes (a heartbeat timeout, a relaunch, a Temporal round trip) is real
and is measured in real seconds, uncompressed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Llama 3 (Dubey et al. 2024, §3.3.4): 419 unexpected interruptions in a 54-day snapshot of
# pre-training on 16,384 GPUs, 8 a node: 2,048 nodes
LLAMA3_FAULTS, LLAMA3_DAYS, LLAMA3_NODES = 419, 54.0, 2048
DAY_S = 86400.0
# the kinds a strike rotates through, as the orchestrator meets them: a node's worker stops
# answering, a rank dies by a signal, a rank stops progressing, the Temporal server restarts
FAULT_KINDS = ("node_lost", "rank_lost", "hang", "server_restart")


def faults_per_node_day() -> float:
    """Llama 3's interruption rate per node per day (~0.0038)."""
    return LLAMA3_FAULTS / LLAMA3_DAYS / LLAMA3_NODES


@dataclass(frozen=True, kw_only=True)
class Compression:
    """`factor` simulated seconds per real second (>= 1)."""

    factor: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor >= 1):
            raise ValueError(f"compress: must be a number >= 1 (simulated seconds per real "
                             f"second), got {self.factor!r}; pass e.g. --compress 60")

    def real_s(self, sim_s: float) -> float:
        return sim_s / self.factor

    def sim_s(self, real_s: float) -> float:
        return real_s * self.factor


@dataclass(frozen=True)
class Strike:
    """One planned fault: when (real seconds after the train stage began) and what kind.
    Which node it hits is chosen when it strikes, among the nodes then training."""

    at_s: float
    kind: str


def fault_boost(nodes: int, days: float, want: int, asked: float = 0.0) -> float:
    """Pure: the factor on Llama 3's rate. `asked` > 0 is used as given; else (auto) the
    smallest factor >= 1 that makes `want` faults expected in `days` on `nodes` nodes: at
    the published rate a 64-node day expects 0.24 faults, too few to time a recovery."""
    if asked > 0:
        return asked
    expected = faults_per_node_day() * nodes * days
    return max(1.0, want / expected) if expected > 0 else 1.0


def draw_strikes(nodes: int, days: float, compress: Compression, boost: float,
                 kinds: tuple[str, ...] = FAULT_KINDS, seed: int = 0,
                 settle_s: float = 0.0) -> list[Strike]:
    """Pure: the faults of a run of `days` simulated days on `nodes` nodes, exponential
    gaps at Llama 3's rate x `boost`, in real seconds after the train stage began; kinds in
    rotation. `settle_s` (real) is the least gap between two strikes: a fault while the last
    one is still being recovered from measures the pile-up, not the recovery, so the next
    one waits (what the gap enforces is in the figures' inputs)."""
    if nodes < 1 or days <= 0 or boost <= 0:
        raise ValueError(f"nodes >= 1, days > 0 and boost > 0 are needed to draw faults; got "
                         f"nodes={nodes}, days={days}, boost={boost}")
    rng = random.Random(seed)
    rate_per_real_s = faults_per_node_day() * nodes * boost / compress.real_s(DAY_S)
    end = compress.real_s(days * DAY_S)
    out: list[Strike] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_real_s)
        if out and t - out[-1].at_s < settle_s:
            t = out[-1].at_s + settle_s
        if t >= end:
            return out
        out.append(Strike(round(t, 3), kinds[len(out) % len(kinds)]))


def even_strikes(count: int, span_s: float, kinds: tuple[str, ...] = FAULT_KINDS,
                 settle_s: float = 0.0) -> list[Strike]:
    """Pure: `count` faults spread evenly over `span_s` real seconds, at least `settle_s`
    apart, kinds in rotation (the quick run: a few faults for certain, where a draw at any
    rate may bring none)."""
    gap = max(span_s / (count + 1), settle_s)
    return [Strike(round((i + 1) * gap, 3), kinds[i % len(kinds)]) for i in range(count)]


def spares_for(strikes: list[Strike]) -> int:
    """Pure: nodes beyond the gang's own: one per node loss (a lost node does not come
    back within the run) and one more, so no relaunch waits for a node."""
    return sum(s.kind == "node_lost" for s in strikes) + 1


def percentile(values: list[float], q: float) -> float | None:
    """Pure: the nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def spread(values: list[float]) -> dict:
    """Pure: n, p50, p99 and max of a sample."""
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
            "max": max(values) if values else None}


def first_after(ts: float, times: list[float]) -> float | None:
    """Pure: the first of `times` after `ts` (None when none is)."""
    later = [t for t in times if t > ts]
    return min(later) if later else None


def recovery_marks(strike_ts: float, decisions: list[float], first_steps: list[float],
                   until_ts: float = math.inf) -> dict:
    """Pure: one fault's recovery in real seconds: strike -> the workflow's decision (its
    first train_segment scheduled after the strike) and -> the replacement's first step
    (the first step of a launch that started after the strike). Marks at or after
    `until_ts` (the next strike) belong to that one: None here."""
    decided = first_after(strike_ts, decisions)
    stepped = first_after(decided if decided is not None else strike_ts, first_steps)
    return {"decision_s": decided - strike_ts if decided is not None and decided < until_ts
            else None,
            "first_step_s": stepped - strike_ts if stepped is not None and stepped < until_ts
            else None}


def per_node_cost(cpu_s: float, rss_bytes: float, wall_s: float, nodes: int,
                  compress: Compression) -> dict:
    """Pure: a process's cost per node it hosts: CPU seconds per node per simulated hour,
    the share of one core per node, RSS MB per node."""
    sim_h = compress.sim_s(wall_s) / 3600.0
    return {"cpu_s_per_node_sim_hour": cpu_s / nodes / sim_h if sim_h > 0 else None,
            "cores_per_node": cpu_s / wall_s / nodes if wall_s > 0 else None,
            "rss_mb_per_node": rss_bytes / nodes / 2**20}


def machine_limit(cores_per_node: float | None, rss_mb_per_node: float, cores: float,
                  mem_mb: float) -> dict:
    """Pure: the most nodes one machine hosts at the measured per-node cost, and which of
    CPU and memory binds first."""
    by_cpu = math.floor(cores / cores_per_node) if cores_per_node else None
    by_mem = math.floor(mem_mb / rss_mb_per_node) if rss_mb_per_node > 0 else None
    limits = {k: v for k, v in (("cpu", by_cpu), ("memory", by_mem)) if v is not None}
    binding = min(limits, key=limits.get) if limits else None
    return {"max_nodes_by_cpu": by_cpu, "max_nodes_by_memory": by_mem, "binding": binding,
            "max_nodes": limits.get(binding) if binding else None}


def truth_goodput(executions: list[dict], wall_s: float) -> dict:
    """Pure: the simulation's own goodput: each step number's last execution (by its end)
    is kept; productive = their step times; goodput = that / `wall_s`. `executions`:
    {step, time_s, end}."""
    final: dict[int, dict] = {}
    for e in sorted(executions, key=lambda e: e["end"]):
        final[e["step"]] = e
    productive = sum(e["time_s"] for e in final.values())
    return {"productive_s": productive, "wall_s": wall_s, "steps_kept": len(final),
            "steps_executed": len(executions),
            "goodput": productive / wall_s if wall_s > 0 else None}


def per_day(count: float, sim_days: float) -> float | None:
    return count / sim_days if sim_days > 0 else None


def history_figures(runs: list[dict], sim_days: float, limit_events: int = 51200,
                    limit_bytes: int = 50 * 2**20) -> dict:
    """Pure: a workflow chain's history against Temporal's limits (51,200 events, 50 MB).
    `runs`: {events, bytes} per run of the chain (continue-as-new)."""
    events = sum(r["events"] for r in runs)
    largest = max(runs, key=lambda r: r["events"]) if runs else {"events": 0, "bytes": 0}
    return {"runs": len(runs), "events": events, "events_per_sim_day": per_day(events, sim_days),
            "continue_as_new_per_sim_day": per_day(max(0, len(runs) - 1), sim_days),
            "largest_events": largest["events"], "largest_bytes": largest["bytes"],
            "largest_events_of_limit": largest["events"] / limit_events,
            "largest_bytes_of_limit": largest["bytes"] / limit_bytes}
