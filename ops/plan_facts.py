"""The published and measured figures `mainspring plan` starts from, each with its source.

A default that has no published source says so ("assumption") and names the flag that
replaces it; the plan prints every default it used beside its source. The accelerators
(peaks, memory, links, default MFUs) are spec/hardware.py's, shared with the run spec's
layout planner. `BOUNDS`: every numeric flag's documented range.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.limits import MAX_BATCH_TOKENS
from spec.hardware import ACCELERATORS, Accelerator  # noqa: F401 — the table plan reads

# Llama 3 (arXiv 2407.21783, section 3.3.4): 419 unexpected interruptions in a 54-day
# snapshot of 405B pre-training on 16,384 H100s. One interruption per 3.09 h of the job is
# 16,384 x 3.09 h = 50,676 accelerator-hours between failures per accelerator.
LLAMA3_GPUS, LLAMA3_DAYS, LLAMA3_INTERRUPTIONS = 16_384, 54, 419
MTBF_HOURS_PER_ACCELERATOR = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS
MTBF_SOURCE = ("Llama 3 (arXiv 2407.21783): 419 unexpected interruptions in 54 days on "
               "16,384 H100s")

CHINCHILLA_TOKENS_PER_PARAM = 20.0
CHINCHILLA_SOURCE = "Chinchilla (Hoffmann et al. 2022, arXiv 2203.15556): ~20 tokens per parameter"

# Not published as such: stated so the user replaces them with the cluster's own figures
# (the soak's checkpoint stall, the recovery MTTR of `mainspring goodput`).
CHECKPOINT_S, CHECKPOINT_SOURCE = 60.0, ("assumption: one synchronous save of a sharded "
                                         "checkpoint; measure it and pass --checkpoint-s")
RESTART_S, RESTART_SOURCE = 600.0, ("assumption: re-schedule, reload and warm up after a "
                                    "failure; measure the MTTR and pass --restart-s")
OVERLAP, OVERLAP_SOURCE = 0.9, ("assumption: bucketed gradient reduction overlaps the "
                                "backward pass (DeepSpeed, PyTorch DDP/FSDP); pass --overlap")
BATCH_TOKENS, BATCH_SOURCE = 4e6, ("LLaMA (arXiv 2302.13971) and Llama 2 (arXiv 2307.09288): "
                                   "4M tokens per step")
SEQ_LEN, SEQ_SOURCE = 4096, "Llama 2 (arXiv 2307.09288): 4,096-token context"
ASPECT, ASPECT_SOURCE = 128, ("assumption: d_model = 128 x layers and N = 12 L d^2 (Llama 3 "
                              "405B: 16,384 / 126 = 130); pass --layers and --d-model")
API_OUTPUT_SHARE, API_OUTPUT_SOURCE = 0.25, ("assumption: one output token per three input "
                                             "tokens; pass --api-output-share")
# Llama 3's attention heads are 128 wide (arXiv 2407.21783 table 3: 4,096 / 32, 8,192 / 64,
# 16,384 / 128): the plan's heads, for the layout planner's TP divisibility.
HEAD_DIM = 128
# bf16 gradients and activations on the wire (the trainer's bf16 runs; Llama 3 trains BF16).
WIRE_BYTES = 2
# Adam in mixed precision keeps 16 bytes per parameter (ZeRO, arXiv 1910.02054, section 3.1).
STATE_BYTES_PER_PARAM = 16


@dataclass(frozen=True)
class Bound:
    """A flag's documented range, inclusive; `whole`: a count. Past it the flag is refused
    (exit 2, naming it) before any arithmetic: every figure the plan computes from values
    inside stays finite and every search in it short (the layout planner's divisors)."""

    lo: float
    hi: float
    whole: bool = False
    why: str = ""


DAY_S = 86400.0
COUNT = 10**7  # accelerators: 100 times the largest cluster trained on (~100,000 GPUs)
BOUNDS: dict[str, Bound] = {
    "--params": Bound(1, 1e15, why="1,000 times the largest models trained"),
    "--tokens": Bound(1, 1e17, why="6,000 times Llama 3's 15.6T"),
    "--accelerators": Bound(1, COUNT, whole=True),
    "--mfu-at": Bound(1, COUNT, whole=True),
    "--hour-price": Bound(1e-4, 1e4, why="USD per accelerator-hour"),
    "--mtbf-hours": Bound(1e-3, 1e9),
    "--checkpoint-s": Bound(1e-3, DAY_S, why="a save that stalls a day is no checkpoint"),
    "--restart-s": Bound(1e-3, 7 * DAY_S),
    "--peak-tflops": Bound(1e-3, 1e6),
    "--tp": Bound(1, 1024, whole=True, why="train.layout.tp's bound"),
    "--pp": Bound(1, 1024, whole=True, why="train.layout.pp's bound"),
    "--nodes-of": Bound(1, 1024, whole=True, why="train.procs_per_node's bound"),
    "--cores": Bound(1, 1 << 16, whole=True),
    "--layers": Bound(1, 10**4, whole=True),
    "--d-model": Bound(1, 1 << 20, whole=True),
    "--seq-len": Bound(1, 1 << 24, whole=True),
    "--batch-tokens": Bound(1, MAX_BATCH_TOKENS, why="the layout planner's, 2^36"),
    "--api-price-in": Bound(1e-6, 1e6, why="USD per million tokens"),
    "--api-price-out": Bound(1e-6, 1e6, why="USD per million tokens"),
    "--api-tokens-per-month": Bound(1, 1e18),
    # fractions: an MFU or goodput of under 0.01 % / 0.1 % is no training run
    "--mfu": Bound(1e-4, 1),
    "--goodput": Bound(1e-3, 1),
    "--overlap": Bound(0, 1),
    "--api-output-share": Bound(0, 1),
}


def bound_problem(flag: str, value: float) -> str | None:
    """Pure: why `value` is outside `flag`'s documented range (None: inside)."""
    b = BOUNDS[flag]
    if b.lo <= value <= b.hi:
        return None
    return f"{value:g} is outside {bound_text(b)}" + (f" ({b.why})" if b.why else "")


def bound_text(b: Bound) -> str:
    """"[1, 68,719,476,736]": whole numbers written out, fractions as they are."""
    def text(x: float) -> str:
        return f"{int(x):,}" if x >= 1 and x == int(x) and x < 1e16 else f"{x:g}"
    return f"[{text(b.lo)}, {text(b.hi)}]"
