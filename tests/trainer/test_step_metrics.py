"""The step loop's measurements for the Prometheus series (trainer/step_metrics.py), from a
real two-rank DeepSpeed segment on CPU/gloo run as the supervisor runs it: every step a real
gradient norm (at ZeRO 0 in fp32 the one DeepSpeed's clipping computed, trainer/engine.py
keeps it), memory of both ranks every
ops.metrics_every steps, the profiled steps' exposed communication, and each commit's
stall and upload lag."""

from __future__ import annotations

import json
import math

import pytest
import torch

from common.protocol import CommitLine, StepLine, parse_line
from tests.trainer.helpers import run_segment, tiny_spec, write_spec
from trainer.step_metrics import grad_norm, memory_bytes

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)


def test_a_two_rank_segment_reports_grad_norm_memory_overlap_and_checkpoint_timings(
        dataset_uri, tmp_path):
    spec = tiny_spec(tmp_path / "store", **{"train.procs_per_node": 2, "ops.profile_every": 3,
                                             "ops.metrics_every": 4})
    assert spec.train.zero_stage == 0 and spec.train.precision == "fp32"
    res = run_segment(write_spec(spec, tmp_path / "spec.json"), dataset_uri, 8,
                      tmp_path / "work", world=2)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [parse_line(t) for t in (tmp_path / "work" / "progress.jsonl").read_text().splitlines()]
    steps = [x for x in lines if isinstance(x, StepLine)]
    assert [s.step for s in steps] == list(range(1, 9))
    norms = [s.grad_norm for s in steps]
    assert all(isinstance(n, float) and math.isfinite(n) and n > 0 for n in norms), norms
    assert len(set(norms)) > 1  # measured each step, not a constant
    sampled = {s.step: s.mem_by_rank for s in steps if s.mem_by_rank is not None}
    assert sorted(sampled) == [4, 8]
    for per_rank in sampled.values():
        assert [r for r, _, _ in per_rank] == [0, 1], per_rank  # both ranks of the node
        assert all(peak >= now > 0 for _, peak, now in per_rank), per_rank
    profiled = {s.step: (s.comm_exposed_s, s.comm_exposed_frac) for s in steps
                if s.comm_exposed_frac is not None}
    assert sorted(profiled) == [3, 6]
    # two ranks all-reduce their gradients every step: some of it is exposed on CPU
    assert all(s > 0 and 0 < f <= 1 for s, f in profiled.values()), profiled
    commits = [x for x in lines if isinstance(x, CommitLine)]
    assert [c.step for c in commits] == [0, 4, 8]
    assert all(c.stall_s is not None and c.stall_s > 0 and c.upload_lag_s >= 0
               for c in commits), commits
    # an older supervisor's reader drops the new fields; an older line still parses
    old = json.dumps({"type": "step", "step": 1, "loss": 2.0, "lr": 0.1, "ts": 1.0})
    assert parse_line(old).grad_norm is None and parse_line(old).mem_by_rank is None


def test_the_norm_computed_at_zero_0_is_the_one_deepspeed_keeps_at_zero_2(dataset_uri, tmp_path):
    norms = {}
    for stage in (0, 2):  # ZeRO 0 in fp32: its clipping's, kept; ZeRO 2: DeepSpeed's own
        spec = tiny_spec(tmp_path / f"store{stage}", **{"train.zero_stage": stage})
        res = run_segment(write_spec(spec, tmp_path / f"spec{stage}.json"), dataset_uri, 2,
                          tmp_path / f"work{stage}")
        assert res.returncode == 0, res.stderr[-3000:]
        lines = (tmp_path / f"work{stage}" / "progress.jsonl").read_text().splitlines()
        norms[stage] = [x.grad_norm for x in map(parse_line, lines) if isinstance(x, StepLine)]
    assert norms[0][0] == pytest.approx(norms[2][0], rel=1e-5)  # same weights, same batch


def test_grad_norm_is_the_2_norm_of_all_gradients_and_none_without_any():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    assert grad_norm([a, b]) is None
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert float(grad_norm([a, b])) == 5.0
    assert float(torch.nn.utils.clip_grad_norm_([a, b], max_norm=1.0)) == 5.0  # DeepSpeed's
    # figure is the same pre-clip norm


def test_cpu_memory_is_peak_and_current_rss_of_this_process():
    peak, now = memory_bytes(torch.device("cpu"))
    assert peak >= now > 0
