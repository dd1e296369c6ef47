"""Bounds shared by every layer that names the same quantity. Stdlib only.

`MAX_STEP`: the largest step number anything in mainspring names — the spec's step counts
and step fields (spec/codec.py), a checkpoint's directory `step-%09d` and the listing that
finds it again (storage/manifest.py), an operator's rollback target (activities/
contracts.py). One number, so a run the spec accepts commits checkpoints every reader
sees: 10^12 steps is ~3,000 years at 10 steps a second, and its directory name (13 digits)
stays far below any store's key-length limit.
"""

from __future__ import annotations

MAX_STEP = 10**12
