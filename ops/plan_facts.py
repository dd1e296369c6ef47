"""The published and measured figures `mainspring plan` starts from, each with its source.

A default that has no published source says so ("assumption") and names the flag that
replaces it; the plan prints every default it used beside its source. The accelerators
(peaks, memory, links, default MFUs) are spec/hardware.py's, shared with the run spec's
layout planner.
"""

from __future__ import annotations

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
