"""benchmarks/resume_hosts.py: which node writes which checkpoint file under DeepSpeed's
(data, tensor) mesh, the check that TP groups sit inside a host and DP across, and that a
pipeline's stages lie one per host; soak: the two-host exact resumes themselves
(`resume_exact.py --layout tp2dp2-hosts` and `pp2-hosts`, ~35 s each, root)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.resume_hosts import (
    check_stages_across_hosts,
    check_tp_inside_hosts,
    node_files,
    rank_of_file,
)

REPO = Path(__file__).resolve().parents[2]
FILES = ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
         *(f"train_state-rank{r}.pt" for r in range(4)),
         *(f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for d in range(2) for t in range(2))]


def test_a_file_is_written_by_the_rank_of_its_data_replica_and_tensor_shard():
    assert rank_of_file("zero_pp_rank_1_mp_rank_01_optim_states.pt", tp=2) == 3
    assert rank_of_file("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", tp=2) == 2
    assert rank_of_file("zero_pp_rank_1_mp_rank_00_optim_states.pt", tp=1) == 1
    assert rank_of_file("mp_rank_01_model_states.pt", tp=2) == 1  # replica 0 writes the module
    assert rank_of_file("train_state-rank3.pt", tp=2) == 3
    assert rank_of_file("layer_01-model_states.pt", tp=2) is None


def test_with_tp_fastest_a_node_of_two_ranks_holds_one_replicas_two_shards():
    assert node_files(FILES, tp=2, procs_per_node=2, node=1) == [
        "train_state-rank2.pt", "train_state-rank3.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_01_optim_states.pt"]
    assert len(node_files(FILES, tp=2, procs_per_node=2, node=0)) == 6


def step_dir(tmp_path: Path, part: list[str]) -> Path:
    for name in FILES:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "node-1.json").write_text(json.dumps(
        {"step": 8, "node_rank": 1, "session": "s", "files": {f: {} for f in part}}))
    return tmp_path


def test_node_ones_part_of_its_own_ranks_files_passes(tmp_path):
    got = check_tp_inside_hosts(step_dir(tmp_path, node_files(FILES, 2, 2, 1)), tp=2,
                                procs_per_node=2, nnodes=2)
    assert got["node0"]["data_replicas"] == [0] and got["node1"]["data_replicas"] == [1]


def test_a_part_of_tp_groups_laid_across_hosts_is_refused(tmp_path):
    # TP groups {0, 2} and {1, 3}: node 1 would write every replica's shard 1 and its module
    across = ["mp_rank_01_model_states.pt", "train_state-rank2.pt", "train_state-rank3.pt",
              "zero_pp_rank_0_mp_rank_01_optim_states.pt",
              "zero_pp_rank_1_mp_rank_01_optim_states.pt"]
    with pytest.raises(SystemExit, match="node 1 uploaded"):
        check_tp_inside_hosts(step_dir(tmp_path, across), tp=2, procs_per_node=2, nnodes=2)


def test_a_node_without_whole_tp_groups_is_refused(tmp_path):
    # one rank per node at TP 2: each node holds half of a group
    with pytest.raises(SystemExit, match="not whole TP 2 groups"):
        check_tp_inside_hosts(step_dir(tmp_path, []), tp=2, procs_per_node=1, nnodes=4)


def pipeline_step(tmp_path: Path, part: list[int]) -> Path:
    """A PP 2 step's files as the pipe engine writes them (layers 0-4: embedding, two blocks,
    norm, head), node 1's part record holding the layer files `part`."""
    layer = "layer_{:02d}-model_states.pt".format
    for i in range(5):
        (tmp_path / layer(i)).write_bytes(b"")
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "node-1.json").write_text(json.dumps(
        {"step": 8, "node_rank": 1, "session": "s",
         "files": {**{layer(i): {} for i in part}, "train_state-rank1.pt": {}}}))
    return tmp_path


def test_a_pipeline_with_its_second_stage_on_the_second_host_passes(tmp_path):
    got = check_stages_across_hosts(pipeline_step(tmp_path, [2, 3, 4]), nnodes=2)
    assert got == {"node0": {"layers": [0, 1]}, "node1": {"layers": [2, 3, 4]}}


@pytest.mark.parametrize("part", [[], [0, 1, 2, 3, 4], [1, 3]])
def test_stages_not_laid_one_per_host_in_order_are_refused(tmp_path, part):
    with pytest.raises(SystemExit, match="not one stage per host"):
        check_stages_across_hosts(pipeline_step(tmp_path, part), nnodes=2)


@pytest.mark.soak
@pytest.mark.parametrize(("layout", "configs"), [("tp2dp2-hosts", 1), ("pp2-hosts", 2)])
def test_a_layout_across_two_namespace_hosts_resumes_exactly(layout, configs):
    from tests.e2e.netns import netns_unavailable

    if reason := netns_unavailable():
        pytest.skip(reason)
    proc = subprocess.run([sys.executable, "benchmarks/resume_exact.py", "--layout", layout],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if '"figure"' in ln][-1])
    assert len(out["configs"]) == configs
    assert out["value"] == 0.0 and out["max_abs_state_diff"] == 0.0, out
    for config in out["configs"]:
        assert config["control_weight_change_resume_to_end"] > 0, config
        assert config["hosts"]["resumed_from"]["resumed-8"] == [4, 4], config
