"""TrainState: everything outside DeepSpeed's own checkpoint that exact resume needs.

Saved per rank as `train_state-rank{r}.pt` next to DeepSpeed's files (RNG streams differ
per rank). The state dict holds only ints, lists and uint8 tensors, so it loads with
the weights-only loader every checkpoint file goes through (trainer/safe_load.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trainer.spikes import DetectorState

STATE_VERSION = 3  # 2: + detector, evals, skipped; 3: + skip_documents (older: empty ones)


def state_file(rank: int) -> str:
    return f"train_state-rank{rank}.pt"


@dataclass(kw_only=True)
class TrainState:
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0  # training tokens consumed by all ranks
    data_cursor: int = 0  # next micro-batch index (see trainer.data)
    skip_ranges: list[tuple[int, int]] = field(default_factory=list)  # [start, end) cursors
    # documents (numbers in the train split) that train nothing wherever they occur: a
    # spike's diagnosis accused them (trainer/guard.py, trainer/data.py mask_documents)
    skip_documents: list[int] = field(default_factory=list)
    detector: DetectorState = field(default_factory=DetectorState)  # trainer/spikes.py
    evals: list[list[float]] = field(default_factory=list)  # online evals: [step, train, val]
    skipped: list[int] = field(default_factory=list)  # steps whose update was not applied
    rng: dict[str, Any] = field(default_factory=dict)  # filled by capture_rng()

    def capture_rng(self) -> None:
        version, words, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        self.rng = {
            "python": [version, list(words), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    def restore_rng(self) -> None:
        if not self.rng:
            return
        version, words, gauss = self.rng["python"]
        random.setstate((version, tuple(words), gauss))
        name, keys, pos, has_gauss, cached = self.rng["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(self.rng["torch"])
        if self.rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.rng["cuda"])

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "data_cursor": self.data_cursor,
            "skip_ranges": [list(r) for r in self.skip_ranges],
            "skip_documents": list(self.skip_documents),
            "detector": self.detector.to_dict(),
            "evals": [list(e) for e in self.evals],
            "skipped": list(self.skipped),
            "rng": self.rng,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("version") not in (1, 2, STATE_VERSION):
            raise ValueError(f"train state version {sd.get('version')} != {STATE_VERSION}")
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])
        self.data_cursor = int(sd["data_cursor"])
        self.skip_ranges = [(int(a), int(b)) for a, b in sd["skip_ranges"]]
        self.skip_documents = [int(d) for d in sd.get("skip_documents", [])]
        self.detector = DetectorState.from_dict(sd["detector"]) if sd.get("detector") \
            else DetectorState()
        self.evals = [[int(e[0]), float(e[1]), float(e[2])] for e in sd.get("evals", [])]
        self.skipped = [int(s) for s in sd.get("skipped", [])]
        self.rng = sd["rng"]

    def save(self, path: str) -> None:
        self.capture_rng()
        torch.save(self.state_dict(), path)

    @classmethod
    def load(cls, path: str) -> TrainState:
        state = cls()
        from trainer.safe_load import safe_torch_load  # refuses a pickle payload

        state.load_state_dict(safe_torch_load(path))
        return state


def flat_tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside a (nested) checkpoint object, keyed by its path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) \
        if isinstance(obj, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(flat_tensors(value, f"{prefix}/{key}"))
    return out
