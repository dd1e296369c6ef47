"""What the step loop measures for the worker's Prometheus series (gradient norm, memory,
exposed communication: what an operator needs to tell a slow or unstable run from a healthy
one), beyond the throughput Meter: the fields a `step` progress line adds
(common/protocol.py StepLine).

- `grad_norm`, every step: DeepSpeed's own (`engine.get_global_grad_norm()`, which its
  bf16, fp16 and ZeRO optimizers keep, and at ZeRO 0 in fp32 the norm its clipping computed:
  trainer/engine.py keeps it), else — an engine that keeps none, a run without clipping —
  the 2-norm of the gradients as they stand before the update: all-reduced across ranks
  (DeepSpeed reduces them in the last backward) and not yet clipped, as DeepSpeed's own
  figure is. Reading it costs one host sync after the update on a GPU (Megatron's logging
  pays the same).
- `mem_by_rank`, every `ops.metrics_every` steps: [rank, peak allocated, peak reserved]
  bytes of each rank of this node (its leader writes the node's progress file), gathered
  in one small all-gather; on CPU [rank, peak RSS, current RSS].
- `comm_exposed_s` / `comm_exposed_frac`, every `ops.profile_every` steps (0: never), on
  rank 0: that step runs under torch.profiler and trainer/overlap.py measures how much of
  it was communication no computation hid.

Every rank calls the same methods at the same steps (the all-gather needs all of them).

`OwnerClock` is where each step's wall time goes, owner by owner (trainer/loop.py laps it
at every hand-over: the probes, the spike judge, the progress line, the checkpoints, ...):
gapless perf_counter deltas, so an iteration's owners add up to its loop period. Always on
(a dozen perf_counter calls and list stores a step: a few microseconds against steps of
tens of milliseconds); the segment's figures are written once, at its end, to
`step_owners.json` in the workdir (benchmarks/overhead.py itemises the loop's cost from it).
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import time

import structlog
import torch
import torch.distributed as dist

from trainer.context import SegmentContext
from trainer.overlap import exposed_comm_us, ops_from_profile, overlap_fraction
from trainer.throughput import peak_memory_bytes

log = structlog.get_logger(__name__)


def memory_bytes(device: torch.device) -> list[int]:
    """[peak allocated, peak reserved] on CUDA; [peak RSS, current RSS] of this process on CPU."""
    if device.type == "cuda":
        return [int(torch.cuda.max_memory_allocated(device)),
                int(torch.cuda.max_memory_reserved(device))]
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    now = rss_bytes() or peak
    return [max(peak, now), now]  # the kernel's high-water mark can trail /proc's count


def rss_bytes() -> int | None:
    """This process's resident set size now (Linux /proc), None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def grad_norm(parameters) -> torch.Tensor | None:
    """The 2-norm of the gradients present, on their device (no host sync); None if none."""
    grads = [p.grad.detach().float() for p in parameters if p.grad is not None]
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


# The owners a step's wall time is laid out on, in the order trainer/loop.py meets them.
OWNERS = ("probe", "other", "forward_backward", "loss_and_stop", "judge", "update", "report",
          "resolve", "checkpoints", "faults", "evaluator", "stopper")
RECENT_STEPS = 512  # medians are over the segment's last RECENT_STEPS steps


class OwnerClock:
    """Per-owner wall time of the step loop. `start()` before the first step, `lap(owner)`
    at the end of each owner's work (the time since the previous lap is that owner's),
    `end_step()` once per iteration; `summary()` the segment's figures."""

    def __init__(self) -> None:
        self.steps = 0
        self.total = dict.fromkeys(OWNERS, 0.0)
        self.recent = {owner: [0.0] * RECENT_STEPS for owner in OWNERS}
        self._step = dict.fromkeys(OWNERS, 0.0)
        self._t = time.perf_counter()

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, owner: str) -> None:
        now = time.perf_counter()
        self._step[owner] += now - self._t
        self._t = now

    def end_step(self) -> None:
        slot, step = self.steps % RECENT_STEPS, self._step
        for owner in OWNERS:
            self.total[owner] += step[owner]
            self.recent[owner][slot] = step[owner]
            step[owner] = 0.0
        self.steps += 1

    def summary(self) -> dict:
        return owner_summary(self.total, self.recent, self.steps)


def owner_summary(total: dict[str, float], recent: dict[str, list[float]], steps: int) -> dict:
    """Pure: per owner, milliseconds per step — the mean over every step and the median over
    the last RECENT_STEPS — and the loop period (the owners' sum) the same two ways."""
    kept = min(steps, RECENT_STEPS)
    if not kept:
        return {"steps": 0, "mean_ms": {}, "median_ms": {}, "period_ms": {}}
    periods = [sum(recent[o][i] for o in OWNERS) for i in range(kept)]
    return {"steps": steps,
            "mean_ms": {o: round(total[o] / steps * 1e3, 4) for o in OWNERS},
            "median_ms": {o: round(statistics.median(recent[o][:kept]) * 1e3, 4)
                          for o in OWNERS},
            "period_ms": {"mean": round(sum(total.values()) / steps * 1e3, 4),
                          "median": round(statistics.median(periods) * 1e3, 4)}}


def write_owner_times(path: str, summary: dict) -> None:
    """The segment's `step_owners.json` (one small file, written once at its end)."""
    with open(path, "w") as f:
        json.dump(summary, f)


def finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class StepProbe:
    """train_step calls begin(step) first, before_update(engine) just before engine.step(),
    then — each on a line of its own, since each may wait — grad_norm(engine) (a host sync
    on a GPU), memory(step) (an all-gather every ops.metrics_every steps) and overlap(step)
    (a device synchronize on a profiled step)."""

    def __init__(self, ctx: SegmentContext, engine) -> None:
        self.ctx, self.device = ctx, torch.device(engine.device)
        self.profile_every = ctx.spec.ops.profile_every if ctx.rank == 0 else 0
        self.memory_every = ctx.spec.ops.metrics_every
        self.own_norm = True  # until DeepSpeed shows it keeps the norm itself (first step)
        self._params = list(engine.module.parameters())  # the same objects all segment long
        self._norm: torch.Tensor | None = None
        self._prof = None
        self._t0 = 0.0

    def begin(self, step: int) -> None:
        if not (self.profile_every and step % self.profile_every == 0):
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        try:
            self._prof = profile(activities=activities)
            self._prof.start()
        except RuntimeError as exc:  # another profiler active, no kineto: stop sampling
            log.warning("step_profile_unavailable", step=step, error=str(exc)[:300])
            self._prof, self.profile_every = None, 0
        self._t0 = time.perf_counter()

    def before_update(self, engine) -> None:
        self._norm = grad_norm(self._params) if self.own_norm else None

    def grad_norm(self, engine) -> float | None:
        """The step's gradient norm on the host: DeepSpeed's own, else the one measured
        before the update. A host sync on a GPU."""
        kept = engine.get_global_grad_norm()
        if kept is not None:
            self.own_norm = False
            return finite(float(kept))
        return finite(float(self._norm)) if self._norm is not None else None

    def peak_memory(self) -> int:
        """The step line's peak_mem_bytes (a counter read: no sync, every step)."""
        return peak_memory_bytes(self.device)

    def memory(self, step: int) -> list[list[int]] | None:
        """Every ops.metrics_every steps, each rank of this node's memory (an all-gather on
        every rank); None on the other steps."""
        return self._memory() if step % self.memory_every == 0 else None

    def overlap(self, step: int) -> dict:
        """On a profiled step, its exposed communication (a device synchronize first);
        {} on the others."""
        if self._prof is None:
            return {}
        prof, self._prof = self._prof, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's kernels end inside the window
        step_s = time.perf_counter() - self._t0
        try:
            prof.stop()
            exposed_s = exposed_comm_us(ops_from_profile(prof)) / 1e6
        except Exception as exc:  # a measurement must not fail the step: sampling stops
            log.warning("step_profile_failed", step=step, error=repr(exc)[:300])
            self.profile_every = 0
            return {}
        log.info("step_profiled", step=step, step_s=round(step_s, 4),
                 comm_exposed_s=round(exposed_s, 6))
        return {"comm_exposed_s": round(exposed_s, 6),
                "comm_exposed_frac": overlap_fraction(exposed_s, step_s)}

    def _memory(self) -> list[list[int]]:
        ctx = self.ctx
        mine = memory_bytes(self.device)
        if ctx.world == 1:
            return [[0, *mine]]
        t = torch.tensor(mine, dtype=torch.int64, device=ctx.comm_device())
        parts = [torch.empty_like(t) for _ in range(ctx.world)]
        dist.all_gather(parts, t)
        procs = ctx.world // ctx.nnodes  # torchrun: rank = node rank x procs + local rank
        first = ctx.node_rank * procs
        return [[rank, *(int(v) for v in parts[rank].tolist())]
                for rank in range(first, first + procs)]
