"""A segment on fewer nodes than the spec asks for (`train.min_nodes`, docs/multinode.md):
the same global batch, by accumulating nodes / nodes-used times more per step. Pure.

The checkpoint it resumes from was written at the larger world size: the train state's
data cursor is rescaled on load (trainer/checkpointing.py:resharded) and DeepSpeed reshards
the ZeRO <= 2 optimizer state.
"""

from __future__ import annotations

import dataclasses

from common.errors import BadConfig
from spec import RunSpec


def on_nodes(spec: RunSpec, nnodes: int) -> RunSpec:
    """`spec` as a segment on `nnodes` nodes runs it (itself when nnodes == train.nodes)."""
    t = spec.train
    if nnodes == t.nodes:
        return spec
    if nnodes not in t.node_counts():
        raise BadConfig("--nnodes", f"{nnodes} nodes for a spec of train.nodes={t.nodes}, "
                        f"min_nodes={t.min_nodes}", f"use one of {t.node_counts()}")
    train = dataclasses.replace(t, nodes=nnodes, min_nodes=0,
                                grad_accum=t.grad_accum * (t.nodes // nnodes))
    return dataclasses.replace(spec, train=train)
