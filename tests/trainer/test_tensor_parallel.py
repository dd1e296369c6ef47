"""Tensor parallelism (trainer/tensor_parallel.py): the rank mapping and the partition
config, pure; a real TP=2 training (torchrun, two gloo ranks on CPU, AutoTP) whose
losses follow a one-rank run's at the same global batch; the real segment at TP=2, and its
exact resume (benchmarks/resume_exact.py --layout tp2)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from common.errors import BadConfig
from spec import RunSpec
from tests.trainer.helpers import (
    REPO,
    VOCAB,
    make_dataset,
    resumed_at_another_layout_error,
    run_rank_module,
    run_segment,
    tiny_spec,
    write_spec,
)
from trainer.engine import deepspeed_config, tokens_per_step
from trainer.merge import merge_shards
from trainer.model import GPT, ffn_hidden
from trainer.tensor_parallel import (
    COLUMN,
    ROW,
    check_heads,
    check_saved_tp,
    partition_config,
    tensor_parallel_config,
    tp_ranks,
)

STEPS = 50
CLIP = 0.2
MODULE = "tests.trainer.test_tensor_parallel"


def test_ranks_of_a_tp_group_are_consecutive_and_share_a_data_parallel_rank():
    got = [tp_ranks(r, 4, 2) for r in range(4)]
    assert [(g.dp_rank, g.dp_world, g.tp_rank) for g in got] == [
        (0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    assert [(g.dp_rank, g.dp_world) for g in (tp_ranks(r, 2, 2) for r in range(2))] == [
        (0, 1), (0, 1)]
    assert tp_ranks(3, 4, 1) == tp_ranks(3, 4, 1).__class__(dp_rank=3, dp_world=4, tp_rank=0)


def test_a_tp_that_does_not_divide_the_world_is_refused_naming_the_layout():
    with pytest.raises(BadConfig, match=r"train\.layout\.tp"):
        tp_ranks(0, 3, 2)


def test_heads_that_do_not_split_over_tp_are_refused_naming_the_field():
    check_heads(4, 2, 2)
    with pytest.raises(BadConfig, match=r"model\.n_kv_heads"):
        check_heads(4, 1, 2)
    with pytest.raises(BadConfig, match=r"model\.n_heads"):
        check_heads(6, 3, 4)


def test_the_partition_config_splits_attention_and_mlp_the_megatron_way_and_nothing_else():
    """Every matrix of a block is named once, the right way; embedding, norms and the
    (tied) lm_head match nothing and stay whole."""
    spec = tiny_spec(REPO)
    names = [n for n, _ in GPT(spec.model, VOCAB).named_parameters()]

    def matches(patterns):
        return {n for n in names if any(re.match(p, n) for p in patterns)}

    blocks = spec.model.n_layers
    assert matches(COLUMN) == {f"blocks.{i}.{m}.weight" for i in range(blocks)
                               for m in ("attn.wq", "attn.wk", "attn.wv", "ffn.w1", "ffn.w3")}
    assert matches(ROW) == {f"blocks.{i}.{m}.weight" for i in range(blocks)
                            for m in ("attn.wo", "ffn.w2")}
    specs = partition_config()["layer_specs"]
    assert [s["partition_type"] for s in specs] == ["column", "row"]
    assert partition_config()["use_default_specs"] is False


def test_the_deepspeed_config_carries_autotp_and_no_batch_count_of_the_whole_world():
    spec = tiny_spec(REPO, **{"train.procs_per_node": 2, "train.grad_accum": 2})
    plain, tp = deepspeed_config(spec), deepspeed_config(spec, tp=2)
    # DeepSpeed would count the whole world against train_batch_size: left to derive
    assert plain["train_batch_size"] == 4 * 2 * 2 and "train_batch_size" not in tp
    assert tp["gradient_accumulation_steps"] == plain["gradient_accumulation_steps"] == 2
    assert "tensor_parallel" not in plain
    assert tp["tensor_parallel"] == tensor_parallel_config(2)
    assert tp["tensor_parallel"]["autotp_size"] == 2


def test_a_step_counts_the_tokens_of_data_replicas_not_of_ranks():
    dp = tiny_spec(REPO, **{"train.procs_per_node": 4, "train.grad_accum": 2})
    tp = dp.replace(**{"train.layout": {"tp": 2, "pp": 1, "zero": 0}})
    assert tokens_per_step(dp) == 128 * 2 * 4
    assert tokens_per_step(tp) == 128 * 2 * 2  # 4 ranks, 2 TP groups: 2 replicas


def test_a_checkpoint_resumes_only_at_the_tp_degree_it_was_written_at():
    check_saved_tp({"world_size": 2, "zero_stage": 0, "tp": 2}, step=8, tp=2)
    check_saved_tp({"world_size": 2, "zero_stage": 0}, step=8, tp=1)  # written before TP
    with pytest.raises(BadConfig, match=r"written at TP 2, this segment runs TP 1") as exc:
        check_saved_tp({"tp": 2}, step=8, tp=1)
    assert exc.value.field == "train.layout.tp" and "init_from" in exc.value.fix
    with pytest.raises(BadConfig, match=r"written at TP 1, this segment runs TP 2"):
        check_saved_tp({}, step=8, tp=2)
    from storage.manifest import CorruptCheckpoint
    for bad in (0, True, "2"):
        with pytest.raises(CorruptCheckpoint):
            check_saved_tp({"tp": bad}, step=8, tp=2)


def test_merging_shards_concatenates_columns_by_rows_and_rows_by_columns():
    col, row = "blocks.0.attn.wq.weight", "blocks.0.ffn.w2.weight"
    whole = {col: torch.arange(24.0).reshape(4, 6), row: torch.arange(12.0).reshape(2, 6),
             "embed.weight": torch.ones(3, 2)}
    shards = [{col: whole[col][2 * r:2 * r + 2], row: whole[row][:, 3 * r:3 * r + 3],
               "embed.weight": whole["embed.weight"]} for r in range(2)]
    merged = merge_shards(shards, step=8)
    assert all(torch.equal(merged[k], whole[k]) for k in whole)
    assert merge_shards(shards[:1], step=8) is shards[0]


TP2 = {"train.procs_per_node": 2, "train.layout": {"tp": 2, "pp": 1, "zero": 0}}


@pytest.mark.process
def test_a_tp2_segment_trains_one_replica_and_commits_each_ranks_shards(tmp_path):
    """`python -m trainer.segment` with train.layout {tp: 2} on two ranks: both ranks read
    data replica 0's batches (else DeepSpeed's first-step check fails: "Data inconsistency
    within the TP group"), the step counts one replica's tokens, and the committed
    checkpoint holds each rank's half of the sharded matrices, loadable weights-only; the
    weights readers (evaluation, export, init_from, a teacher) put the halves back
    together: step 0's are exactly the model the run started from."""
    from trainer.evaluate import read_state_dict
    from trainer.safe_load import safe_torch_load

    dataset = make_dataset(tmp_path / "data")
    spec = tiny_spec(tmp_path / "store", **TP2)
    proc = run_segment(write_spec(spec, tmp_path / "spec.json"), dataset, 4,
                       tmp_path / "work", world=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "work" / "result.json").read_text())
    assert result["final_step"] == result["last_committed_step"] == 4
    assert result["tokens_seen"] == 4 * 128  # one replica; DP over two ranks: 4 * 256
    checkpoints = tmp_path / "store" / "runs" / "t" / "checkpoints"
    ckpt = checkpoints / f"step-{4:09d}"
    assert json.loads((ckpt / "MANIFEST.json").read_text())["extra"]["tp"] == 2
    d, hidden = spec.model.d_model, ffn_hidden(spec.model)
    halves = [safe_torch_load(ckpt / f"mp_rank_{r:02d}_model_states.pt")["module"]
              for r in range(2)]
    for sd in halves:
        assert sd["blocks.0.attn.wq.weight"].shape == (d // 2, d)  # column: half the rows
        assert sd["blocks.0.ffn.w2.weight"].shape == (d, hidden // 2)  # row: half the columns
    assert not torch.equal(halves[0]["blocks.0.attn.wq.weight"],
                           halves[1]["blocks.0.attn.wq.weight"])
    assert torch.equal(halves[0]["embed.weight"], halves[1]["embed.weight"])  # whole
    start = GPT(spec.model, VOCAB, seed=spec.seed).state_dict()
    merged = read_state_dict(str(checkpoints / f"step-{0:09d}"), 0)
    assert merged.keys() == start.keys()
    assert all(torch.equal(merged[k], start[k]) for k in start)
    trained = GPT(spec.model, VOCAB)
    trained.load_state_dict(read_state_dict(str(ckpt), 4))  # whole shapes, strict
    assert not torch.equal(trained.blocks[0].attn.wq.weight, start["blocks.0.attn.wq.weight"])


@pytest.mark.soak
def test_a_tp2_segment_resumes_bitwise_at_zero_0(tmp_path):
    """Killed at step 4 and resumed to 8 vs straight to 8: every tensor of both ranks'
    files equal (benchmarks/resume_exact.py --layout tp2 measures ZeRO 0 and 2)."""
    from benchmarks.resume_exact import compare, skewed_dataset

    got = compare(tmp_path / "run", skewed_dataset(tmp_path), world=2, zero=0, tp=2)
    assert "mp_rank_01_model_states.pt" in got["files"]
    assert got["max_abs_weight_diff"] == got["max_abs_state_diff"] == 0.0, got
    assert got["control_weight_change_resume_to_end"] > 1e-3  # the weights did move


@pytest.mark.soak
def test_a_tp2_checkpoint_resumed_without_tp_is_refused_naming_the_layout(tmp_path):
    # the same run, one rank, no TP (BadConfig: not retried)
    error = resumed_at_another_layout_error(tmp_path, TP2, {})
    assert "train.layout.tp" in error and "written at TP 2" in error


@pytest.mark.soak
def test_a_tp2_segment_skips_a_nan_step_and_rolls_back_a_sustained_spike_diagnosed_as_data(
        tmp_path):
    """tests/trainer/test_spike_handling.py's faulted segment at TP 2: the step loop's
    verdicts, the rollback's restore of both ranks' shards and the diagnosis's replay on
    them (its two replays agree, the corrupted batches accused)."""
    from storage.events import read_events
    from tests.trainer.test_spike_handling import (
        CORRUPT_AT,
        CORRUPT_STEPS,
        NAN_AT,
        spiky_segment,
    )

    spec, result = spiky_segment(tmp_path, make_dataset(tmp_path / "d"), world=2, **TP2)
    (rb,) = result["outcome"]["rollbacks"]
    assert rb["onset"] == CORRUPT_AT and rb["to_step"] < CORRUPT_AT and rb["verdict"] == "data"
    assert NAN_AT in result["outcome"]["skipped_steps"]
    assert result["final_step"] == 100 and result["train_loss"] < 4.0
    (diag,) = [e["payload"] for e in read_events(spec.storage.durable, spec.run_id)
               if e["kind"] == "spike_diagnosed"]
    assert diag["verdict"] == "data" and diag["replay_disagreement"] == 0.0
    assert set(diag["batches"]) == set(range(CORRUPT_AT - 1, CORRUPT_AT - 1 + CORRUPT_STEPS))


@pytest.mark.soak
def test_tp2_training_follows_the_one_rank_trajectory_within_1e4(tmp_path):
    """50 steps of the tiny GPT, fp32, 2 micro-batches a step: TP=2 over two ranks (one
    data-parallel replica) against one rank holding the whole model, the same batches."""
    one = run_rank_module(MODULE, "--tp", "1", "--steps", str(STEPS))
    two = run_torchrun(2, "--tp", "2", "--steps", str(STEPS))
    assert two["sharded"] == [True, True]  # each rank holds half of wq and of w2
    assert two["tp_losses_agree"]  # both ranks of the group computed the same loss
    assert one["sharded"] == [False]
    a, b = np.array(one["losses"]), np.array(two["losses"])
    assert len(a) == len(b) == STEPS
    assert a[-1] < a[0] - 0.5  # it trained
    assert np.max(np.abs(a - b) / np.abs(a)) < 1e-4, np.abs(a - b) / np.abs(a)
    assert min(one["norms"]) > CLIP  # every step was clipped, by the same norm
    assert two["norms"] == pytest.approx(one["norms"], rel=1e-4)
    # the gradient noise scale is sampled without TP only (trainer/oscillation_watch.py)
    assert one["noise_unmeasured"] == "" and "tensor parallelism" in two["noise_unmeasured"]


def run_torchrun(world: int, *args: str) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(world), "-m", MODULE, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


# ---- the child process: one rank of a TP group, or the whole model on one rank -----------------
def _tokens(n: int = 40_000, seed: int = 0) -> np.ndarray:
    """tests/trainer/helpers.py make_dataset's stream: next = prev + 1 (mod vocab), noisy."""
    rng = np.random.default_rng(seed)
    steps = np.where(rng.random(n) < 0.8, 1, rng.integers(0, VOCAB, n))
    return (np.cumsum(steps) % VOCAB).astype(np.int64)


def _spec(world: int) -> RunSpec:
    """A clip low enough that every step is clipped: the clip's norm counts each sharded
    matrix's pieces once and each replicated parameter once (DeepSpeed's clip_grad_norm_
    with the TP mpu), or the trajectories part."""
    return tiny_spec(REPO, **{"train.procs_per_node": world, "train.grad_accum": 2,
                              "train.total_steps": STEPS, "train.precision": "fp32",
                              "train.grad_clip": CLIP})


def _main(tp: int, steps: int) -> dict:
    import deepspeed
    import torch.distributed as dist

    from trainer.data import TrainBatches
    from trainer.engine import build_engine, lr_at, micro_batch_size, set_lr

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = _spec(world)
    at = tp_ranks(rank, world, tp)
    engine = build_engine(spec, GPT(spec.model, VOCAB, seed=spec.seed), tp=tp)
    batches = TrainBatches(_tokens(), seq_len=spec.model.seq_len,
                           batch_size=micro_batch_size(spec), seed=spec.seed,
                           rank=at.dp_rank, world=at.dp_world)
    accum, losses, norms, agree = spec.train.grad_accum, [], [], True
    for step in range(steps):
        set_lr(engine, lr_at(step, spec.train))
        total = torch.zeros(())
        for micro in range(accum):
            _, loss = engine(*batches.get(step * accum + micro))
            engine.backward(loss)
            engine.step()
            total += loss.detach() / accum
        if world > 1:  # trainer/context.py loss_and_stop: the mean over every rank
            every = [torch.zeros(()) for _ in range(world)]
            dist.all_gather(every, total)
            agree &= all(torch.equal(e, every[0]) for e in every)
            total = sum(every) / world
        losses.append(float(total))
        norms.append(float(engine.get_global_grad_norm()))
    block = engine.module.blocks[0]
    sharded = (block.attn.wq.weight.shape[0] == spec.model.d_model // tp < spec.model.d_model
               and block.ffn.w2.weight.shape[1] == ffn_hidden(spec.model) // tp)
    flags = [None] * world
    if world > 1:
        dist.all_gather_object(flags, sharded)
    from trainer.oscillation_watch import unmeasured

    return {"losses": losses, "norms": norms, "sharded": flags if world > 1 else [sharded],
            "tp_losses_agree": agree, "noise_unmeasured": unmeasured(engine, accum, 1)}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=STEPS)
    ns = parser.parse_args()
    out = _main(ns.tp, ns.steps)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(out))
