"""A spike's diagnosis under pipeline parallelism (trainer/pipeline_replay.py): the
activation header, pure; the stage-by-stage replay on a real PipelineEngine (torchrun,
gloo ranks on CPU) against the whole model's replay on the same weights and batches; a
PP 2 segment whose planted spike is diagnosed before its rollback.

The ranks' half of the replay comparison is this module's `__main__`, launched under
torchrun by `replay_against_whole_model`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.trainer.helpers import REPO, VOCAB, make_dataset, tiny_spec
from trainer.pipeline_replay import from_header, header

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)

PP2 = {"train.procs_per_node": 2, "train.grad_accum": 2,
       "train.layout": {"tp": 1, "pp": 2, "zero": 0}}
CURSORS = list(range(6))


def test_an_activation_header_names_its_dtype_and_shape_and_refuses_what_it_cannot():
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.zeros(4, 32, 16, dtype=dtype)
        values = header(t)
        assert len(values) == 6 and from_header(values) == (dtype, [4, 32, 16])
    with pytest.raises(ValueError, match="int64"):
        header(torch.zeros(2, dtype=torch.int64))  # ids are read by each stage, not sent


# ---- the ranks' side ---------------------------------------------------------------------
class _Replays:
    """A packed source as the replay reads it (trainer/faults.py FaultyBatches' surface)."""

    def __init__(self, source) -> None:
        self.source = source

    def replay(self, cursor: int, step: int) -> tuple[torch.Tensor, ...]:
        return self.source.get(cursor)

    def documents(self, cursor: int) -> torch.Tensor:
        return self.source.documents(cursor)


def _source(spec, replica: int, replicas: int):
    """Packed rows of short documents (two or three a row: the attention's document
    segments matter) of learnable-looking tokens, replica `replica`'s share."""
    import numpy as np

    from trainer.data import PackedBatches
    from trainer.engine import micro_batch_size

    rng = np.random.default_rng(7)
    tokens = rng.integers(0, VOCAB - 1, 4000).astype(np.int64)
    starts = np.cumsum(np.concatenate([[0], rng.integers(9, 20, 400)]))
    starts = starts[starts < tokens.size]
    return _Replays(PackedBatches(tokens, starts, seq_len=spec.model.seq_len,
                                  batch_size=micro_batch_size(spec), seed=spec.seed,
                                  rank=replica, world=replicas))


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


def _worst_difference(got, want) -> float:
    """The largest relative difference of batch losses and per-document loss sums; inf
    where the cursors, documents or token counts differ."""
    if [b.cursor for b in got] != [b.cursor for b in want]:
        return float("inf")
    worst = 0.0
    for g, w in zip(got, want):
        if {d: n for d, (_, n) in g.docs.items()} != {d: n for d, (_, n) in w.docs.items()}:
            return float("inf")
        worst = max(worst, _relative(w.loss, g.loss),
                    *(_relative(w.docs[d][0], g.docs[d][0]) for d in w.docs))
    return worst


def ranks_main() -> None:
    """One rank: a PipelineEngine of the trainer's GPT (seeded), its stage-by-stage replay
    of CURSORS pooled over the pipelines, against every replica's whole-model replay on a
    GPT of the same seed; rank 0 prints what every rank found as a `RESULT ` line."""
    import types

    import deepspeed
    import torch.distributed as dist

    from trainer.diagnosis import Replayer
    from trainer.engine import build_engine
    from trainer.model import GPT
    from trainer.pipeline_replay import PipeReplayer
    from trainer.segment import leave

    world = int(os.environ["WORLD_SIZE"])
    deepspeed.init_distributed(dist_backend="gloo")
    spec = tiny_spec(REPO / "unused", **{**PP2, "train.procs_per_node": world})
    engine = build_engine(spec, GPT(spec.model, VOCAB, seed=spec.seed), pp=2)
    replicas = world // 2
    mine = _source(spec, engine.grid.get_data_parallel_rank(), replicas)
    piped = PipeReplayer(engine, mine)
    replayed = piped.replay(CURSORS, step=1)
    got = piped.pool(replayed)
    whole = types.SimpleNamespace(module=GPT(spec.model, VOCAB, seed=spec.seed),
                                  device=torch.device("cpu"))
    want = [b for r in range(replicas)
            for b in Replayer(whole, _source(spec, r, replicas)).replay(CURSORS, step=1)]
    # the whole diagnosis on the pipeline's replays: collective, and one verdict everywhere
    found, _ = piped.diagnose(CURSORS, CURSORS[-2:], step=1, threshold=100.0)
    mine_found = {"rank": dist.get_rank(), "stage": engine.stage_id,
                  "replayed": len(replayed), "pooled": len(got),
                  "documents": sum(len(b.docs) for b in got),
                  "worst": _worst_difference(got, want),
                  "losses": [b.loss for b in got], "verdict": found.verdict,
                  "evidence": {k: found.evidence[k] for k in
                               ("replayed_batches", "replay_disagreement")}}
    every: list = [None] * world
    dist.all_gather_object(every, mine_found)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(every), flush=True)
    # all ranks leave together, skipping the C++ teardown, as a segment does
    # (trainer/segment.py `leave`: a rank exiting unjoined died of SIGABRT now and then)
    dist.barrier()
    dist.destroy_process_group()
    leave(0)


def replay_against_whole_model(world: int) -> list[dict]:
    """`ranks_main` on `world` gloo ranks under torchrun: every rank's findings."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(world), "-m", "tests.trainer.test_pipeline_replay"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _assert_replays_match(every: list[dict], world: int) -> None:
    replicas = world // 2
    assert sorted(r["stage"] for r in every) == sorted([0, 1] * replicas)
    for r in every:
        # each stage holds its pipeline's replays; pooled, each replica's once
        assert r["replayed"] == len(CURSORS) and r["pooled"] == len(CURSORS) * replicas
        assert r["worst"] < 1e-6, r
        assert r["documents"] > 2 * len(CURSORS) * replicas  # rows of several documents
    assert all(r["losses"] == every[0]["losses"] for r in every)  # the same list everywhere
    assert len({r["verdict"] for r in every}) == 1
    assert every[0]["evidence"] == {"replayed_batches": len(CURSORS) * replicas,
                                    "replay_disagreement": 0.0}


def test_a_pp2_replay_scores_every_batch_and_document_as_the_whole_model_does():
    """PP 2 on two ranks: the stage-by-stage replay's batch losses and per-document loss
    sums equal the whole model's on the same weights and batches (within 1e-6), on both
    stages, and the diagnosis built on them is the same on both."""
    _assert_replays_match(replay_against_whole_model(2), 2)


@pytest.mark.soak
def test_a_pp2_x_dp2_replay_pools_each_pipelines_replays_once_in_replica_order():
    """PP 2 x DP 2 on four ranks: two pipelines, each its replica's batches; the pooled
    list is replica 0's replays then replica 1's, on all four ranks."""
    _assert_replays_match(replay_against_whole_model(4), 4)


def test_a_pp2_rollback_is_diagnosed_on_the_stages_replay_before_it_skips(tmp_path):
    """tests/trainer/test_spike_handling.py's faulted segment at PP 2: the corrupted
    batches' spike is replayed stage by stage on the restored weights and diagnosed as a
    ZeRO run's is — `data`, naming exactly the corrupted cursors, both replays of the
    spike's batches equal — and that verdict decides the rollback's skip."""
    from storage.events import read_events
    from tests.trainer.test_spike_handling import CORRUPT_AT, spiky_segment

    spec, result = spiky_segment(tmp_path, make_dataset(tmp_path / "d"), world=2, **PP2)
    (rb,) = result["outcome"]["rollbacks"]
    assert rb["onset"] == CORRUPT_AT and rb["verdict"] == "data" and rb["skipped"] == "window"
    events = read_events(spec.storage.durable, spec.run_id)
    (fault,) = [e["payload"] for e in events if e["kind"] == "fault"
                and e["payload"]["kind"] == "corrupt_batches"]
    (diag,) = [e["payload"] for e in events if e["kind"] == "spike_diagnosed"]
    assert diag["verdict"] == "data" and diag["replay_disagreement"] == 0.0
    assert set(diag["batches"]) == set(range(*fault["cursors"]))  # one pipeline: each once
    assert min(diag["spike_batch_losses"]) > diag["threshold"]
    assert diag["replayed_batches"] == len(range(*rb["window"]))
    assert diag["forward_passes"] > diag["replayed_batches"] and diag["replay_s"] > 0
    assert result["final_step"] == 100


if __name__ == "__main__":
    ranks_main()
