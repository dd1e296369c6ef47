"""What a checkpoint file may make its loader allocate (DESIGN §3: the bucket is data).

The weights-only unpickler (trainer/safe_load.py) runs no code, but it trusts the sizes a
file states. Three ways a file from the bucket made a rank allocate what it never held, or
crash on every retry:
- a zip member DEFLATE-compressed: 0.5 MB on disk, 512 MiB once torch inflates it (the
  manifest's size check bounds the file, not what it inflates to);
- a tensor whose shape claims more than its storage: torch raises RuntimeError, which
  reads as a hardware fault (retried) rather than a corrupt checkpoint (fallback);
- a stride-0 view: a one-element storage that loads as a tensor of 10^12 elements, which
  the first copy of it (into a parameter, `.float()`) tries to allocate.

So before `torch.load`, `archive_problem` reads the zip's central directory only (nothing
is inflated) and refuses a file whose members would inflate to more than the file itself
(its size is what the manifest vouched for: torch stores members uncompressed, so a file
it wrote always passes) or to more than the model's own shapes allow (`bytes_allowed`).
After it, `tensors_problem` refuses any tensor that spans more elements than its storage
holds. torch itself checks that each storage matches its member's size.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

import torch

__all__ = ["BYTES_PER_PARAM", "SLACK_BYTES", "archive_problem", "bytes_allowed",
           "model_numel", "tensors_problem"]

# One checkpoint file of a model with P parameters holds at most: the weights (4 bytes each
# in fp32), and with ZeRO 0 the optimizer state too (Adam's two moments, 8 bytes, plus an
# fp32 master copy under bf16, 4 bytes) — 16 bytes a parameter. Twice that leaves room for
# fp64 and layouts not measured here.
BYTES_PER_PARAM = 32
# What is not per parameter: RNG states, the LR scheduler, the loss scaler, DeepSpeed's
# bookkeeping (param shapes, fragment addresses). Measured in kilobytes for this project's
# models; 64 MiB is far above it and far below anything that hurts a node.
SLACK_BYTES = 64 << 20


def bytes_allowed(n_params: int) -> int:
    """Pure: the most one checkpoint file of a model of `n_params` parameters may hold."""
    return BYTES_PER_PARAM * n_params + SLACK_BYTES


def model_numel(module: torch.nn.Module) -> int:
    """A model's parameter count, also when ZeRO-3 has partitioned it (ds_numel: the full
    count; numel() is then this rank's empty placeholder)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


def archive_problem(path: str, max_bytes: int | None = None) -> str | None:
    """Why the zip at `path` may not be loaded (None: it may), from its central directory
    alone: not a zip (torch's legacy format allocates each storage at the size its pickle
    states before reading it), members that inflate past the file's own size, or past
    `max_bytes` (what the model's shapes allow)."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError) as exc:
        return f"not a torch zip archive ({exc})"[:200]
    inflated = sum(m.file_size for m in members)
    on_disk = os.path.getsize(path)
    if inflated > on_disk:
        packed = [m.filename for m in members if m.compress_type != zipfile.ZIP_STORED]
        return (f"members inflate to {inflated} bytes, more than the file's own {on_disk} "
                f"(compressed: {packed[:3]})")
    if max_bytes is not None and inflated > max_bytes:
        return (f"members hold {inflated} bytes, more than a checkpoint file of this model "
                f"may ({max_bytes})")
    return None


def tensors_problem(obj: Any) -> str | None:
    """Why a loaded object may not be used (None: it may): a tensor that spans more elements
    than its storage holds (a stride-0 or overlapping view, module doc). Walks containers
    and the allow-listed classes' fields without recursion (a pickle can nest deeply, and
    its memo can make a container hold itself)."""
    stack, seen = [obj], set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if problem := _tensor_problem(item):
                return problem
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend(vars(item).values())
    return None


def _tensor_problem(t: torch.Tensor) -> str | None:
    held = t.untyped_storage().nbytes() // max(1, t.element_size())
    if t.numel() > held:
        return (f"a tensor of shape {tuple(t.shape)} and stride {t.stride()} spans "
                f"{t.numel()} elements; its storage holds {held}")
    return None
