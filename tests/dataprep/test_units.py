"""Data prep's parallel parts: how many cores it uses, and heartbeats while it trains."""

from __future__ import annotations

import os

import pytest

import dataprep.pipeline as dataprep
from dataprep.pipeline import prepare_dataset
from dataprep.tokens import train_tokenizer
from dataprep.units import (
    AUTO_PARALLEL_MIN_BYTES,
    PARALLELISM_ENV,
    run_jobs,
    tokenizer_threads,
    worker_count,
    worker_pool,
)
from spec import CleaningConfig, DataConfig
from tests.dataprep.test_pipeline import NO_QUALITY, TEXTS, config, write_txt


def _pid_and_session() -> tuple[int, int]:
    return os.getpid(), os.getsid(0)


def test_auto_workers_are_every_core_this_process_may_use():
    cores = len(os.sched_getaffinity(0))
    auto = DataConfig(workers=0)
    assert worker_count(auto, 1000, AUTO_PARALLEL_MIN_BYTES, "/corpus") == cores
    assert worker_count(auto, 1000, AUTO_PARALLEL_MIN_BYTES - 1, "/corpus") == 1  # small
    assert worker_count(DataConfig(workers=3), 2, 1 << 30, "/corpus") == 2  # one per unit


def test_one_worker_trains_the_tokenizer_on_one_thread_and_restores_the_setting(
        tmp_path, monkeypatch):
    monkeypatch.setenv(PARALLELISM_ENV, "true")
    seen = []

    def recording(*args, **kw):
        seen.append(os.environ.get(PARALLELISM_ENV))
        return train_tokenizer(*args, **kw)

    monkeypatch.setattr(dataprep, "train_tokenizer", recording)
    corpus = write_txt(tmp_path / "c", TEXTS[:8])
    prepare_dataset(config(corpus, workers=1), str(tmp_path / "one"), seed=1)
    prepare_dataset(config(corpus, workers=0), str(tmp_path / "auto"), seed=1)
    assert seen == ["false", "true"]
    assert os.environ[PARALLELISM_ENV] == "true"


def test_tokenizer_threads_off_then_unset_leaves_it_unset(monkeypatch):
    monkeypatch.delenv(PARALLELISM_ENV, raising=False)
    with tokenizer_threads(False):
        assert os.environ[PARALLELISM_ENV] == "false"
    assert PARALLELISM_ENV not in os.environ


def test_tokenizer_training_ticks_while_it_trains_and_learns_the_same_vocabulary():
    texts = [t * 40 for t in TEXTS]
    ticks: list[float] = []
    ticking = train_tokenizer(texts, 400, tick=ticks.append, every_s=0.001)
    assert ticks and ticks == sorted(ticks)
    assert ticking.to_str() == train_tokenizer(texts, 400).to_str()


def test_training_heartbeats_reach_progress_during_the_tokenizer_phase(tmp_path, monkeypatch):
    monkeypatch.setattr("dataprep.tokens.TRAIN_TICK_S", 0.001)
    corpus = write_txt(tmp_path / "c", [t * 40 for t in TEXTS])
    seen: list[str] = []
    cleaning = CleaningConfig(min_chars=8, max_chars=100_000, **NO_QUALITY)
    prepare_dataset(config(corpus, cleaning=cleaning), str(tmp_path / "store"), seed=1,
                    progress=lambda phase, counts: seen.append(phase))
    assert "tokenizer_training" in seen
    assert seen.index("split") < seen.index("tokenizer_training") < seen.index("tokenizer")


@pytest.mark.process
def test_one_pool_of_workers_in_their_own_sessions_serves_every_phase():
    results: dict[str, dict[int, tuple[int, int]]] = {"clean": {}, "tokenize": {}}
    jobs = {i: (_pid_and_session, ()) for i in range(6)}
    with worker_pool(2) as pool:
        for outputs in results.values():
            run_jobs(jobs, pool, outputs.__setitem__)
    pids = {pid for phase in results.values() for pid, _ in phase.values()}
    sessions = {sid for phase in results.values() for _, sid in phase.values()}
    assert len(pids) <= 2 and os.getpid() not in pids  # the same two children throughout
    assert os.getsid(0) not in sessions and len(sessions) == len(pids)  # each its own
