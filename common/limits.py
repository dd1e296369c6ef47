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

# `MAX_BATCH_TOKENS`: the largest global batch (tokens a step) the layout planner plans for,
# a run's `train.layout: "auto"` (spec/layout.py) and `mainspring plan --batch-tokens`
# (ops/plan_facts.py) alike. Its micro-batch search walks the divisors of a data-parallel
# rank's sequences, O(sqrt n): at 2^36 that is at most 2^18 candidates (milliseconds), where
# 2^30-token micro-batches x 2^16 accumulations x 4 M ranks, each within its own bound,
# would be 2^34 (hours). 2^36 (69 G tokens) is 4,096 times Llama 3's 16 M tokens a step
# (arXiv 2407.21783, section 3.4.1).
MAX_BATCH_TOKENS = 2**36
