"""Fault injection for tests, benchmarks and the demo (`RunSpec.faults`). Never active
unless the spec asks for it. Every fault is the real failure, not a simulation of its
symptoms downstream:

- `kill_worker` SIGKILLs the supervising worker process — what a lost node produces —
  after flushing a `fault` event with its evidence;
- `corrupt_batches` replaces the batches that given steps read (in the original data order)
  with random tokens — bad data: it is there again on every replay and retry, so only
  skipping that data window gets past it;
- `lr_burst` multiplies the LR for a few steps, once per process (a transient bad update);
- `nan_loss` makes one step's loss (and so its gradients) NaN, once per process;
- `crash` raises in one step on every attempt (a bug), while its file exists (on the
  node `node` names only, when it names one: a bad host);
- `memory_limit` caps each rank's data segment (RLIMIT_DATA) a fixed headroom above what
  it holds when training starts: an allocation past it fails for real (an OOM);
- `corrupt_grad` makes one gradient element NaN on one rank, once, inside that rank's
  optimizer step: after DeepSpeed has reduced (and clipped) the gradients, so the value
  differs on that rank only. Corrupting it in backward instead would go through the
  all-reduce and reach every rank alike. At ZeRO 0 that rank's weights then differ from
  the others'; at ZeRO 1-2 the rank updates its own partition with it and the all-gather
  hands the NaN weights to every rank.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from collections.abc import Iterable

import structlog
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from common.faults import Fault, record_fault
from common.procs import NODE_ENV, WORKER_PID_ENV
from spec import FaultSpec
from trainer.optim import SkippableAdamW
from trainer.replicas import BITS

log = structlog.get_logger(__name__)



def due_faults(faults: Iterable[FaultSpec], step: int, attempt: int) -> list[FaultSpec]:
    """kill_worker faults that fire right after `step` completes on this activity attempt."""
    return [f for f in faults
            if f.kind == "kill_worker" and f.at_step == step and f.attempt == attempt]


def corrupt_cursors(faults: Iterable[FaultSpec], batches_per_step: int) -> list[tuple[int, int]]:
    """[start, end) data cursors holding corrupted batches: the batches steps at_step ..
    at_step+steps-1 read when nothing is skipped (step s reads cursors s*b .. s*b+b-1)."""
    return [((f.at_step - 1) * batches_per_step, (f.at_step - 1 + f.steps) * batches_per_step)
            for f in faults if f.kind == "corrupt_batches"]


def random_tokens(cursor: int, shape: torch.Size, vocab_size: int, seed: int) -> torch.Tensor:
    """The corrupted content of batch `cursor`: uniform random tokens, the same on replay."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + cursor)
    return torch.randint(0, vocab_size, tuple(shape), generator=g)


class FaultInjector:
    """Per-process fault state, wired into the segment once, outside the step loop:

    - `batches(source)` wraps the batch source: corrupted batches come back as random
      tokens, and the first batch of a `nan_loss` step arms the model's forward hook
      (`attach`) so that step's loss, and so its gradients, is NaN;
    - `lr_windows()` are the `lr_burst` windows, one-shot in the LR schedule
      (trainer/schedule.py: a replay after a rollback runs at the planned LR);
    - `after_step(step, ...)` is the loop's one touch: `kill_worker` after a completed step;
    - `attach` also hooks the optimizer's step for `corrupt_grad` (a pre-hook on every
      SkippableAdamW step, trainer/optim.py: what DeepSpeed calls once the gradients of
      this rank's parameters or partition are reduced and clipped).

    One-shot faults (lr_burst, nan_loss) remember that they fired, so a rollback inside the
    segment replays their steps quietly, as a transient fault would. Each fault's first
    firing is recorded as a `fault` event."""

    def __init__(self, faults: Iterable[FaultSpec], *, batches_per_step: int, vocab_size: int,
                 seed: int, attempt: int = 1, events=None, rank: int | None = None) -> None:
        self.kills = tuple(f for f in faults if f.kind == "kill_worker")
        self.faults = tuple(f for f in faults if f.kind != "kill_worker")
        self.batches_per_step, self.attempt = batches_per_step, attempt
        self.corrupt = corrupt_cursors(self.faults, batches_per_step)
        self._corrupting = [f for f in self.faults if f.kind == "corrupt_batches"]  # same order
        self.vocab_size, self.seed, self.events = vocab_size, seed, events
        self.fired: set[tuple[str, int]] = set()
        self.poisoned = False  # the forward hook's flag: this micro-batch's loss is NaN
        self.limited = False  # memory_limit applied in this process
        self.rank = global_rank() if rank is None else rank
        self.grad_armed: FaultSpec | None = None  # corrupt_grad due at the next update
        self.grad_hook = None  # the optimizer pre-hook's handle (attach)

    def _announce(self, fault: FaultSpec, step: int, **evidence) -> None:
        key = (fault.kind, fault.at_step)
        if key in self.fired:
            return
        self.fired.add(key)
        log.warning("injecting_fault", kind=fault.kind, step=step, **evidence)
        if self.events is not None:
            now = time.time()
            record_fault(self.events, Fault(
                kind=fault.kind, event_id=f"fault/{fault.kind}/{fault.at_step}", injected=True,
                detected_by="fault_injector", fault_ts=now, detected_ts=now, last_step=step,
                facts={"at_step": fault.at_step, "steps": fault.steps, **evidence}))

    # ---- the batch source ----------------------------------------------------------------
    def batches(self, source) -> FaultyBatches:
        """`source` as the step loop reads it: with this process's data faults applied."""
        return FaultyBatches(source, self)

    def batch(self, cursor: int, step: int,
              tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The batch as read, or random inputs and targets if batch `cursor` is corrupted."""
        for f, (a, b) in zip(self._corrupting, self.corrupt):
            if a <= cursor < b:
                self._announce(f, step, cursors=[a, b])
                x, y, *rest = tensors
                bad_y = torch.where(y >= 0, random_tokens(-cursor - 1, y.shape, self.vocab_size,
                                                          self.seed), y)  # keep ignore slots
                return (random_tokens(cursor, x.shape, self.vocab_size, self.seed), bad_y, *rest)
        return tensors

    def starting(self, step: int) -> None:
        """The first batch of `step` is being read: announce a burst that begins here (its
        first time: the schedule applies it then only) and arm a NaN due at this step."""
        for f in self.faults:
            if f.kind == "lr_burst" and f.at_step == step:
                self._announce(f, step, factor=f.factor)
            elif f.kind == "nan_loss" and f.at_step == step and (f.kind, step) not in self.fired:
                self._announce(f, step)
                self.poisoned = True
            elif (f.kind == "crash" and f.at_step == step and (not f.path or os.path.exists(f.path))
                  and (not f.node or os.environ.get(NODE_ENV) == f.node)):
                self._announce(f, step, path=f.path)
                raise RuntimeError(f"injected crash at step {step}")
            elif f.kind == "memory_limit" and step >= f.at_step and not self.limited:
                self.limit_memory(f, step)
            elif (f.kind == "corrupt_grad" and f.at_step == step and f.rank == self.rank
                  and (f.kind, f.at_step) not in self.fired):
                self.grad_armed = f

    def limit_memory(self, fault: FaultSpec, step: int) -> None:
        """memory_limit: from step `at_step` on (each attempt, each rank) this rank's data
        segment may grow by `mb` MiB over what it holds then."""
        held = vm_data_bytes()
        limit = held + fault.mb * 2**20
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
        self.limited = True
        self._announce(fault, step, limit_bytes=limit, held_bytes=held)

    # ---- the LR --------------------------------------------------------------------------
    def lr_windows(self) -> list[list[float]]:
        """lr_burst as one-shot LR windows [start, end, factor]: steps at_step .. at_step +
        steps - 1 (1-based) run at LR x factor the first time they run."""
        return [[f.at_step - 1, f.at_step - 1 + f.steps, f.factor]
                for f in self.faults if f.kind == "lr_burst"]

    # ---- the model -----------------------------------------------------------------------
    def attach(self, module: torch.nn.Module) -> None:
        """A forward hook that turns the loss of an armed micro-batch into NaN (a real NaN:
        the backward pass of that loss makes every gradient NaN), only with nan_loss
        faults; the optimizer pre-hook of `corrupt_grad`, only with those. A pipeline's
        module (trainer/pipeline.py) returns no loss: its last stage's `loss_fn` is
        poisoned instead (the other stages never consume the flag)."""
        if any(f.kind == "corrupt_grad" for f in self.faults) and self.grad_hook is None:
            self.grad_hook = register_optimizer_step_pre_hook(
                self._corrupt_grad)
        if not any(f.kind == "nan_loss" for f in self.faults):
            return

        def poison(_module, _inputs, output):
            if not self.poisoned:
                return output
            self.poisoned = False
            logits, loss = output
            return logits, loss * float("nan")

        if getattr(module, "loss_fn", None) is not None:  # a PipelineModule
            plain = module.loss_fn

            def poisoned_loss(outputs, targets):
                return poison(module, (), (None, plain(outputs, targets)))[1]

            module.loss_fn = poisoned_loss
            return
        module.register_forward_hook(poison)

    def _corrupt_grad(self, optimizer, _args, _kwargs) -> None:
        """The armed corrupt_grad: this rank's largest gradient element becomes NaN just
        before its update. A vetoed update (a skip) would discard it, so it waits for the
        next one that applies."""
        fault = self.grad_armed
        if fault is None or not isinstance(optimizer, SkippableAdamW) or optimizer.veto:
            return
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None and p.grad.numel()]
        if not grads:
            return
        grad = max(grads, key=lambda g: float(g.detach().abs().max()))
        index = int(grad.detach().abs().argmax())
        if fault.bit < 0:
            grad[torch.unravel_index(torch.tensor(index), grad.shape)] = float("nan")
        else:  # one bit of the element's pattern: a wrong value no loss shows
            flip_bit(grad, index, fault.bit)
        self.grad_armed = None
        self._announce(fault, fault.at_step, rank=self.rank, element=index,
                       shape=list(grad.shape), **({"bit": fault.bit} if fault.bit >= 0 else {}))

    # ---- after a step --------------------------------------------------------------------
    def after_step(self, step: int, last_committed: int | None) -> None:
        """kill_worker faults due right after `step` on this activity attempt (rank 0)."""
        for fault in due_faults(self.kills, step, self.attempt):
            kill_worker(fault, self.events, step, last_committed)


class FaultyBatches:
    """The batch source as the step loop reads it, `get(cursor, step)`: the source's batch,
    or what the injector's faults make of it (nothing, without faults in the spec)."""

    def __init__(self, source, injector: FaultInjector) -> None:
        self.source, self.injector, self.step = source, injector, 0

    def get(self, cursor: int, step: int) -> tuple[torch.Tensor, ...]:
        if step != self.step:  # the step's first micro-batch
            self.step = step
            self.injector.starting(step)
        return self.injector.batch(cursor, step, self.source.get(cursor))

    def replay(self, cursor: int, step: int) -> tuple[torch.Tensor, ...]:
        """Batch `cursor` as the loop read it (corrupted where a fault corrupts it), with no
        step's start: nothing is armed or announced again (a spike's diagnosis)."""
        return self.injector.batch(cursor, step, self.source.get(cursor))

    def documents(self, cursor: int) -> torch.Tensor | None:
        """Each slot's document number in the split; None without packed documents."""
        documents = getattr(self.source, "documents", None)
        return documents(cursor) if documents is not None else None


def global_rank() -> int:
    """This process's global rank: the process group's, else torchrun's RANK, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def vm_data_bytes() -> int:
    """This process's data segment (what RLIMIT_DATA limits), from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


def kill_worker(fault: FaultSpec, events, step: int, last_committed: int | None) -> None:
    """SIGKILL the supervising worker (what a lost node produces), its event flushed first."""
    pid = int(os.environ.get(WORKER_PID_ENV, "0"))
    if pid <= 1:
        log.warning("fault_skipped", kind=fault.kind, reason=f"{WORKER_PID_ENV} not set")
        return
    now = time.time()
    record_fault(events, Fault(
        kind="kill_worker", event_id=f"fault/kill_worker/{fault.at_step}/{fault.attempt}",
        injected=True, detected_by="fault_injector", fault_ts=now, detected_ts=now,
        last_step=step, evidence=f"SIGKILL to trainer worker pid {pid} after step {step}; "
                                 f"last committed step {last_committed}"))
    events.flush()
    log.warning("injecting_fault", kind=fault.kind, step=step, worker_pid=pid)
    os.kill(pid, signal.SIGKILL)


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit `bit` of element `index` (flattened) of a contiguous float tensor, in place,
    through an integer view of its bit pattern (a bit flip in memory, as a bad accelerator
    makes one)."""
    ints = BITS[tensor.dtype]  # the fingerprint's view of the same bit patterns
    if bit >= torch.iinfo(ints).bits:
        raise ValueError(f"bit {bit} is past a {tensor.dtype} element's {torch.iinfo(ints).bits}")
    element = tensor.view(-1)[index:index + 1].view(ints)
    element ^= torch.tensor(1, dtype=ints) << bit  # the sign bit's mask wraps to the minimum
