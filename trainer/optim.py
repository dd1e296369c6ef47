"""The optimizer DeepSpeed wraps: torch.optim.AdamW whose next update can be vetoed.

A skipped step (trainer/spikes.py verdict `skip`) must leave the model exactly as if the
batch had never been seen: parameters, both Adam moments and the per-parameter step
counts (bias correction) untouched. Zeroing the gradients is not enough (the moments
decay and weight decay still applies), so the veto sits inside `step()`: DeepSpeed's
wrappers (ZeRO 1-2 partitions, bf16 master weights) call it once per optimizer step, then
copy master weights back and zero the gradients — unchanged weights copy back unchanged.
"""

from __future__ import annotations

import torch


class SkippableAdamW(torch.optim.AdamW):
    """AdamW; set `veto = True` before `engine.step()` to skip that one update."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.veto = False
        self.vetoed = 0  # updates skipped by this process

    @torch.no_grad()
    def step(self, closure=None):
        if self.veto:
            self.veto = False
            self.vetoed += 1
            return None
        return super().step(closure)


def build_optimizer(param_groups: list[dict], params: dict) -> SkippableAdamW:
    """From the derived DeepSpeed config's optimizer params (trainer.engine)."""
    kwargs = {k: v for k, v in params.items() if k not in ("torch_adam", "adam_w_mode")}
    kwargs["betas"] = tuple(kwargs["betas"])
    return SkippableAdamW(param_groups, **kwargs)
