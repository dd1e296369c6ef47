"""Load checkpoint files without running code from them (DESIGN §3: the bucket is data).

`torch.load` unpickles, and a pickle can call any importable function — a crafted
`mp_rank_00_model_states.pt` ran a shell command on restore. Every checkpoint
file is read here with `weights_only=True`: torch's restricted unpickler builds tensors
and plain containers only, plus the few DeepSpeed classes named in `allowed_globals`.
Anything else is refused before it runs, as `UnsafeCheckpointFile`.

The allow-list was found empirically: a real DeepSpeed 0.19 save of this project's model
(ZeRO 0/1/2/3, fp32 and bf16, world size 1; `torch.serialization.
get_unsafe_globals_in_checkpoint` on every file) needs exactly three globals, all in the
ZeRO optimizer shards: the `LossScaler` object (a static scale of 1 unless fp16), the
`fragment_address` dataclass (numel, start) and the `ZeroStageEnum` int enum.
`DynamicLossScaler` (fp16's loss scaler; CUDA only, so not measured here) holds the same
kind of plain fields. None defines `__setstate__` or `__reduce__`: the unpickler only
sets their `__dict__`, so allowing them runs no code of theirs.

`install_safe_loading(engine)` routes every file `engine.load_checkpoint` reads through
`safe_torch_load`: in DeepSpeed 0.19 the model/module states (SDLoader), the non-ZeRO
optimizer state and the ZeRO optimizer shards all go through `engine.checkpoint_engine.
load`. DeepSpeed's direct `torch.load(weights_only=False)` calls — the universal checkpoint
a resharded resume loads, `zero_to_fp32`, `ds_to_universal` — are made weights-only by
`force_weights_only` (every child's environment sets the same: common/procs.py), with the
allow-list installed process-wide. `safe_torch_load` is also bounded (trainer/load_bounds.py)
and turns every failure to load a file into UnsafeCheckpointFile: the checkpoint is corrupt.
"""

from __future__ import annotations

import copy
import functools
import os
import pickle
from typing import Any

import structlog
import torch

from common.errors import MainspringError
from common.procs import FORCED_CHILD_ENV
from storage.checkpoints import CorruptCheckpoint
from trainer.load_bounds import archive_problem, bytes_allowed, model_numel, tensors_problem

__all__ = ["UnsafeCheckpointFile", "as_corrupt", "force_weights_only", "install_safe_loading",
           "safe_torch_load"]

log = structlog.get_logger(__name__)


class UnsafeCheckpointFile(MainspringError):
    """A checkpoint file refused by the weights-only loader: its pickle asks for something
    beyond tensors and plain data (a callable, an unknown class; refused without running
    it), it is out of bounds (trainer/load_bounds.py), or it does not load at all.
    Deterministic — the file will not change on a retry — so a reader treats its
    checkpoint as corrupt and falls back."""

    retryable = False

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"checkpoint file {path} refused by the weights-only loader: {reason}")


def as_corrupt(step: int, exc: UnsafeCheckpointFile) -> CorruptCheckpoint:
    """A refused file makes its checkpoint corrupt (readers fall back past it)."""
    return CorruptCheckpoint(step, os.path.basename(exc.path), "a weights-only loadable file",
                             f"refused to unpickle: {exc.reason}"[:300])


@functools.cache
def allowed_globals() -> tuple[type, ...]:
    """The non-tensor classes a DeepSpeed checkpoint of this project holds (module doc).
    Imported on first use: DeepSpeed is heavy and only loaders need it."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return (LossScaler, DynamicLossScaler, fragment_address, ZeroStageEnum)


def force_weights_only() -> None:
    """Make every later `torch.load` in this process weights-only, with `allowed_globals`:
    also DeepSpeed's direct calls that pass weights_only=False (its universal-checkpoint
    load, `zero_to_fp32`, `ds_to_universal`) — torch reads the variable on each call
    (torch/serialization.py). The child environment sets it already (common/procs.py
    FORCED_CHILD_ENV); this holds it where a process was started some other way (a person
    running `python -m trainer.export`), and installs the allow-list, which no environment
    carries across a process boundary."""
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)  # both set: torch refuses all
    os.environ.update(FORCED_CHILD_ENV)
    torch.serialization.add_safe_globals(list(allowed_globals()))


def safe_torch_load(path: str, max_bytes: int | None = None, **kw: Any) -> Any:
    """`torch.load(path, weights_only=True, **kw)` with `allowed_globals`, bounded
    (trainer/load_bounds.py: what the file may inflate to — at most its own size and
    `max_bytes`, what the model's shapes allow — checked before anything is inflated, and
    every tensor within its storage after). A pickle that asks for anything else, a file
    out of bounds, or any other failure of its bytes to load raises UnsafeCheckpointFile:
    deterministic in the bytes, so its checkpoint is corrupt (a fallback), not a crash to
    retry. OSError and MemoryError (the node's, not the file's) propagate."""
    kw.pop("weights_only", None)  # never False, whatever a caller (DeepSpeed) passes
    path = str(path)
    if problem := archive_problem(path, max_bytes):
        raise _refused(path, problem)
    try:
        # process-wide, not torch's safe_globals context: leaving that removes the classes
        # again, also for the loads force_weights_only covers (DeepSpeed's own)
        torch.serialization.add_safe_globals(list(allowed_globals()))
        loaded = torch.load(path, weights_only=True, **kw)
    except pickle.UnpicklingError as exc:  # torch wraps every refusal of its unpickler in it
        raise _refused(path, first_line(exc)) from None
    except (MemoryError, OSError):
        # this node's state, not the file's (the bounds above keep a file from the first; a
        # torn or garbled zip is torch's RuntimeError): retried, the checkpoint left alone
        raise
    except Exception as exc:  # noqa: BLE001 — a shape past its storage, a torn zip, ...
        raise _refused(path, f"unreadable: {type(exc).__name__}: {first_line(exc)}") from None
    if problem := tensors_problem(loaded):
        raise _refused(path, problem)
    return loaded


def _refused(path: str, reason: str) -> UnsafeCheckpointFile:
    log.warning("checkpoint_file_refused", path=path, reason=reason)
    return UnsafeCheckpointFile(path, reason)


def first_line(exc: BaseException) -> str:
    """The refusal itself: torch wraps it in paragraphs of advice about weights_only=False."""
    paragraphs = [p.strip() for p in str(exc).split("\n\n") if p.strip()]
    core = [p for p in paragraphs if not p.startswith(("Weights only load failed",
                                                       "Check the documentation"))]
    return " ".join((core or paragraphs or [repr(exc)])[0].split())[:300]


@functools.cache
def _safe_engine_class() -> type:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch engine (saving unchanged) whose every load is weights-only."""

        max_bytes: int | None = None  # install_safe_loading: from the model's shapes

        def load(self, path: str, map_location=None):
            return safe_torch_load(path, map_location=map_location, max_bytes=self.max_bytes)

    return SafeTorchCheckpointEngine


def install_safe_loading(engine) -> None:
    """Make `engine.load_checkpoint` read every file through safe_torch_load (module doc).

    Only DeepSpeed's plain TorchCheckpointEngine is replaced (the one this project's config
    selects); another engine (fast/decoupled writers, DataStates) would read files its own
    way, so it is refused rather than silently left unsafe."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    force_weights_only()  # the loads DeepSpeed makes around its checkpoint engine too
    current = engine.checkpoint_engine
    if type(current) is _safe_engine_class():
        return
    if type(current) is not TorchCheckpointEngine:
        raise TypeError(f"install_safe_loading: DeepSpeed checkpoint engine "
                        f"{type(current).__name__} is not TorchCheckpointEngine; its loads "
                        "cannot be made weights-only here")
    safe = copy.copy(current)  # the same settings (serialization format), so saving is as before
    safe.__class__ = _safe_engine_class()
    safe.max_bytes = bytes_allowed(model_numel(engine.module))
    engine.checkpoint_engine = safe
