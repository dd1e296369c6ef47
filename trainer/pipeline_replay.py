"""A spike's diagnosis under pipeline parallelism (trainer/diagnosis.py's replay, stage by
stage).

No rank of a pipeline holds the whole model, so `Replayer.replay`'s whole-model forward is
not there. `PipeReplayer.replay` runs each stage's own layers on its rank — the
`PipelineModule`'s forward, what the pipe engine runs per micro-batch — and hands the
activations to the next stage with torch.distributed point-to-point sends; the last stage
scores the logits exactly as the whole model's replay does (`diagnosis.scored`: the same
cross-entropy, ignore index and `per_document`). The position and document ids the
training tuple carries between stages are read, not sent: every stage of a pipeline reads
its replica's batches already (trainer/pipeline.py `step_batches`), so each rebuilds the
same `(x, position_ids, doc_ids)` tuple around the activations it receives, and one tensor
travels per hop. The last stage's replays then go to every stage of its pipeline, and
`pool` gathers one list per pipeline over the data-parallel group, so the verdict
(`Replayer.diagnose`, unchanged) is the same on every rank.

Why not DeepSpeed's `eval_batch` (its inference schedule): it returns a mean loss over the
micro-batches and replicas, or with `return_logits` the last micro-batch's logits alone
(`self.outputs` is overwritten per forward pass). Per-token losses out of it would need
the module's `loss_fn` swapped for an unreduced one, `reduce_output=None`,
`bcast_loss=False`, and the engine's `total_loss` cleared by hand (eval_batch adds each
loss into what the last `train_batch` left, a scalar a per-token tensor cannot be added
into in place): three reaches into the engine's internals for one diagnosis. The
point-to-point replay uses only the stage's module and the engine's grid.

Its cost: each stage runs its own layers once per replayed micro-batch, and stage s starts
micro-batch i when it has sent micro-batch i-1 on, so the replay of n micro-batches takes
about n + pp - 1 stage-forwards (a whole-model forward on every rank without pipelines),
plus one activation send per micro-batch and stage boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from trainer.diagnosis import BatchReplay, Replayer, evaluating, pooled, scored
from trainer.pipeline import last_stages

# what an activation header can name (index = code); a stage's output is floating-point
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_DIMS = 4  # (rows, positions, width) with room to spare


def header(tensor: torch.Tensor) -> list[int]:
    """Pure: what a receiver must know to allocate `tensor`: its dtype's code, its number of
    dimensions, its shape, padded with zeros to a fixed length."""
    if tensor.dtype not in DTYPES or tensor.dim() > MAX_DIMS:
        raise ValueError(f"cannot send a {tensor.dtype} activation of shape {tuple(tensor.shape)}")
    shape = list(tensor.shape)
    return [DTYPES.index(tensor.dtype), len(shape), *shape, *[0] * (MAX_DIMS - len(shape))]


def from_header(values: Sequence[int]) -> tuple[torch.dtype, list[int]]:
    """Pure: `header`'s dtype and shape back."""
    code, dims, *shape = (int(v) for v in values)
    return DTYPES[code], shape[:dims]


def send_activation(tensor: torch.Tensor, dst: int) -> None:
    """`tensor` to global rank `dst`: its header, then its values."""
    dist.send(torch.tensor(header(tensor), dtype=torch.int64, device=tensor.device), dst)
    dist.send(tensor.contiguous(), dst)


def recv_activation(src: int, device: torch.device) -> torch.Tensor:
    """The tensor `send_activation` sends from global rank `src`."""
    meta = torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(meta, src)
    dtype, shape = from_header(meta.tolist())
    tensor = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(tensor, src)
    return tensor


class PipeReplayer(Replayer):
    """`Replayer` for DeepSpeed's pipe engine: the forward passes stage by stage, the
    replays pooled once per pipeline. Collective: every rank of every pipeline."""

    def replay(self, cursors: Sequence[int], step: int) -> list[BatchReplay]:
        """This pipeline's micro-batches at `cursors`: the same list on each of its stages."""
        engine = self.engine
        stage, last = engine.stage_id, engine.num_stages - 1
        out: list[BatchReplay] = []
        with evaluating(engine.module):
            for cursor in cursors:
                x, y, *packed = (t.to(engine.device) for t in self.batches.replay(cursor, step))
                if stage > 0:  # the previous stage's activations, in the tuple it would send
                    x = recv_activation(engine.grid.stage_to_global(stage - 1), engine.device)
                result = engine.module((x, *packed) if packed else x)
                if stage < last:  # (activations, *packed ids) or the activations alone
                    hidden = result[0] if isinstance(result, tuple) else result
                    send_activation(hidden, engine.grid.stage_to_global(stage + 1))
                else:  # the logits
                    out.append(scored(cursor, result, y, self.batches.documents(cursor)))
        return last_stages(engine, out)  # collective: the pipe group

    def pool(self, replays: list[BatchReplay]) -> list[BatchReplay]:
        """Each pipeline's replays once, in replica order (the data-parallel group: one
        rank of each pipeline, which holds its pipeline's list)."""
        return pooled(replays, group=self.engine.grid.get_data_parallel_group())
