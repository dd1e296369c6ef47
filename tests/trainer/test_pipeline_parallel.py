"""Pipeline parallelism (trainer/pipeline.py): the rank mapping, the GPT as a sequence of
layers, the merge of a pipeline's layer files and the refusals, pure; the real segment at
PP=2 (torchrun, two gloo ranks on CPU, DeepSpeed's PipelineEngine) and its losses against
one rank's at the same global batch; soak: its exact resume
(benchmarks/resume_exact.py --layout pp2) and a PP checkpoint resumed without PP."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import BadConfig
from spec import preset
from tests.trainer.helpers import (
    REPO,
    VOCAB,
    make_dataset,
    resumed_at_another_layout_error,
    run_segment,
    tiny_spec,
    write_spec,
)
from trainer.engine import check_micro_split, deepspeed_config, tokens_per_step
from trainer.merge import layer_files, merge_layers
from trainer.model import GPT
from trainer.pipeline import (
    PipeBlock,
    check_saved_pp,
    lm_loss,
    pipeline_layers,
    pp_ranks,
    step_batches,
)
from trainer.state import TrainState

PP2 = {"train.procs_per_node": 2, "train.grad_accum": 2,
       "train.layout": {"tp": 1, "pp": 2, "zero": 0}}
CLIP = 0.2  # low enough that every step is clipped: the norm must span both stages


def test_the_stages_of_a_pipeline_are_strided_ranks_reading_one_replicas_batches():
    got = [pp_ranks(r, 4, 2) for r in range(4)]  # DeepSpeed's (pipe, data) mesh
    assert [(g.stage, g.dp_rank, g.dp_world) for g in got] == [
        (0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert [(g.stage, g.dp_rank, g.dp_world) for g in (pp_ranks(r, 2, 2) for r in range(2))] == [
        (0, 0, 1), (1, 0, 1)]
    with pytest.raises(BadConfig, match=r"train\.layout\.pp"):
        pp_ranks(0, 3, 2)


def _packed(spec, rows: int = 2, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """A packed micro-batch: each row two documents, positions restarting at each."""
    gen = torch.Generator().manual_seed(seed)
    t = spec.model.seq_len
    x = torch.randint(0, VOCAB, (rows, t), generator=gen)
    y = torch.randint(0, VOCAB, (rows, t), generator=gen)
    y[:, t // 3] = -100  # a document end scores nothing
    doc = (torch.arange(t) >= t // 3).long().expand(rows, t).contiguous()
    pos = torch.where(doc == 0, torch.arange(t), torch.arange(t) - t // 3)
    return x, y, pos, doc


def _run_layers(gpt: GPT, inputs) -> torch.Tensor:
    """The layers in order, as the stages run them (a TiedLayerSpec built once, its
    second use through its forward_fn, as PipelineModule._build does)."""
    from deepspeed.pipe import TiedLayerSpec

    tied, out = {}, inputs
    for layer in pipeline_layers(gpt):
        if isinstance(layer, TiedLayerSpec):
            module = tied.setdefault(layer.key, layer.build())
            layer = module if layer.forward_fn is None else partial(layer.forward_fn, module)
        out = layer(out)
    return out


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("packed", [True, False])
def test_the_gpt_as_pipeline_layers_computes_the_gpts_loss_bit_for_bit(tie, packed):
    """Embedding, blocks, norm and head in sequence, the packed ids carried in the
    activation tuple: the same logits and loss as GPT.forward, tied or not."""
    spec = tiny_spec(REPO, **{"model.tie_embeddings": tie})
    gpt = GPT(spec.model, VOCAB, seed=3)
    x, y, pos, doc = _packed(spec)
    kw = {"position_ids": pos, "doc_ids": doc} if packed else {}
    logits, loss = gpt(x, y, **kw)
    piped = _run_layers(gpt, (x, pos, doc) if packed else x)
    assert torch.equal(piped, logits) and torch.equal(lm_loss(piped, y), loss)
    if packed:  # the per-document attention is what the ids buy: without them it differs
        assert not torch.equal(_run_layers(gpt, x), logits)


def test_a_pipelines_layer_files_merge_back_into_the_gpts_state_dict():
    """What the stages save (each layer's own state dict, the tied head not at all) is
    named back as GPT's: blocks by their layer index, lm_head from the embedding."""
    for tie in (True, False):
        spec = tiny_spec(REPO, **{"model.tie_embeddings": tie})
        gpt = GPT(spec.model, VOCAB, seed=5)
        layers = [layer for layer in pipeline_layers(gpt) if isinstance(layer, torch.nn.Module)]
        if tie:  # layer 0 is the tied embedding's first use; the head's use is not saved
            layers = [pipeline_layers(gpt)[0].build(), *layers]
        files = [(i, layer.state_dict()) for i, layer in enumerate(layers)]
        merged, whole = merge_layers(files, step=4), gpt.state_dict()
        assert merged.keys() == whole.keys()
        assert all(torch.equal(merged[k], whole[k]) for k in whole)
        assert len(files) == spec.model.n_layers + (2 if tie else 3)
    names = ["layer_10-model_states.pt", "layer_02-model_states.pt", "mp_rank_00_model_states.pt"]
    assert layer_files(names) == [(2, names[1]), (10, names[0])]


def test_each_stage_holds_an_equal_run_of_blocks():
    from deepspeed.runtime.utils import partition_balanced

    spec = tiny_spec(REPO, **{"model.n_layers": 4})
    kinds = [1 if isinstance(layer, PipeBlock) else 0
             for layer in pipeline_layers(GPT(spec.model, VOCAB))]
    parts = [int(p) for p in partition_balanced(weights=kinds, num_parts=2)]
    assert [sum(kinds[a:b]) for a, b in zip(parts, parts[1:])] == [2, 2]
    assert parts[1] == 3  # the embedding and two blocks; two blocks, norm and head


def test_the_deepspeed_config_and_the_token_count_are_a_pipelines_replicas():
    spec = tiny_spec(REPO, **{**PP2, "train.procs_per_node": 4,
                              "train.layout": {"tp": 1, "pp": 2, "zero": 0}})
    plain, pp = deepspeed_config(spec), deepspeed_config(spec, pp=2)
    # DeepSpeed checks the batch against its grid's data-parallel world: 4 ranks, 2 pipelines
    assert plain["train_batch_size"] == 4 * 2 * 4 and pp["train_batch_size"] == 4 * 2 * 2
    assert tokens_per_step(spec) == 128 * 2 * 2


def test_a_split_micro_batch_reaches_the_last_stage_as_chunks_weighted_as_without_pipelines():
    """An OOM-adapted run's chunks: each its own pipe micro-batch, its targets carrying
    the chunk's weight (its share of the scored targets x the chunks), so the weighted
    chunk losses average to the micro-batch's loss, as trainer/loop.py weighs them."""
    from trainer.loop import chunk_weights
    from trainer.pipeline import stage_loss

    check_micro_split(tiny_spec(REPO, **PP2), 2)  # accepted with PP
    spec = tiny_spec(REPO)
    x, y, pos, doc = _packed(spec, rows=4)
    y[0, :] = -100  # the first chunk scores fewer targets than the second

    class Packed:
        def get(self, cursor: int, step: int):
            return x, y, pos, doc

    data = list(step_batches(Packed(), TrainState(), step=1, micro_batches=1, split=2))
    assert len(data) == 2
    (inputs, targets), _ = data
    assert inputs[0].shape == (2, spec.model.seq_len) and torch.equal(inputs[0], x[:2])
    weights = [t[1] for _, t in data]
    assert torch.equal(torch.stack(weights), torch.stack(chunk_weights([y[:2], y[2:]])))
    gpt = GPT(spec.model, VOCAB, seed=3)
    _, whole = gpt(x, y, position_ids=pos, doc_ids=doc)
    chunked = [stage_loss()(_run_layers(gpt, inputs), targets) for inputs, targets in data]
    assert torch.allclose(sum(chunked) / 2, whole, rtol=1e-6)
    # unsplit and without a teacher the targets stay plain
    ((_, plain),) = step_batches(Packed(), TrainState(), step=1, micro_batches=1)
    assert plain is y


class _Source:
    def get(self, cursor: int, step: int) -> tuple[torch.Tensor, ...]:
        return torch.full((1, 2), cursor), torch.full((1, 2), -cursor)


def test_a_steps_micro_batches_step_over_skipped_ranges_and_advance_every_stage():
    state = TrainState(data_cursor=3, skip_ranges=[(4, 6)])
    data = step_batches(_Source(), state, step=2, micro_batches=3)
    assert state.data_cursor == 3  # a generator: nothing read yet
    got = [int(x[0, 0]) for x, _ in data]
    assert got == [3, 6, 7] and state.data_cursor == 8
    # a middle stage reads no batch; its cursor moves all the same
    middle = TrainState(data_cursor=3, skip_ranges=[(4, 6)])
    for _ in step_batches(_Source(), middle, step=2, micro_batches=3):
        pass
    assert middle.data_cursor == 8


def test_a_checkpoint_resumes_only_at_the_pp_degree_it_was_written_at():
    check_saved_pp({"pp": 2}, step=4, pp=2)
    check_saved_pp({"world_size": 2}, step=4, pp=1)  # written before PP
    with pytest.raises(BadConfig, match="written at PP 2, this segment runs PP 1") as exc:
        check_saved_pp({"pp": 2}, step=4, pp=1)
    assert exc.value.field == "train.layout.pp" and "init_from" in exc.value.fix
    from storage.manifest import CorruptCheckpoint
    for bad in (0, True, "2"):
        with pytest.raises(CorruptCheckpoint):
            check_saved_pp({"pp": bad}, step=4, pp=2)


ALONE = {"train.nodes": 2, "train.grad_accum": 2, "sweep.enabled": False, "faults": []}


@pytest.mark.parametrize(("over", "field", "problem"), [
    ({"train.procs_per_node": 2, "model.n_kv_heads": 2, "layout.tp": 2},
     "train.layout", "TP 2 x PP 2"),
    ({"train.min_nodes": 1, "train.procs_per_node": 2}, "train.min_nodes",
     "not repartitioned to fewer nodes"),
    ({"sweep.enabled": True}, "sweep.enabled", "with PP it would not be one"),
    ({"train.precision": "bf16"}, "train.precision", "does not resume its own checkpoint"),
    ({"train.zero_stage": 2, "layout.zero": 2}, "train.layout.pp", "refuses ZeRO 2 and 3"),
    ({"train.grad_accum": 1}, "train.grad_accum", "1F1B needs at least as many"),
])
def test_pp_where_the_trainer_does_not_support_it_is_refused_naming_the_field(
        over, field, problem):
    layout = {"tp": 1, "pp": 2, "zero": 0}
    layout.update({k[len("layout."):]: v for k, v in over.items() if k.startswith("layout.")})
    rest = {k: v for k, v in over.items() if not k.startswith("layout.")}
    with pytest.raises(BadConfig) as exc:
        preset("demo", **{**ALONE, **rest, "train.layout": layout})
    assert exc.value.field == field and problem in exc.value.problem, exc.value


def test_pp_alone_is_accepted_with_online_evaluation_and_injected_faults():
    spec = preset("demo", **{**ALONE, "train.layout": {"tp": 1, "pp": 2, "zero": 0},
                             "faults": [{"kind": "corrupt_batches", "at_step": 5},
                                        {"kind": "nan_loss", "at_step": 7}]})
    assert spec.train.layout.pp == 2 and spec.train.eval_every == 40
    assert [f.kind for f in spec.faults] == ["corrupt_batches", "nan_loss"]


def _progress(workdir: Path) -> list[dict]:
    lines = [json.loads(ln) for ln in (workdir / "progress.jsonl").read_text().splitlines()]
    return [ln for ln in lines if ln["type"] == "step"]


@pytest.mark.process
def test_a_pp2_segment_trains_one_pipeline_and_commits_each_stages_layers(tmp_path):
    """`python -m trainer.segment` with train.layout {pp: 2} on two ranks: one pipeline
    (its stages read one replica's batches), each stage's layers in their own files, the
    manifest saying pp 2; the weights readers (evaluation, export, init_from, a teacher)
    merge the layer files: step 0's are exactly the model the run started from, step 4's
    load whole into a GPT."""
    from trainer.evaluate import read_state_dict

    spec = tiny_spec(tmp_path / "store", **PP2)
    proc = run_segment(write_spec(spec, tmp_path / "spec.json"), make_dataset(tmp_path / "d"),
                       4, tmp_path / "work", world=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "broadcast_" not in proc.stderr  # the tied embedding's sync is not in the graph
    result = json.loads((tmp_path / "work" / "result.json").read_text())
    assert result["final_step"] == result["last_committed_step"] == 4
    assert result["tokens_seen"] == 4 * 128 * 2  # one replica; DP over two ranks: twice
    steps = _progress(tmp_path / "work")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(np.isfinite(s["loss"]) and s["grad_norm"] > 0 for s in steps)
    checkpoints = tmp_path / "store" / "runs" / "t" / "checkpoints"
    ckpt = checkpoints / f"step-{4:09d}"
    assert json.loads((ckpt / "MANIFEST.json").read_text())["extra"]["pp"] == 2
    n = spec.model.n_layers  # embedding, blocks, norm; the tied head is the embedding
    assert [i for i, _ in layer_files([p.name for p in ckpt.iterdir()])] == list(range(n + 2))
    start = GPT(spec.model, VOCAB, seed=spec.seed).state_dict()
    merged = read_state_dict(str(checkpoints / f"step-{0:09d}"), 0)
    assert merged.keys() == start.keys()
    assert all(torch.equal(merged[k], start[k]) for k in start)
    trained = GPT(spec.model, VOCAB)
    trained.load_state_dict(read_state_dict(str(ckpt), 4))  # strict: every name, every shape
    assert not torch.equal(trained.blocks[1].attn.wq.weight, start["blocks.1.attn.wq.weight"])
    assert trained.lm_head.weight is trained.embed.weight


def _trajectory(tmp_path: Path, steps: int, zero: int, pp: int = 2, dp: int = 1,
                clip: float = CLIP) -> tuple[np.ndarray, np.ndarray]:
    """(loss, grad_norm) per step, then (val_loss, nan) per online evaluation (every 10
    steps) of a real segment: `dp` ranks of plain data parallelism (each the whole model)
    and `dp` pipelines of `pp` stages over pp x dp ranks, the same batches (a pipeline
    reads its replica's), `pp` micro-batches a step, fp32; `clip` 0: no clipping, the
    step line's grad_norm still the whole model's."""
    dataset = make_dataset(tmp_path / "d")
    base = {"train.grad_accum": pp, "train.grad_clip": clip, "train.total_steps": steps,
            "train.segment_steps": steps, "train.checkpoint_every": steps,
            "train.zero_stage": zero, "model.n_layers": max(2, pp), "train.eval_every": 10}
    out = []
    for name, world, over in (("dp", dp, {"train.procs_per_node": dp}),
                              ("pp", pp * dp, {"train.procs_per_node": pp * dp,
                                               "train.layout": {"tp": 1, "pp": pp, "zero": zero}})):
        spec = tiny_spec(tmp_path / name, **{**base, **over})
        proc = run_segment(write_spec(spec, tmp_path / f"{name}.json"), dataset, steps,
                           tmp_path / f"w-{name}", world=world)
        assert proc.returncode == 0, proc.stderr[-4000:]
        evals = [json.loads(ln) for ln in (tmp_path / f"w-{name}" / "progress.jsonl")
                 .read_text().splitlines() if json.loads(ln)["type"] == "eval"]
        assert [e["step"] for e in evals] == list(range(10, steps + 1, 10))
        out.append(np.array([(s["loss"], s["grad_norm"]) for s in _progress(tmp_path / f"w-{name}")]
                            + [(e["val_loss"], np.nan) for e in evals]))
    return out[0], out[1]


def _assert_same_trajectory(dp: np.ndarray, pp: np.ndarray, steps: int) -> None:
    """Step losses and clip norms, then the online evaluations' validation losses."""
    assert dp.shape == pp.shape == (steps + steps // 10, 2)
    assert dp[steps - 1, 0] < dp[0, 0] - 0.2  # it trained
    assert np.max(np.abs(dp[:, 0] - pp[:, 0]) / np.abs(dp[:, 0])) < 1e-4
    norms = slice(0, steps)
    assert dp[norms, 1].min() > CLIP  # every step clipped (when clipping), by the norm over all stages
    assert np.max(np.abs(dp[norms, 1] - pp[norms, 1]) / dp[norms, 1]) < 1e-4


@pytest.mark.process
def test_pp2_training_follows_the_one_rank_trajectory_for_20_steps_within_1e4(tmp_path):
    """The step loop's loss under PP (DeepSpeed's mean over the micro-batches and
    replicas, which every stage holds) is the same quantity as without it, step by step,
    and the update is the same: the clipping norm spans both stages' gradients; the
    online evaluation through the stages (eval_batch) gives the same validation loss."""
    _assert_same_trajectory(*_trajectory(tmp_path, 20, zero=0), 20)


@pytest.mark.soak
def test_pp2_at_zero_1_follows_the_one_rank_trajectory_for_50_steps_within_1e4(tmp_path):
    _assert_same_trajectory(*_trajectory(tmp_path, 50, zero=1), 50)


@pytest.mark.soak
def test_a_pp2_segment_split_after_an_oom_follows_the_unsplit_one_within_1e4(tmp_path):
    """`--micro-split 2` (workflows/adapt.py after an OOM) at PP 2: twice the pipe
    micro-batches of half the rows, the same global batch, the same trajectory."""
    dataset = make_dataset(tmp_path / "d")
    out = []
    for name, extra in (("whole", ()), ("split", ("--micro-split", "2"))):
        spec = tiny_spec(tmp_path / name, **{**PP2, "train.total_steps": 10,
                                             "train.checkpoint_every": 10})
        proc = run_segment(write_spec(spec, tmp_path / f"{name}.json"), dataset, 10,
                           tmp_path / f"w{name}", world=2, extra=extra)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out.append(np.array([(s["loss"], s["grad_norm"]) for s in _progress(tmp_path / f"w{name}")]))
    whole, split = out
    assert whole.shape == split.shape == (10, 2)
    assert np.max(np.abs(whole - split) / np.abs(whole)) < 1e-4


@pytest.mark.soak
def test_a_pp2_student_follows_the_one_rank_students_trajectory_within_1e4(tmp_path):
    """distill.teacher at PP 2: the last stage's loss is the distillation loss, the teacher
    reading the rows the targets carry (trainer/pipeline.py `teach`); against one rank
    training the same student on the same batches, 10 steps. A loss that ignored the
    teacher would be the plain cross-entropy, not the one-rank student's."""
    from storage.checkpoints import CheckpointStore
    from storage.runs import claim_run

    dataset = make_dataset(tmp_path / "d")
    teacher = tiny_spec(tmp_path / "store")
    claim_run(str(tmp_path / "store"), "t", teacher.spec_hash(), teacher.to_dict())
    proc = run_segment(write_spec(teacher, tmp_path / "t.json"), dataset, 8, tmp_path / "wt")
    assert proc.returncode == 0, proc.stderr[-4000:]
    CheckpointStore(str(tmp_path / "store"), "t").promote(8)
    student = {"model.d_model": 16, "model.n_heads": 2, "model.n_kv_heads": 2,
               "distill.teacher": "t@8", "distill.alpha": 0.5, "distill.temperature": 2.0,
               "train.grad_accum": 2, "train.total_steps": 10, "train.segment_steps": 10,
               "train.checkpoint_every": 10}
    losses = []
    for name, world, over in (("s1", 1, {}), ("s2", 2, PP2)):
        spec = tiny_spec(tmp_path / "store", **{**student, **over, "run_id": name})
        proc = run_segment(write_spec(spec, tmp_path / f"{name}.json"), dataset, 10,
                           tmp_path / f"w{name}", world=world)
        assert proc.returncode == 0, proc.stderr[-4000:]
        losses.append(np.array([s["loss"] for s in _progress(tmp_path / f"w{name}")]))
    one, piped = losses
    assert len(one) == len(piped) == 10
    assert np.max(np.abs(one - piped) / np.abs(one)) < 1e-4
    from storage.events import read_events
    (cost,) = [e["payload"] for e in read_events(str(tmp_path / "store"), "s2")
               if e["kind"] == "teacher_cost"]  # rank 0's event, the last stage's figure
    assert cost["steps"] == 10 and cost["forward_s_per_step"] > 0


@pytest.mark.soak
@pytest.mark.parametrize(("pp", "dp"), [(4, 1), (2, 2)])
def test_a_pipeline_with_middle_stages_or_beside_data_parallelism_follows_dp_within_1e4(
        tmp_path, pp, dp):
    """PP 4 on four ranks (two middle stages, which read no batch; no clipping: the
    grad_norm reported is still the whole model's), and PP 2 x DP 2 (two pipelines, each
    its replica's batches, the gradients all-reduced per stage) against plain DP on `dp`
    ranks: 10 steps."""
    clip = 0.0 if pp == 4 else CLIP
    _assert_same_trajectory(*_trajectory(tmp_path, 10, zero=0, pp=pp, dp=dp, clip=clip), 10)


@pytest.mark.soak
def test_a_pp2_segment_resumes_bitwise_at_zero_0_and_1(tmp_path):
    """Killed at step 4 and resumed to 8 vs straight to 8: every tensor of every layer's
    file, both stages' optimizer states and train states equal."""
    from benchmarks.resume_exact import compare, skewed_dataset

    dataset = skewed_dataset(tmp_path)
    for zero in (0, 1):
        got = compare(tmp_path / f"z{zero}", dataset, world=2, zero=zero, pp=2)
        assert "layer_03-model_states.pt" in got["files"]
        assert got["max_abs_weight_diff"] == got["max_abs_state_diff"] == 0.0, got
        assert got["control_weight_change_resume_to_end"] > 1e-3  # the weights did move


@pytest.mark.soak
def test_a_pp2_checkpoint_resumed_without_pp_is_refused_naming_the_layout(tmp_path):
    # the same run, no PP (BadConfig: not retried)
    error = resumed_at_another_layout_error(tmp_path, PP2, {"train.grad_accum": 2})
    assert "train.layout.pp" in error and "written at PP 2" in error


@pytest.mark.soak
def test_a_pp2_segment_skips_a_nan_step_and_rolls_back_a_sustained_spike_through_the_held_update(
        tmp_path):
    """tests/trainer/test_spike_handling.py's faulted segment at PP 2: the NaN loss (the
    last stage's loss_fn poisoned) skipped, the spiking steps' updates vetoed (the pipe
    engine's update waits for the verdict), the rollback restores both stages' layers
    before the onset and skips the window (diagnosed first by the stage-by-stage replay:
    the corrupted batches are `data`), online evaluation on, and the run trains on to its
    end."""
    from tests.trainer.test_spike_handling import CORRUPT_AT, NAN_AT, spiky_segment

    _, result = spiky_segment(tmp_path, make_dataset(tmp_path / "d"), world=2, **PP2)
    (rb,) = result["outcome"]["rollbacks"]
    assert rb["onset"] == CORRUPT_AT and rb["to_step"] < CORRUPT_AT
    assert rb["skipped"] == "window" and rb["verdict"] == "data"
    assert NAN_AT in result["outcome"]["skipped_steps"]
    assert CORRUPT_AT in result["outcome"]["skipped_steps"]
    assert result["final_step"] == 100 and result["train_loss"] < 4.0
    assert [e[0] for e in result["outcome"]["evals"]] == list(range(10, 101, 10))


def test_a_rollback_counts_the_sequences_of_a_cursor_over_pipelines_not_ranks(tmp_path):
    """A cursor names one micro-batch per data replica: 4 ranks in pipelines of 2 stages
    are 2 replicas (trainer/guard.py `rows`, the rollback's kept_sequences)."""
    from common.protocol import SegmentOutcome
    from tests.trainer.test_step_loop import FakeEngine
    from trainer.context import SegmentArgs, SegmentContext
    from trainer.guard import SpikeGuard

    rows = 128 // 32  # sequences of one micro-batch on one replica
    for layout, replicas in (("dp", 4), ({"tp": 1, "pp": 2, "zero": 0}, 2)):
        spec = tiny_spec(tmp_path / "store", **{**PP2, "train.procs_per_node": 4,
                                                "train.layout": layout})
        args = SegmentArgs(spec="-", dataset="-", to_step=4, workdir=str(tmp_path))
        guard = SpikeGuard(SegmentContext(args, spec, rank=0, world=4), FakeEngine(2),
                           SegmentOutcome(), None)
        assert guard.rows == rows * replicas
