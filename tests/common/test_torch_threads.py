"""common/procs.py torch_threads: a trainer child's torch threads share the machine's cores
among its ranks and the trainer worker's concurrent jobs, unless the operator set
OMP_NUM_THREADS."""

from __future__ import annotations

from common.procs import SLOTS_ENV, torch_threads


def test_the_cores_are_shared_among_the_ranks_and_the_workers_jobs():
    assert torch_threads({}, cores=16, ranks=1) == 16  # one job, one rank: every core
    assert torch_threads({}, cores=16, ranks=4) == 4
    assert torch_threads({SLOTS_ENV: "2"}, cores=16, ranks=4) == 2  # two jobs side by side
    assert torch_threads({SLOTS_ENV: "2"}, cores=2, ranks=1) == 1  # the demo's two trials
    assert torch_threads({SLOTS_ENV: "4"}, cores=2, ranks=2) == 1  # never below one


def test_the_operators_omp_num_threads_wins_and_bad_values_are_ignored():
    assert torch_threads({"OMP_NUM_THREADS": "3", SLOTS_ENV: "2"}, cores=2, ranks=2) == 3
    for bad in ("", "0", "-1", "two", " "):
        assert torch_threads({"OMP_NUM_THREADS": bad}, cores=8, ranks=2) == 4
        assert torch_threads({SLOTS_ENV: bad}, cores=8, ranks=2) == 4
