"""TrainState round-trips through torch.save and restores every RNG stream."""

from __future__ import annotations

import random

import numpy as np
import torch

from trainer.state import TrainState, state_file


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(2).tolist()


def test_restore_rng_replays_python_numpy_and_torch_draws():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = TrainState()
    state.capture_rng()
    expected = draws()
    draws()  # move every stream on
    state.restore_rng()
    assert draws() == expected


def test_state_round_trips_through_a_weights_only_torch_file(tmp_path):
    state = TrainState(step=12, tokens_seen=3072, data_cursor=14, skip_ranges=[(3, 5)])
    path = tmp_path / state_file(1)
    state.save(str(path))
    loaded = TrainState.load(str(path))  # TrainState.load uses weights_only=True
    assert (loaded.step, loaded.tokens_seen, loaded.data_cursor) == (12, 3072, 14)
    assert loaded.skip_ranges == [(3, 5)]
    expected = draws()
    loaded.restore_rng()
    assert draws() == expected
    assert path.name == "train_state-rank1.pt"


def test_skipped_documents_round_trip_and_an_older_state_loads_with_none(tmp_path):
    state = TrainState(step=8, skip_ranges=[(3, 5)], skip_documents=[17, 4096])
    state.save(str(tmp_path / "s.pt"))
    assert TrainState.load(str(tmp_path / "s.pt")).skip_documents == [17, 4096]
    old = state.state_dict()
    del old["skip_documents"]
    old["version"] = 2  # written before documents could be skipped
    fresh = TrainState()
    fresh.load_state_dict(old)
    assert fresh.skip_documents == [] and fresh.skip_ranges == [(3, 5)]


def test_detector_state_evals_and_skips_round_trip_and_version_1_still_loads(tmp_path):
    from trainer.spikes import DetectorState

    det = DetectorState(history=(3.0, 2.9, float("nan")), seen=40, outliers=(37, 39))
    state = TrainState(step=40, detector=det, evals=[[20, 3.1, 3.2], [40, 2.9, 3.0]],
                       skipped=[37, 39])
    state.save(str(tmp_path / "s.pt"))
    loaded = TrainState.load(str(tmp_path / "s.pt"))
    back = loaded.detector
    assert back.seen == 40 and back.outliers == (37, 39) and back.history[:2] == (3.0, 2.9)
    assert loaded.evals == [[20, 3.1, 3.2], [40, 2.9, 3.0]] and loaded.skipped == [37, 39]
    old = state.state_dict()
    for key in ("detector", "evals", "skipped"):
        del old[key]
    old["version"] = 1  # a checkpoint written before spike handling
    fresh = TrainState()
    fresh.load_state_dict(old)
    assert fresh.step == 40 and fresh.detector == DetectorState()
    assert fresh.evals == [] and fresh.skipped == []
