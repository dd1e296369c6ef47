"""benchmarks/scrub.py in miniature: its JSON line, and a scrub beside training that reads no
faster than its limit and takes CPU in proportion."""

from __future__ import annotations

import json

import pytest

from benchmarks.scrub import main

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)


def test_the_scrub_benchmark_prints_its_figures_and_the_scrub_keeps_to_its_rate(capsys):
    assert main(["--mb-per-s", "4", "--rounds", "4", "--interval-s", "0.5", "--ckpt-mb", "4",
                 "--model-mb", "4", "--width", "256"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["benchmark"] == "scrub" and line["value"] > 0 and line["ratio_of_means"] > 0
    assert 0 < line["scrub_mb_per_s_while_running"] <= 4 * 1.25  # manifests and imports aside
    assert 0 <= line["scrub_cpu_share_of_training_cores"] < 0.05
