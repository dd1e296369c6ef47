"""The step loop, shaped like torchtitan's `Trainer.train()`: one `train_step()` that returns
a typed `StepResult`, then one call per owner of what follows a step.

    train_step  → forward/backward of the step's micro-batches (a gradient noise sample
                  every so often), the verdict on its loss (trainer/guard.py), the update
                  (vetoed unless ok), the fp16 check and the oscillation watch after it
    report      → the step's progress line (its verdict final) and its tracing span
    guard       → a rollback verdict: restore before the spike's onset, skip its data
    checkpoints → maybe_save(state, last=…) (trainer/checkpoint_manager.py)
    faults      → kill_worker faults due after the step (trainer/faults.py)
    evaluator   → online evaluation every train.eval_every steps (trainer/online_eval.py)
    stopper     → should_stop(): every reason a segment ends (trainer/stopping.py)

A rollback is a step outcome like any other: every owner is called after it and handles it
(the restored step is committed already; it is neither injected nor evaluated again).
Every collective and host sync of a step sits on a line of its own, named in a comment.
Every hand-over from one owner to the next is a lap of the `OwnerClock`
(trainer/step_metrics.py): where each step's wall time went, written to the workdir's
`step_owners.json` when the segment's loop ends.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
import torch

from common.protocol import StepLine
from trainer.checkpoint_manager import CheckpointManager
from trainer.context import SegmentContext
from trainer.data import skip_past
from trainer.engine import set_lr, tokens_per_step, veto_next_update
from trainer.guard import SpikeGuard, finite_or_none
from trainer.model import IGNORE
from trainer.online_eval import OnlineEval
from trainer.oscillation_watch import NoiseSample
from trainer.pipeline import is_pipeline, pipeline_forward_backward
from trainer.spikes import Verdict
from trainer.state import TrainState
from trainer.step_metrics import OwnerClock, StepProbe, write_owner_times
from trainer.stopping import Stopper
from trainer.throughput import Meter

log = structlog.get_logger(__name__)


class BatchSource(Protocol):
    """trainer/faults.py FaultyBatches: the micro-batch at a data cursor, read for a step."""

    def get(self, cursor: int, step: int) -> tuple[torch.Tensor, ...]: ...


class FaultHook(Protocol):
    """trainer/faults.py FaultInjector's one touch after a step (kill_worker faults)."""

    def after_step(self, step: int, last_committed: int | None) -> None: ...


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """One optimizer step as train_step ran it; `verdict` is final (fp16's check included)."""

    step: int  # 1-based
    loss: float  # mean over ranks of the micro-batches' mean losses (may be non-finite)
    lr: float
    verdict: Verdict  # ok | skip | rollback: anything but ok vetoed the update
    tokens: int  # training tokens the step read, all ranks
    step_time_s: float
    tokens_per_s: float
    mfu: float | None
    stop: str = ""  # a stop request seen on any rank during the step ('' none)
    peak_mem_bytes: int | None = None
    grad_norm: float | None = None
    mem_by_rank: list[list[int]] | None = None  # every ops.metrics_every steps
    comm_exposed_s: float | None = None  # on a profiled step
    comm_exposed_frac: float | None = None

    @property
    def rolled_back(self) -> bool:
        return self.verdict.action == "rollback"

    def line(self) -> StepLine:
        """The step's `step` progress line (common/protocol.py)."""
        return StepLine(step=self.step, loss=finite_or_none(self.loss), lr=self.lr,
                        verdict=self.verdict.action, tokens_per_s=self.tokens_per_s,
                        step_time_s=self.step_time_s, mfu=self.mfu,
                        peak_mem_bytes=self.peak_mem_bytes, grad_norm=self.grad_norm,
                        mem_by_rank=self.mem_by_rank, comm_exposed_s=self.comm_exposed_s,
                        comm_exposed_frac=self.comm_exposed_frac)


@dataclass(frozen=True, kw_only=True)
class Trainer:
    """The loop's owners, built once per segment (trainer/segment.py)."""

    ctx: SegmentContext
    engine: Any  # DeepSpeed's engine (a small fake in tests/trainer/test_step_loop.py)
    batches: BatchSource
    lr: Callable[[int], float]  # the LR of a step: trainer/schedule.py LRSchedule
    meter: Meter
    probe: StepProbe
    guard: SpikeGuard
    checkpoints: CheckpointManager
    faults: FaultHook
    evaluator: OnlineEval
    stopper: Stopper
    clock: OwnerClock = field(default_factory=OwnerClock)  # where each step's time went
    # distill.teacher: the frozen teacher whose distillation loss replaces the plain
    # cross-entropy (trainer/teacher.py); None for every other run
    teacher: Any = None

    def train(self, state: TrainState) -> TrainState:
        """Optimizer steps from `state` until the stopper names a reason; returns the final
        state (the restored one when the segment ends on a rollback)."""
        ctx, checkpoints, lap = self.ctx, self.checkpoints, self.clock.lap
        reason = self.stopper.should_stop(state.step)  # resumed at the target: no step to run
        self.clock.start()
        while not reason:
            result = self.train_step(state)  # its syncs are named inside
            self.report(result)
            lap("report")
            # a rollback: the restored state (collectives: the restore's broadcasts)
            state = self.guard.resolve(result.verdict, state)
            lap("resolve")
            # collectives when due: the copies compared, a barrier, a write failure's all-reduce
            state, rolled_back = self.commit(state, result.rolled_back,
                                             last=state.step == ctx.target)
            lap("checkpoints")
            if ctx.rank == 0 and not rolled_back:  # faults fire after a step trained
                self.faults.after_step(state.step, checkpoints.last_committed_step)
            lap("faults")
            # collective when due: the validation loss all-reduced
            evaluation = self.evaluator.maybe_evaluate(state, rolled_back)
            lap("evaluator")
            reason = self.stopper.should_stop(
                state.step, rolled_back=rolled_back, signal=result.stop,
                overfitting=evaluation is not None and evaluation.overfitting)
            lap("stopper")
            self.clock.end_step()
        state, _ = self.commit(state, False, last=True)  # an early stop ends on a commit
        self.write_owner_times()
        return state

    def commit(self, state: TrainState, rolled_back: bool, *,
               last: bool) -> tuple[TrainState, bool]:
        """Commit `state` when a checkpoint is due, once the ranks' copies of the weights
        are found equal (trainer/guard.py verify_before_commit: copies that differ are
        rolled back to the last commit instead). The state the loop goes on from, and
        whether this step ended in a rollback."""
        if not rolled_back and self.checkpoints.due(state, last=last):
            restored = self.guard.verify_before_commit(state)
            rolled_back, state = restored is not state, restored
        self.checkpoints.maybe_save(state, last=last)
        return state, rolled_back

    def write_owner_times(self) -> None:
        """Rank 0: the segment's per-owner step times, once (`step_owners.json`)."""
        if self.ctx.rank != 0 or not self.clock.steps:
            return
        summary = self.clock.summary()
        write_owner_times(os.path.join(self.ctx.workdir, "step_owners.json"), summary)
        log.info("step_owners", steps=summary["steps"], period_ms=summary["period_ms"],
                 mean_ms=summary["mean_ms"])

    def train_step(self, state: TrainState) -> StepResult:
        """One optimizer step: its micro-batches forward and backward, the verdict on its
        loss, the update (vetoed unless the verdict is ok), the fp16 check after it, and
        what it measured. Advances `state` past the step."""
        ctx, engine, accum = self.ctx, self.engine, self.ctx.spec.train.grad_accum
        probe, guard, lap = self.probe, self.guard, self.clock.lap
        t0 = time.perf_counter()
        step = state.step + 1  # the step being run, 1-based
        probe.begin(step)
        lap("probe")
        set_lr(engine, lr := self.lr(step))
        first_cursor = skip_past(state.data_cursor, state.skip_ranges)
        split = ctx.args.micro_split
        noise = guard.oscillation.sample_at(step)  # a gradient noise sample due this step
        lap("other")
        loss_sum = forward_backward(engine, self.batches, state, step, accum, split, noise,
                                    self.teacher)
        lap("forward_backward")
        # collective + host sync on a noise-sampled step: a gradient norm's mean over ranks
        guard.oscillation.add(noise)
        lap("judge")
        # collective + host sync: the mean loss over ranks and any rank's stop request
        loss, stop = ctx.loss_and_stop(loss_sum / (accum * split))
        lap("loss_and_stop")
        verdict = guard.judge(state, step, loss, first_cursor)
        lap("judge")
        if verdict.action != "ok":  # skip | rollback: this batch's update is vetoed
            veto_next_update(engine)
        lap("other")
        probe.before_update(engine)
        lap("probe")
        engine.step()  # the update (a no-op when vetoed; DeepSpeed's bookkeeping still runs)
        lap("update")
        verdict = guard.after_step(step, loss, verdict)  # fp16: overflow at the min scale
        lap("judge")
        tokens = tokens_per_step(ctx.spec)
        state.step, state.tokens_seen = step, state.tokens_seen + tokens
        lap("other")
        # host sync (GPU): the gradient norm, once the update has run
        grad_norm = probe.grad_norm(engine)
        seconds = time.perf_counter() - t0
        # device synchronize (GPU), on a profiled step only: its exposed communication
        overlap = probe.overlap(step)
        # collective every ops.metrics_every steps: an all-gather of each rank's memory
        memory = probe.memory(step)
        peak = probe.peak_memory()
        lap("probe")
        result = StepResult(step=step, loss=loss, lr=lr, verdict=verdict, tokens=tokens,
                            stop=stop, **self.meter.add(tokens, seconds), peak_mem_bytes=peak,
                            grad_norm=grad_norm, mem_by_rank=memory, **overlap)
        lap("other")
        return result

    def report(self, result: StepResult) -> None:
        """The step's progress line (a node leader's file) and its `steps a-b` span."""
        line = result.line()
        self.ctx.windows.add(line)
        self.ctx.progress.write(line)


def forward_backward(engine, batches: BatchSource, state: TrainState, step: int,
                     micro_batches: int, split: int = 1,
                     noise: NoiseSample | None = None, teacher: Any = None) -> torch.Tensor:
    """Forward and backward every micro-batch of `step`, each as `split` equal chunks (an
    OOM-adapted run: the same sequences, the same global batch), advancing the data cursor
    past skipped ranges; the summed loss stays on the device (no host sync here). DeepSpeed
    wants engine.step() after each forward/backward; it updates only on the last one, which
    train_step calls itself once it has judged the loss. `noise`: a gradient noise sample
    reads the gradients after each micro-batch (trainer/oscillation_watch.py). `teacher`:
    the loss is the distillation loss against it on the same rows (trainer/teacher.py).
    A pipeline engine runs the micro-batches (chunks) through its stages itself, 1F1B, the
    loss (the teacher's, the chunk weights) on its last stage (trainer/pipeline.py; no
    noise sample there: oscillation_watch.unmeasured says why)."""
    if is_pipeline(engine):
        return pipeline_forward_backward(engine, batches, state, step, micro_batches, split,
                                         teacher)
    loss_sum = torch.zeros((), dtype=torch.float32, device=engine.device)
    passes = 0
    for index in range(micro_batches):
        state.data_cursor = skip_past(state.data_cursor, state.skip_ranges)
        tensors = [t.to(engine.device) for t in batches.get(state.data_cursor, step)]
        chunks = [tensors] if split == 1 else list(zip(*(t.chunk(split) for t in tensors)))
        weights = chunk_weights([c[1] for c in chunks])
        for (x, y, *packed), weight in zip(chunks, weights):
            if passes:
                engine.step()  # a gradient-accumulation boundary is not reached: no update
            # Packed rows also carry (position_ids, doc_ids): attention stays per document.
            kw = dict(zip(("position_ids", "doc_ids"), packed))
            if teacher is None:
                _, loss = engine(x, y, **kw)
            else:  # the logits only; the loss against the teacher's on the same rows
                loss = teacher.loss(engine(x, None, **kw)[0], x, y, **kw)
            if weight is not None:
                loss = torch.where(weight > 0, loss * weight, torch.zeros_like(loss))
            engine.backward(loss)
            loss_sum += loss.detach().float()
            passes += 1
        if noise is not None:
            noise.after_micro_batch(engine, index)
        state.data_cursor += 1
    return loss_sum


def chunk_weights(targets: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Per chunk of a split micro-batch, the factor that makes the chunks' mean losses add
    up to the whole micro-batch's mean over its scored targets (a chunk's share of them,
    times the number of chunks: DeepSpeed divides by the accumulation). None for an unsplit
    micro-batch: its loss is used as it is. On the device, no host sync."""
    if len(targets) == 1:
        return [None]
    counts = [(y != IGNORE).sum().float() for y in targets]
    total = torch.clamp(sum(counts), min=1.0)
    return [c / total * len(targets) for c in counts]
