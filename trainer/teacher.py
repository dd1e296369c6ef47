"""`distill.teacher`: the frozen teacher a student run learns from (trainer/distill.py's loss).

Every rank loads it once per segment, beside the student's engine: the teacher run's promoted
checkpoint is fetched (once the disk is seen to hold it) and verified file by file against
its manifest, read by the bounded weights-only loader (trainer/safe_load.py: a pickle
payload is refused, never run) into a GPT of the teacher run's own model config (its stored
spec, RUN.json, no larger than `distill.max_teacher_params`: checked before the GPT is
built), then frozen and put in eval mode on this rank's device. The teacher is not wrapped
by DeepSpeed, holds no optimizer state and is not checkpointed: it is the same on every
load, and its forward is deterministic, so a resumed student segment computes the same
losses as an uninterrupted one (resume stays bitwise exact).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import structlog
import torch

from common.errors import BadConfig, BadData
from spec import RunSpec
from storage.checkpoints import CorruptCheckpoint
from storage.teacher_source import FIELD, teacher_model, teacher_source
from trainer.distill import distill_loss
from trainer.init_from import load_promoted
from trainer.merge import WeightsMisfit
from trainer.model import GPT
from trainer.safe_load import UnsafeCheckpointFile

log = structlog.get_logger(__name__)


@dataclass
class Teacher:
    """The frozen teacher and the loss it adds; what its forward costs this segment."""

    model: GPT
    alpha: float
    temperature: float
    run_id: str
    step: int
    forward_s: float = 0.0  # wall time of the teacher's forwards (host time; CUDA: queued)
    forwards: int = 0
    logits_bytes: int = 0  # the largest logits one forward held (B x T x V)

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def loss(self, student_logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
             **packed: torch.Tensor) -> torch.Tensor:
        """The student's distillation loss on one micro-batch (or chunk): the teacher reads
        the same rows, with the same per-document attention for packed rows."""
        t0 = time.perf_counter()
        with torch.no_grad():
            teacher_logits, _ = self.model(x, **packed)
        self.forward_s += time.perf_counter() - t0
        self.forwards += 1
        self.logits_bytes = max(self.logits_bytes,
                                teacher_logits.numel() * teacher_logits.element_size())
        return distill_loss(student_logits, teacher_logits, y, alpha=self.alpha,
                            temperature=self.temperature)

    def cost(self, steps: int) -> dict[str, float | int | str]:
        """The `teacher_cost` event's payload: the teacher's forward time per step and the
        memory it adds: its weights, and the logits of one micro-batch (B x T x V)."""
        return {"teacher": f"{self.run_id}@{self.step}", "steps": steps,
                "forward_s_per_step": round(self.forward_s / max(steps, 1), 5),
                "weight_bytes": self.weight_bytes, "logits_bytes": self.logits_bytes,
                "params": self.model.param_count()}


def load_teacher(spec: RunSpec, vocab_size: int, device: torch.device, workdir: str,
                 rank: int = 0) -> Teacher:
    """The teacher `spec.distill.teacher` names, loaded, frozen and in eval mode. `rank`:
    each rank fetches into a directory of its own (the ranks of a node share `workdir`)."""
    source = teacher_source(spec)  # checked on the data worker already (activities/data.py)
    # The stored section is the bucket's: bounded again here before anything is allocated.
    # Every weight is loaded over the random init. Its kernels are this machine's (a teacher
    # trained with flash attention or compiled blocks runs here too; the weights are the
    # same either way).
    cfg = dataclasses.replace(teacher_model(spec, source, vocab_size), attention="auto",
                              activation_checkpointing=False, compile=False)
    model = GPT(cfg, vocab_size, seed=0)
    try:
        load_promoted(model, source, os.path.join(workdir, "teacher", f"rank{rank}"))
    except WeightsMisfit as exc:  # the vocabulary: the teacher's dataset is not this one
        raise BadConfig(FIELD, f"run {source.run_id}'s promoted step {source.step} does not "
                        f"fit this dataset ({str(exc)[:300]})", "distil on the dataset "
                        "the teacher was trained on (the same data section)") from None
    except (CorruptCheckpoint, UnsafeCheckpointFile) as exc:  # the same on every retry
        raise BadData(source.uri, f"the teacher, run {source.run_id}'s promoted checkpoint, "
                      f"cannot be loaded: {exc}", "promote a good checkpoint of that run "
                      "again, or name another teacher") from None
    model.requires_grad_(False)
    model.eval()
    model.to(device)
    d = spec.distill
    log.info("teacher_loaded", teacher_run=source.run_id, teacher_step=source.step,
             params=model.param_count(), alpha=d.alpha, temperature=d.temperature)
    return Teacher(model=model, alpha=d.alpha, temperature=d.temperature,
                   run_id=source.run_id, step=source.step)
