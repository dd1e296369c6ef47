"""The GPU check's own logic on CPU (benchmarks/gpu/parts.py): the kill-and-resume verdict
and how it reads a segment's commits. The GPU run itself is benchmarks/gpu_check.sh."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu.parts import NOISE_FACTOR, commits, resume_verdict


def test_a_resume_that_equals_the_uninterrupted_run_is_bitwise_whatever_the_noise():
    assert resume_verdict(0.0, 0.0) == "bitwise"
    assert resume_verdict(0.0, 1e-3) == "bitwise"


def test_with_deterministic_kernels_any_difference_fails_the_resume():
    assert resume_verdict(1e-9, 0.0) == "FAILED"


def test_a_difference_within_the_noise_factor_passes_and_one_past_it_fails():
    noise = 2e-3
    assert resume_verdict(NOISE_FACTOR * noise, noise) == "within_tolerance"
    assert resume_verdict(NOISE_FACTOR * noise * 1.01, noise) == "FAILED"


def test_commits_are_read_from_progress_lines_of_type_commit_and_a_torn_last_line_is_skipped(
        tmp_path):
    progress = tmp_path / "progress.jsonl"
    lines = [{"type": "start", "step": 0}, {"type": "commit", "ts": 1.0, "step": 0},
             {"type": "step", "step": 4}, {"type": "commit", "ts": 2.0, "step": 4}]
    progress.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"type": "comm')
    assert commits(progress) == [0, 4]
    assert commits(tmp_path / "absent.jsonl") == []


@pytest.mark.process
def test_commits_reads_the_commit_lines_a_real_segment_writes(tmp_path):
    # The check kills a segment once it reads a commit: if the trainer's progress format
    # drifts from what `commits` parses, the kill never comes (as a text match once did).
    from tests.trainer.helpers import make_dataset, run_segment, tiny_spec, write_spec

    ds = make_dataset(tmp_path / "data")
    spec = write_spec(tiny_spec(tmp_path / "s", **{"train.checkpoint_every": 2}),
                      tmp_path / "spec.json")
    p = run_segment(spec, ds, 4, tmp_path / "w")
    assert p.returncode == 0, p.stderr[-3000:]
    assert commits(tmp_path / "w" / "progress.jsonl") == [0, 2, 4]


def test_step_losses_are_read_from_progress_lines_of_type_step(tmp_path):
    from benchmarks.gpu.parts import step_losses

    progress = tmp_path / "progress.jsonl"
    progress.write_text('{"type": "start"}\n{"type": "step", "step": 1, "loss": 6.5}\n'
                        '{"type": "commit", "step": 1}\n{"type": "step", "step": 2, "loss": 6.1}\n'
                        '{"type": "step", "step": 3, "lo')  # a torn last line
    assert step_losses(progress) == {1: 6.5, 2: 6.1}
