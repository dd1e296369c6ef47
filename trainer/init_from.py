"""`train.init_from`: a fresh run's model starts from another run's promoted weights.

Before the engine is built (so ZeRO's fp32 master copies start from them too), every rank
fetches the promoted checkpoint, verified file by file against its manifest, reads it with
the bounded weights-only loader and loads the module's weights; the optimizer starts fresh.
Only a run with no committed checkpoint of its own does this: its step-0 commit then holds
the loaded weights, and every later start restores its own checkpoints as usual. Whether
the source fits (model shape, tokenizer) was checked before any accelerator was used
(storage/init_source.py, on the data worker); a mismatch found here is the same BadConfig.
"""

from __future__ import annotations

import os
import shutil

import structlog
import torch

from common.errors import BadConfig, BadData
from spec import RunSpec
from storage.checkpoints import CorruptCheckpoint, step_dir
from storage.fast_tier import ensure_space
from storage.init_source import InitSource, promoted_source
from trainer.evaluate import load_weights
from trainer.merge import WeightsMisfit
from trainer.safe_load import UnsafeCheckpointFile

log = structlog.get_logger(__name__)


def load_init_weights(model: torch.nn.Module, spec: RunSpec, workdir: str,
                      rank: int = 0) -> InitSource:
    """Load `spec.train.init_from`'s promoted weights into `model`; return the source. Each
    rank fetches into a directory of its own: the ranks of a node share `workdir`, and two
    fetches into one directory remove and rename each other's files."""
    source = promoted_source(spec.storage.durable, spec.train.init_from)
    try:
        load_promoted(model, source, os.path.join(workdir, "init_from", f"rank{rank}"))
    except WeightsMisfit as exc:  # whole weights of another shape: another model's
        raise BadConfig("train.init_from", f"run {source.run_id}'s promoted step "
                        f"{source.step} does not fit this model ({exc})",
                        f"set model.* as run {source.run_id} has them") from None
    except (CorruptCheckpoint, UnsafeCheckpointFile) as exc:  # the same on every retry
        raise BadData(source.uri, f"run {source.run_id}'s promoted checkpoint cannot be "
                      f"loaded: {exc}", "promote a good checkpoint of that run again, or "
                      "start from another") from None
    log.info("initialized_from", **source.lineage())
    return source


def load_promoted(model: torch.nn.Module, source: InitSource, directory: str) -> None:
    """Fetch `source`'s promoted checkpoint under `directory` (one of this rank's own: the
    ranks of a node share a workdir), verified file by file against its manifest, load its
    weights into `model` with the bounded weights-only loader, and remove the copy. Raises
    what the store and the loader raise (CorruptCheckpoint, UnsafeCheckpointFile, and
    WeightsMisfit for weights of another shape), for the caller to name its field; DiskFull
    naming the directory, the bytes needed and free before any copy that would not fit (a
    full disk is the same on every retry, and a half copy fills it for the others)."""
    local = os.path.join(directory, step_dir(source.step))
    shutil.rmtree(local, ignore_errors=True)
    manifest = source.store.manifest(source.step)
    os.makedirs(directory, exist_ok=True)
    ensure_space(directory, manifest.total_bytes)
    try:
        source.store.fetch(source.step, local)
        load_weights(model, local, source.step, manifest.extra)
    finally:
        shutil.rmtree(local, ignore_errors=True)
