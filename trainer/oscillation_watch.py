"""The step loop's answer to a loss that shakes rather than spikes (trainer/oscillation.py
holds the math): it samples the gradient noise scale, judges every accepted loss, and acts.

- The gradient noise scale is sampled every `spikes.oscillation.noise_every` steps from the
  gradients the step computes anyway: the squared norm of the first micro-batch's gradient
  (read from the parameters' `.grad` after its backward, x the accumulation, since the
  engine divides each micro-batch's loss by it) is |G_small|^2 at B_small = the micro-batch
  (its sequences on one rank, the mean over ranks taken), and the squared norm of the
  step's whole gradient before clipping is |G_big|^2 at B_big = the global batch (after the
  last backward, where DeepSpeed all-reduces). Only where those `.grad`s are the
  gradients: DeepSpeed's plain fp32 ZeRO-0 path with more than one micro-batch per step
  (bf16, fp16 and ZeRO keep them in their own buffers; with one micro-batch the first
  gradient is already reduced). Elsewhere the figure is null with the reason.
- On an oscillation (`oscillation_detected`, with the figures, the action and why):
  `raise_batch` records the gradient accumulation asked for in the segment's outcome, never
  past the run's one bound (spec/spikes.py batch_bound, which a raised segment's spec
  holds; at the bound the next answer is taken instead); the engine cannot change its
  accumulation mid-segment, so the segment stops after the step on a committed one
  (trainer/stopping.py) and the workflow launches the next with it
  (workflows/carry_updates.py `raise_batch`: a larger global batch, the data order kept);
  `lower_lr` multiplies the LR by `lr_factor` for `lr_steps` steps from the next step (a
  window of the LR schedule, as the workflow's escalation and `set_lr_scale` are; the event
  is flushed at once and a segment's start reads the windows back: `recorded_lr_windows`);
  `data` (it shakes again under such a window) returns a rollback verdict, which the spike
  guard applies: restore before the block, skip its data window; once per window, and
  `none` after that (recorded, nothing changed: a person's call).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from common.protocol import SegmentOutcome
from spec.spikes import batch_bound
from trainer import oscillation
from trainer.context import SegmentContext
from trainer.engine import plain_fp32
from trainer.oscillation import NoiseScale, OscillationState, Reading, noise_scale, remedy
from trainer.pipeline import is_pipeline
from trainer.spikes import Verdict
from trainer.step_metrics import grad_norm
from trainer.tensor_parallel import engine_tp

log = structlog.get_logger(__name__)

NOISE_SAMPLES = 8  # the latest samples averaged into B_simple
Window = tuple[int, int, float]


@dataclass
class NoiseSample:
    """One step's two squared gradient norms, on the device until `OscillationWatch.add`."""

    step: int
    micro_batches: int
    small: torch.Tensor | None = None
    big: torch.Tensor | None = None

    def after_micro_batch(self, engine, index: int) -> None:
        """Called by trainer/loop.py forward_backward after each micro-batch's backward."""
        if index == 0:
            self.small = squared(engine) * self.micro_batches ** 2
        if index == self.micro_batches - 1:
            self.big = squared(engine)


def squared(engine) -> torch.Tensor:
    norm = grad_norm(engine.module.parameters())
    return torch.zeros(()) if norm is None else norm.float() ** 2


def unmeasured(engine, micro_batches: int, every: int) -> str:
    """Why this segment cannot sample the gradient noise scale ('' it can)."""
    if not every:
        return "spikes.oscillation.noise_every is 0"
    if is_pipeline(engine):
        return ("pipeline parallelism: the stages run the step's micro-batches inside "
                "DeepSpeed's schedule, with no gradient to read between them")
    if engine_tp(engine) > 1:
        return ("tensor parallelism: a rank's gradient is its shards' and the replicated "
                "parameters', not the model's, so the noise scale's norms would mix them")
    if micro_batches < 2:
        return ("one micro-batch per step (train.grad_accum 1): no gradient before the "
                "all-reduce to compare the step's with")
    if not plain_fp32(engine):
        return "DeepSpeed keeps this run's gradients (bf16, fp16 or ZeRO) in its own buffers"
    return ""


class OscillationWatch:
    """The noise samples (`sample_at`, `add`), the judgement of each accepted loss and the
    answer to an oscillation (`observe`), and a rollback's reset (`restored`)."""

    def __init__(self, ctx: SegmentContext, engine, outcome: SegmentOutcome,
                 emit: Callable[..., None]) -> None:
        self.ctx, self.outcome, self.emit = ctx, outcome, emit
        self.cfg = ctx.spec.spikes.oscillation
        self.on = ctx.spec.spikes.enabled and self.cfg.enabled  # spike handling off: this too
        t = ctx.spec.train
        self.rows = t.micro_batch_tokens // ctx.spec.model.seq_len  # per micro-batch, rank
        # the run's one bound: after a raise the segment's spec holds it (max_grad_accum,
        # workflows/carry_updates.py segment_spec), never re-derived from the raised value
        self.accum, self.max_accum = t.grad_accum, batch_bound(t.grad_accum, self.cfg)
        self.batch = self.rows * t.grad_accum * ctx.world  # the global batch, in sequences
        self.why_unmeasured = unmeasured(engine, t.grad_accum, self.cfg.noise_every)
        self.state = OscillationState()
        self.samples: list[tuple[float, float]] = []  # (|G_small|^2, |G_big|^2)
        self.pending: tuple[int, float, float] | None = None
        self.schedule = None  # trainer/schedule.py LRSchedule: where a lowered LR goes
        self.windows: list[Window] = []  # LR windows oscillations set (this run's)
        self.requested: int | None = None  # the gradient accumulation asked for
        self.tried: set[Window] = set()  # LR windows under which the data path was taken

    # ---- the gradient noise scale --------------------------------------------------------
    def sample_at(self, step: int) -> NoiseSample | None:
        """A sample to fill during `step`'s forward/backward, or None (not due, or not
        measurable here). A function of the step: every rank samples the same steps."""
        if self.why_unmeasured or not self.on or step % self.cfg.noise_every:
            return None
        return NoiseSample(step=step, micro_batches=self.accum)

    def add(self, sample: NoiseSample | None) -> None:
        """Collective on a sampled step (world > 1): the first micro-batch's squared norm,
        averaged over ranks. Kept until the step's verdict: only an accepted step counts."""
        if sample is None or sample.small is None or sample.big is None:
            return
        small = self.ctx.mean_over_ranks(sample.small)
        self.pending = (sample.step, small, float(sample.big))

    def noise(self) -> NoiseScale | None:
        if not self.samples:
            return None
        n = len(self.samples)
        return noise_scale(sum(s for s, _ in self.samples) / n, sum(b for _, b in self.samples)
                           / n, b_small=self.rows, b_big=self.batch)

    # ---- each accepted loss ------------------------------------------------------------
    def observe(self, step: int, loss: float, verdict: Verdict) -> Verdict:
        """After the spike verdict: an accepted loss joins the oscillation detector; an
        oscillation is answered. Returns the step's final verdict (a rollback on the data
        path, else the one given)."""
        if not self.on or verdict.action != "ok" or not math.isfinite(loss):
            return verdict
        if self.pending is not None and self.pending[0] == step:
            self.samples = (self.samples + [self.pending[1:]])[-NOISE_SAMPLES:]
        self.pending = None
        self.state, reading = oscillation.observe(self.state, step, loss, self.cfg)
        if reading is None or not reading.oscillating:
            return verdict
        self.state = oscillation.restart_block(self.state)  # the next block follows the answer
        return self.answer(reading, verdict)

    def answer(self, reading: Reading, verdict: Verdict) -> Verdict:
        step, noise = reading.step, self.noise()
        b_simple = noise.b_simple if noise else None
        lowered = [w for w in self.windows if w[0] < step <= w[1]]
        found = remedy(b_simple=b_simple, batch=self.batch, grad_accum=self.accum,
                       max_grad_accum=self.max_accum, batch_requested=self.requested is not None,
                       lr_lowered=bool(lowered), data_tried=bool(set(lowered) & self.tried),
                       cfg=self.cfg)
        record = {"action": found.action, "why": found.why, "window": [reading.start, step],
                  "variance": reading.variance, "reference": reading.reference,
                  "variance_ratio": reading.ratio, "ratio_threshold": self.cfg.ratio,
                  "loss_level": reading.level,
                  "b_simple": finite(b_simple), "b_simple_unit": "sequences",
                  "gradient_sq": noise.gradient_sq if noise else None,
                  "noise_trace": noise.trace if noise else None,
                  "noise_samples": len(self.samples),
                  "noise_unmeasured": self.why_unmeasured or (
                      "" if noise else "no usable sample yet" if not self.samples
                      else "the noise estimate is not positive"),
                  "batch": self.batch, "grad_accum": self.accum, "grad_accum_asked": None,
                  "grad_accum_bound": self.max_accum,
                  "lr_window": None}
        if found.action == "raise_batch":
            self.requested = record["grad_accum_asked"] = found.grad_accum
            self.outcome.grad_accum_asked = found.grad_accum  # the segment stops on it
        elif found.action == "lower_lr":
            window = (step, step + self.cfg.lr_steps, self.cfg.lr_factor)
            self.lower_lr(window)
            record["lr_window"] = list(window)
        self.emit("oscillation_detected", step, f"oscillation_detected/{step}", **record)
        log.warning("oscillation_detected", step=step, **{k: record[k] for k in (
            "action", "variance_ratio", "b_simple", "batch", "grad_accum_asked", "lr_window")})
        if found.action != "data":
            return verdict
        self.tried.update(lowered)  # the data path, once per LR window
        return Verdict(action="rollback", step=step, loss=verdict.loss, reason="oscillation",
                       onset=reading.start, evidence={"variance_ratio": reading.ratio,
                                                      "block": [reading.start, step]})

    def lower_lr(self, window: Window) -> None:
        self.windows.append(window)
        if self.schedule is not None:
            self.schedule.windows = tuple(self.schedule.windows) + (window,)

    def restored(self) -> None:
        """After a rollback: the block being filled belongs to the abandoned trajectory."""
        self.state, self.pending = oscillation.restart_block(self.state), None


def finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def recorded_lr_windows(ctx: SegmentContext) -> list[Window]:
    """The LR windows of every `lower_lr` oscillation answer in the run's event log (flushed
    at each decision): a segment after it, or a restart before the next commit, keeps the
    lowered LR for the same steps."""
    events = ctx.read_events(("oscillation_detected",))
    return [(int(w[0]), int(w[1]), float(w[2])) for e in events
            if (w := e["payload"].get("lr_window"))]
