"""The accelerators a run or a plan may name: each one's dense bf16 peak, memory, links and a
default MFU, with the source of every figure. Pure data, stdlib only: the run spec's layout
planner (spec/layout.py, `train.layout: "auto"`) and `mainspring plan` (ops/plan_facts.py)
read the same table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One accelerator class: its dense bf16 peak, a default MFU and its links."""

    name: str
    peak_tflops: float  # dense bf16, no sparsity
    peak_source: str
    mfu: float  # the default model-FLOPs utilization, end to end
    mfu_low: float
    mfu_high: float
    mfu_at: int  # how many accelerators the default MFU was measured on
    mfu_source: str
    intra_gbs: float  # GB/s per accelerator, one direction, inside a node
    intra_source: str
    inter_gbs: float  # GB/s per accelerator, one direction, between nodes
    inter_source: str
    per_node: int
    memory_gb: float


ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator(
        name="NVIDIA H100 SXM", peak_tflops=989.0,
        peak_source="NVIDIA H100 datasheet: 989 TFLOP/s dense BF16 (1,979 with sparsity)",
        mfu=0.40, mfu_low=0.38, mfu_high=0.43, mfu_at=16_384,
        mfu_source="Llama 3 (arXiv 2407.21783) table 4: 380-430 TFLOP/s per GPU on "
                   "8,192-16,384 H100s, 400 at 16,384",
        intra_gbs=450.0, intra_source="NVLink 4: 900 GB/s per GPU, both directions (datasheet)",
        inter_gbs=50.0, inter_source="one 400 Gb/s InfiniBand/RoCE NIC per GPU (DGX H100; "
                                     "Llama 3's fabric)",
        per_node=8, memory_gb=80.0),
    "h200": Accelerator(
        name="NVIDIA H200 SXM", peak_tflops=989.0,
        peak_source="NVIDIA H200 datasheet: 989 TFLOP/s dense BF16 (1,979 with sparsity)",
        mfu=0.457, mfu_low=0.38, mfu_high=0.545, mfu_at=1,
        mfu_source="measured by this project on one H200 (README, gpu_check): 1B model, bf16, "
                   "packed rows, per-block compile 0.457, one document per row 0.545; low: "
                   "Llama 3 at 16,384 GPUs of the same peak",
        intra_gbs=450.0, intra_source="NVLink 4: 900 GB/s per GPU, both directions (datasheet)",
        inter_gbs=50.0, inter_source="one 400 Gb/s InfiniBand NIC per GPU (DGX H200)",
        per_node=8, memory_gb=141.0),
    "a100": Accelerator(
        name="NVIDIA A100 SXM", peak_tflops=312.0,
        peak_source="NVIDIA A100 datasheet: 312 TFLOP/s dense BF16 (624 with sparsity)",
        mfu=0.50, mfu_low=0.48, mfu_high=0.56, mfu_at=2_048,
        mfu_source="LLaMA (arXiv 2302.13971): 380 tokens/s per GPU for 65B on 2,048 A100s "
                   "= 0.50; BLOOM: ~150 TFLOP/s per GPU on 384 (0.48); TinyLlama README: "
                   "0.56 on 16",
        intra_gbs=300.0, intra_source="NVLink 3: 600 GB/s per GPU, both directions (datasheet)",
        inter_gbs=25.0, inter_source="one 200 Gb/s HDR InfiniBand NIC per GPU (DGX A100)",
        per_node=8, memory_gb=80.0),
    "cpu": Accelerator(
        name="CPU host", peak_tflops=1.0,
        peak_source="assumption: no datasheet for a shared host; measure the bf16 matmul "
                    "ceiling (trainer/throughput.py's probe) and pass --peak-tflops",
        mfu=0.2, mfu_low=0.1, mfu_high=0.23, mfu_at=1,
        mfu_source="this project's recorded CPU run (tests/fixtures/report_run): MFU 0.10-0.23 "
                   "of the measured matmul ceiling",
        intra_gbs=10.0, intra_source="assumption: gloo through shared memory on one host",
        inter_gbs=1.25, inter_source="assumption: 10 Gb/s Ethernet between hosts",
        per_node=2, memory_gb=64.0),
}
