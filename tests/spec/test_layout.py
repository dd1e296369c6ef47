"""The layout planner against published training recipes, and `train.layout`'s refusals.

Each recipe names its source. The model shapes of Llama 3 (32/80/126 layers, d_model
4,096/8,192/16,384, 32/64/128 heads, 8 kv heads) are the Llama 3 paper's (arXiv 2407.21783,
table 3). Hardware: 8 accelerators per node, 80 GB each; H100 989 dense bf16 TFLOP/s,
NVLink 450 GB/s and one 400 Gb/s NIC (50 GB/s) per GPU; A100 312 TFLOP/s, 300 GB/s and
one 200 Gb/s NIC (25 GB/s) per GPU (the datasheets spec/hardware.py cites). The torchtitan
presets' degrees and batch sizes were read from the files themselves (pytorch/torchtitan at
01424cb for the 8B and 405B, 038d5fd for the 70B).
"""

from __future__ import annotations

import pytest

from common.errors import BadConfig
from spec import LayoutConfig, RunSpec, plan_layout
from spec.layout import TRAINED_TODAY, Layout, pp_degree, tp_degree
from tests.spec.helpers import pinned

H100 = dict(accelerators_per_node=8, accelerator_memory_gb=80.0, intra_node_gbps=450.0,
            inter_node_gbps=50.0, accelerator_tflops=989.0)
A100 = dict(accelerators_per_node=8, accelerator_memory_gb=80.0, intra_node_gbps=300.0,
            inter_node_gbps=25.0, accelerator_tflops=312.0)
LLAMA3_8B = dict(params=8.0e9, n_layers=32, n_heads=32, n_kv_heads=8, d_model=4096)
LLAMA3_70B = dict(params=70.6e9, n_layers=80, n_heads=64, n_kv_heads=8, d_model=8192)
LLAMA3_405B = dict(params=405e9, n_layers=126, n_heads=128, n_kv_heads=8, d_model=16384)
SEQ = 8192

# (recipe, source, planner inputs, published tp, pp, dp)
RECIPES = [
    ("torchtitan Llama 3 8B",
     "pytorch/torchtitan torchtitan/models/llama3/train_configs/llama3_8b.toml: a preset for "
     "64 A100s, tensor_parallel_degree 1, pipeline_parallel_degree 1, FSDP over all "
     "(data_parallel_shard_degree -1), batch_size 1, seq_len 8192",
     dict(**LLAMA3_8B, **A100, nodes=8, seq_len=SEQ, global_batch_tokens=64 * 1 * SEQ),
     1, 1, 64),
    ("torchtitan Llama 3 70B",
     "pytorch/torchtitan llama3_70b.toml: a preset for 64 A100s, tensor_parallel_degree 8, "
     "pipeline_parallel_degree 1, FSDP over the rest, local_batch_size 8, seq_len 8192",
     dict(**LLAMA3_70B, **A100, nodes=8, seq_len=SEQ, global_batch_tokens=8 * 8 * SEQ),
     8, 1, 8),
    ("torchtitan Llama 3 405B",
     "pytorch/torchtitan llama3_405b.toml: a preset for 128 H100s, tensor_parallel_degree 8, "
     "pipeline_parallel_degree 1, FSDP over the rest, batch_size 2, seq_len 8192, full "
     "activation checkpointing",
     dict(**LLAMA3_405B, **H100, nodes=16, seq_len=SEQ, global_batch_tokens=16 * 2 * SEQ),
     8, 1, 16),
    # Megatron-LM without ZeRO (max_zero 0): its PTD-P keeps each model-parallel rank's
    # whole optimizer state. Sequence 2048, A100 80 GB, 8 per server.
    ("Megatron-LM GPT 145.6B",
     "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters "
     "Using Megatron-LM (arXiv 2104.04473), table 1: 96 heads, hidden 12288, 80 layers, "
     "TP 8, PP 8, 1536 GPUs, batch 2304",
     dict(params=145.6e9, n_layers=80, n_heads=96, n_kv_heads=96, d_model=12288, **A100,
          nodes=192, seq_len=2048, global_batch_tokens=2304 * 2048, max_zero=0),
     8, 8, 24),
    ("Megatron-LM GPT 529.6B",
     "arXiv 2104.04473 table 1: 128 heads, hidden 20480, 105 layers, TP 8, PP 35, 2520 GPUs, "
     "batch 2520 (the shape and degrees MT-NLG 530B trained with, arXiv 2201.11990)",
     dict(params=529.6e9, n_layers=105, n_heads=128, n_kv_heads=128, d_model=20480, **A100,
          nodes=315, seq_len=2048, global_batch_tokens=2520 * 2048, max_zero=0),
     8, 35, 9),
    ("Megatron-LM GPT 1T",
     "arXiv 2104.04473 table 1: 160 heads, hidden 25600, 128 layers, TP 8, PP 64, 3072 GPUs, "
     "batch 3072",
     dict(params=1008e9, n_layers=128, n_heads=160, n_kv_heads=160, d_model=25600, **A100,
          nodes=384, seq_len=2048, global_batch_tokens=3072 * 2048, max_zero=0),
     8, 64, 6),
    ("Megatron-LM GPT 39.1B",
     "arXiv 2104.04473 table 1: 64 heads, hidden 8192, 48 layers, TP 8, PP 2, 512 GPUs, "
     "batch 1536",
     dict(params=39.1e9, n_layers=48, n_heads=64, n_kv_heads=64, d_model=8192, **A100,
          nodes=64, seq_len=2048, global_batch_tokens=1536 * 2048, max_zero=0),
     8, 2, 32),
]


@pytest.mark.parametrize(("recipe", "source", "inputs", "tp", "pp", "dp"), RECIPES,
                         ids=[r[0] for r in RECIPES])
def test_the_planner_reproduces_the_published_tp_and_pp(recipe, source, inputs, tp, pp, dp):
    lay = plan_layout(**inputs)
    assert (lay.tp, lay.pp, lay.dp) == (tp, pp, dp), (recipe, source, lay.reasons)
    assert lay.pp == 1 or lay.zero_stage <= 1  # DeepSpeed's pipeline engine: ZeRO <= 1
    assert lay.pp == 1 or inputs["global_batch_tokens"] // inputs["seq_len"] // lay.dp >= lay.pp
    assert lay.reasons[0].startswith(f"TP {tp}:")
    assert any(r.startswith(f"PP {pp}:") for r in lay.reasons)
    assert any(r.startswith(f"DP {dp} = ") for r in lay.reasons)


def test_a_model_too_big_for_half_an_accelerator_in_zero3_is_laid_out_with_recompute():
    # torchtitan's 405B preset on 128 H100s: ZeRO-3 leaves 50.6 GB of states per GPU, and
    # the preset turns on full activation checkpointing; the planner says nothing fits half
    # the memory and recomputes too.
    lay = plan_layout(**RECIPES[2][2])
    assert lay.zero_stage == 3 and lay.activation_recompute and lay.micro_batch == 1
    assert any(r.startswith("nothing fits half of 80 GB") for r in lay.reasons)


def test_llama3_405b_at_16k_gpus_is_the_one_recipe_laid_out_differently():
    # Llama 3 paper (arXiv 2407.21783) table 4: 16,384 H100s, TP 8, CP 1, PP 16, DP 128,
    # 16M tokens per batch of 8,192-token sequences, FSDP over DP; section 3.3.2 balances
    # its 126 layers over 16 stages by taking one layer out of the first and the last.
    # train.layout's stages hold equal layers, and no pipeline degree but 2 divides both 126
    # layers and a world of 2^14 accelerators (2 stages do not fit). With ZeRO-3 over the
    # data-parallel ranks the states fit (0.4 GB) and their traffic, 6.1 s a step on 50 GB/s,
    # stays under the 6.8 s of compute at 40 % MFU, so the planner keeps PP 1: valid, and
    # not the recipe's choice.
    inputs = dict(**LLAMA3_405B, **H100, nodes=2048, seq_len=SEQ, global_batch_tokens=16 * 2**20)
    lay = plan_layout(**inputs)
    assert (lay.tp, lay.pp, lay.dp, lay.zero_stage) == (8, 1, 2048, 3)
    assert "traffic (6.1 s per step) under the 6.8 s of compute" in lay.reasons[1]


def test_a_slow_inter_node_link_moves_the_model_into_pipeline_stages():
    # The torchtitan 70B recipe's cluster with 1 Gb/s Ethernet between nodes: ZeRO-2's
    # gradient traffic would take 247 s a step against 32 s of compute.
    inputs = {**RECIPES[1][2], "inter_node_gbps": 0.125}
    lay = plan_layout(**inputs)
    assert (lay.tp, lay.pp, lay.dp) == (8, 8, 1)
    assert lay.zero_stage <= 1
    assert any("the slow link calls for pipelines" in r for r in lay.reasons)
    fast = plan_layout(**RECIPES[1][2])
    assert fast.pp == 1 and not any("slow link" in r for r in fast.reasons)


def test_a_small_model_on_one_node_is_pure_data_parallel_with_the_lowest_zero_that_fits():
    lay = plan_layout(params=1.0e9, n_layers=16, n_heads=16, n_kv_heads=4, d_model=2048,
                      nodes=1, seq_len=2048, global_batch_tokens=64 * 2048, **H100)
    assert lay == Layout(tp=1, pp=1, dp=8, zero_stage=0, micro_batch=8,
                         activation_recompute=False, reasons=lay.reasons)
    assert lay.reasons[0] == "TP 1: the bf16 weights (2.0 GB) fit in half an accelerator (80 GB)"


# ---- train.layout ---------------------------------------------------------------------

DEMO_HASH = "c8357bb19b1b4caf"  # the demo preset's hash before train.layout existed


def _spec(layout, **over) -> RunSpec:
    return pinned(**{"train.layout": layout, **over})


def test_the_default_layout_is_data_parallel_and_leaves_the_spec_hash_alone():
    demo = pinned()
    assert demo.train.layout == "dp" and demo.spec_hash() == DEMO_HASH
    assert _spec("dp").spec_hash() == DEMO_HASH
    explicit = _spec({"tp": 1, "pp": 1, "zero": 0})
    assert explicit.train.layout == LayoutConfig(tp=1, pp=1, zero=0)
    assert explicit.spec_hash() != DEMO_HASH
    assert RunSpec.from_dict(explicit.to_dict()) == explicit


def _refused(layout, **over) -> BadConfig:
    with pytest.raises(BadConfig) as exc:
        _spec(layout, **over)
    return exc.value


TP_ONLY = {"train.procs_per_node": 4}


@pytest.mark.parametrize(("layout", "over", "field", "problem", "fix"), [
    ({"tp": 4, "pp": 1, "zero": 0},
     {**TP_ONLY, "model.n_heads": 8, "model.n_kv_heads": 2},
     "train.layout.tp", "TP 4 does not divide model.n_kv_heads=2", "use a tp dividing 2: 1, 2"),
    ({"tp": 3, "pp": 1, "zero": 0}, TP_ONLY,
     "train.layout.tp", "TP 3 does not divide model.n_kv_heads=4", "1, 2, 4"),
    ({"tp": 2, "pp": 1, "zero": 0}, {},
     "train.layout.tp", "above train.procs_per_node=1", "use tp <= 1"),
    ({"tp": 1, "pp": 4, "zero": 0}, {"train.nodes": 4, "train.grad_accum": 4},
     "train.layout.pp", "PP 4 does not divide model.n_layers=2", "use a pp dividing 2: 1, 2"),
    ({"tp": 1, "pp": 3, "zero": 0}, {"train.nodes": 3, "model.n_layers": 4},
     "train.layout.pp", "PP 3 does not divide model.n_layers=4", "1, 2"),
    ({"tp": 2, "pp": 2, "zero": 0},
     {"train.nodes": 3, "train.procs_per_node": 2, "train.grad_accum": 2},
     "train.layout", "= 4 does not divide the world of 6", "make tp x pp divide"),
    ({"tp": 1, "pp": 2, "zero": 2}, {"train.nodes": 2, "train.zero_stage": 2},
     "train.layout.pp", "DeepSpeed's pipeline engine refuses ZeRO 2 and 3",
     "use zero_stage 0 or 1"),
    ({"tp": 1, "pp": 1, "zero": 1}, {},
     "train.layout.zero", "differs from train.zero_stage=0", "set train.zero_stage to 1"),
    ({"tp": 1, "pp": 4, "zero": 0},
     {"train.nodes": 4, "train.min_nodes": 2, "model.n_layers": 4, "train.grad_accum": 4},
     "train.min_nodes", "on 2 nodes the world does not split", "raise min_nodes, or 0"),
    ({"tp": 1, "pp": 2, "zero": 0}, {"train.nodes": 2},
     "train.grad_accum", "1F1B needs at least as many micro-batches", "grad_accum >= 2"),
])
def test_an_impossible_layout_is_refused_naming_the_field_and_the_fix(layout, over, field,
                                                                      problem, fix):
    exc = _refused(layout, **over)
    assert exc.field == field and problem in exc.problem and fix in exc.fix, exc


def test_tp_above_one_inside_a_node_is_accepted_at_zero_0_to_2():
    for zero in (0, 1, 2):
        spec = _spec({"tp": 2, "pp": 1, "zero": zero},
                     **{"train.procs_per_node": 2, "train.zero_stage": zero,
                        "sweep.enabled": False})
        assert spec.train.layout == LayoutConfig(tp=2, pp=1, zero=zero)
        assert tp_degree(spec.train.layout) == 2
    assert tp_degree("dp") == 1


def test_pp_above_one_is_accepted_alone_at_zero_0_and_1_and_refused_beside_a_sweep():
    alone = {"train.nodes": 2, "train.grad_accum": 2, "train.eval_every": 0,
             "sweep.enabled": False}
    for zero in (0, 1):
        spec = _spec({"tp": 1, "pp": 2, "zero": zero}, **alone, **{"train.zero_stage": zero})
        assert spec.train.layout == LayoutConfig(tp=1, pp=2, zero=zero)
        assert pp_degree(spec.train.layout) == 2 and tp_degree(spec.train.layout) == 1
    assert pp_degree("dp") == 1
    exc = _refused({"tp": 1, "pp": 2, "zero": 0}, **{**alone, "sweep.enabled": True})
    assert exc.field == "sweep.enabled" and "with PP it would not be one" in exc.problem
    assert "pp above 1 trains" in TRAINED_TODAY


@pytest.mark.parametrize(("over", "field", "problem", "fix"), [
    ({"train.zero_stage": 3}, "train.layout.zero", "ZeRO 3 under TP is not built here",
     "use zero_stage 2"),
    ({"train.nodes": 2, "train.min_nodes": 1}, "train.min_nodes",
     "not resharded to fewer nodes", "set min_nodes to 0"),
    ({"sweep.enabled": True}, "sweep.enabled", "counts every rank as a data replica",
     'sweep with layout "dp"'),
])
def test_tp_where_the_trainer_does_not_support_it_yet_is_refused_naming_the_field(
        over, field, problem, fix):
    zero = over.get("train.zero_stage", 0)
    exc = _refused({"tp": 2, "pp": 1, "zero": zero},
                   **{"train.procs_per_node": 2, "sweep.enabled": False, **over})
    assert exc.field == field and problem in exc.problem and fix in exc.fix, exc


@pytest.mark.parametrize(("layout", "problem"), [
    ("tp2", "unknown layout 'tp2'"),
    (2, "expected a word or an object"),
])
def test_what_is_not_a_layout_is_refused(layout, problem):
    exc = _refused(layout)
    assert exc.field == "train.layout" and problem in exc.problem


# ---- train.layout: "auto" ---------------------------------------------------------------

# Llama 3 70B's shape (arXiv 2407.21783 table 3) as a run spec; its vocabulary (128,256)
# makes the parameter count 70.55B with untied embeddings, the published 70.6B.
LLAMA70 = {"model.d_model": 8192, "model.n_layers": 80, "model.n_heads": 64,
           "model.n_kv_heads": 8, "model.ffn_mult": 4.0 * 28672 / (8192 * 8 / 3),
           "model.seq_len": 8192, "model.tie_embeddings": False,
           "data.tokenizer.vocab_size": 128256, "train.micro_batch_tokens": 8192,
           "train.cluster": {"accelerator": "h100"}, "train.procs_per_node": 8,
           "sweep.enabled": False, "model.activation_checkpointing": True}


def test_auto_on_the_demo_model_plans_data_parallel_and_the_spec_holds_the_plan():
    spec = _spec("auto")
    lay = spec.train.layout
    assert (lay.tp, lay.pp, lay.zero) == (1, 1, 0) and spec.train.zero_stage == 0
    assert lay.why[0].startswith("planned for 1 x 1 CPU host (")
    assert lay.why[1].startswith("TP 1: the bf16 weights") and "(64 GB)" in lay.why[1]
    # the stored spec holds the plan, so the workflow and a resume read it, not "auto"
    again = RunSpec.from_dict(spec.to_dict())
    assert again == spec and again.spec_hash() == spec.spec_hash()
    assert spec.to_dict()["train"]["layout"]["why"] == list(lay.why)
    # the reasons are the record's, not the run's identity: the same degrees written out
    # hash alike
    written = _spec({"tp": 1, "pp": 1, "zero": 0})
    assert written.spec_hash() == spec.spec_hash()


def test_auto_never_plans_below_the_runs_own_zero_stage():
    spec = _spec("auto", **{"train.zero_stage": 2})
    assert spec.train.layout.zero == 2 == spec.train.zero_stage


def test_auto_plans_tp_inside_a_node_for_a_70b_model_on_eight_h100_nodes():
    spec = _spec("auto", **LLAMA70, **{"train.nodes": 8})
    lay = spec.train.layout
    # the bf16 weights (141 GB) do not fit half an H100, so TP over the node's 8; TP and PP
    # are not trained together here, so ZeRO 2 over 8 replicas fits the states (33 GB)
    assert (lay.tp, lay.pp, lay.zero) == (8, 1, 2), lay.why
    assert "8 x 8 NVIDIA H100 SXM (70,553,706,496 parameters)" in lay.why[0]
    assert lay.why[1].startswith("TP 8: the bf16 weights (141.1 GB) do not fit")


def test_auto_refuses_a_70b_model_on_two_h100_nodes_naming_what_would_fit():
    exc = _refused("auto", **LLAMA70, **{"train.nodes": 2})
    assert exc.field == "train.layout"
    assert "finds no layout the trainer runs whose model states fit half of 80 GB" \
        in exc.problem and "TP 8" in exc.problem
    assert "use more nodes" in exc.fix


def test_auto_above_a_zero_stage_tp_cannot_train_at_refuses_naming_the_stage():
    # TP 8 is needed and trains at ZeRO <= 2; the run asks for ZeRO 3 or above
    exc = _refused("auto", **LLAMA70, **{"train.nodes": 8, "train.zero_stage": 3})
    assert exc.field == "train.layout" and exc.problem.startswith('"auto": no pipeline')
    assert "at ZeRO 3 or above within what trains" in exc.problem
    assert "lower train.zero_stage" in exc.fix


def test_auto_refuses_a_micro_batch_whose_activations_do_not_fit_beside_the_states():
    over = {**LLAMA70, "train.nodes": 8, "model.activation_checkpointing": False,
            "train.micro_batch_tokens": 8 * 8192}
    exc = _refused("auto", **over)
    assert exc.field == "train.micro_batch_tokens" and "do not fit beside" in exc.problem
    assert "activation_checkpointing" in exc.fix


def test_auto_keeps_tp_and_pp_at_one_with_a_sweep_or_elastic_nodes_and_says_why():
    tiny = {"train.cluster": {"memory_gb": 0.002}, "train.procs_per_node": 2}
    swept = _refused("auto", **tiny, **{"sweep.enabled": True})
    assert "a sweep trains data parallel only (sweep.enabled)" in swept.problem
    elastic = _refused("auto", **tiny, **{"sweep.enabled": False, "train.nodes": 2,
                                          "train.min_nodes": 1})
    assert "elastic nodes (train.min_nodes)" in elastic.problem


def test_auto_plans_pipeline_stages_across_nodes_when_the_link_between_them_is_slow():
    # two CPU nodes of one rank each, joined by a 1 kB/s link: the gradients' all-reduce
    # would outrun the step, so the two layers go into two stages, one per node (ZeRO <= 1)
    spec = _spec("auto", **{"train.nodes": 2, "train.grad_accum": 2, "sweep.enabled": False,
                            "train.cluster": {"inter_node_gbps": 1e-6}})
    lay = spec.train.layout
    assert (lay.tp, lay.pp, lay.zero) == (1, 2, 0), lay.why
    assert any("the slow link calls for pipelines" in r for r in lay.why)
    # one micro-batch per step cannot fill two stages: 1F1B needs grad_accum >= pp
    one = _spec("auto", **{"train.nodes": 2, "sweep.enabled": False,
                           "train.cluster": {"inter_node_gbps": 1e-6}})
    assert one.train.layout.pp == 1


def test_an_unknown_accelerator_is_refused_naming_the_ones_known():
    with pytest.raises(BadConfig) as exc:
        _spec("auto", **{"train.cluster": {"accelerator": "tpu-v9"}})
    assert exc.value.field == "train.cluster.accelerator" and "h100" in exc.value.fix


def test_a_layout_object_takes_only_tp_pp_and_zero():
    exc = _refused({"tp": 1, "pp": 1, "zero": 0, "dp": 2})
    assert exc.field == "train.layout.dp" and exc.problem == "unknown field"
    exc = _refused({"tp": 0, "pp": 1, "zero": 0})
    assert exc.field == "train.layout.tp"
