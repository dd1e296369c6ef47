"""The LR windows reach the trainer through a file, not argv (one argv string of ~7,000
windows failed with E2BIG)."""

from __future__ import annotations

import json

import pytest

from trainer.schedule import lr_scale
from trainer.segment import parse_args

BASE = ["--spec", "spec.json", "--dataset", "file:///d/MANIFEST.json", "--to-step", "10",
        "--workdir", "w"]


def test_ten_thousand_lr_windows_reach_the_trainer_through_the_file(tmp_path):
    windows = [[i, i + 3, 0.5 + (i % 7) / 10] for i in range(10_000)]
    path = tmp_path / "lr_windows.json"
    path.write_text(json.dumps(windows))
    args = parse_args([*BASE, "--lr-windows-file", str(path)])
    assert [list(w) for w in args.lr_windows] == windows
    assert parse_args([*BASE, "--lr-windows", "[[0, 5, 0.5]]"]).lr_windows == ((0, 5, 0.5),)
    assert parse_args(BASE).lr_windows == ()
    with pytest.raises(SystemExit):  # one or the other
        parse_args([*BASE, "--lr-windows", "[]", "--lr-windows-file", str(path)])


def test_the_trainer_gives_composed_windows_the_factors_of_the_raw_ones():
    from workflows.lr_windows import compose_windows

    raw = [[0, 100, 0.5], [30, 50, 2.0], [40, 45, 0.8], [60, 200, 1.25], [150, 160, 0.5]]
    composed = compose_windows(raw)
    for step in range(210):
        assert lr_scale(composed, step) == pytest.approx(lr_scale(raw, step), rel=1e-12)
