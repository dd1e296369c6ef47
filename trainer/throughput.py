"""Throughput accounting: FLOPs per token, MFU, peak FLOP/s, peak memory.

FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B) and nanoGPT's
`estimate_mfu`: 6N for the forward and backward matmuls of N parameters, plus 12·L·d·T for
attention scores and values over a context of T tokens (H·Q = d_model). N counts weights
that take part in a matmul: the input embedding is a lookup, so an untied input embedding
is excluded, while a tied one is counted once because the LM head multiplies by it.
With packing a token attends to fewer than T positions; we keep the standard T so the
figure is comparable with published MFU numbers (it slightly overstates packed work).
"""

from __future__ import annotations

import json
import math
import resource
import time
from dataclasses import dataclass

import torch

from spec import ModelConfig
from storage.fs import keep_cached, read_cached

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_params(param_count: int, cfg: ModelConfig, vocab_size: int) -> int:
    """Parameters that do matmul work: all but an untied input embedding table."""
    return param_count if cfg.tie_embeddings else param_count - vocab_size * cfg.d_model


def flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12·L·d·T (PaLM appendix B)."""
    return 6.0 * n_params + 12.0 * n_layers * d_model * seq_len


def mfu(tokens_per_s: float, flops_token: float, peak_flops: float, devices: int = 1) -> float:
    """Achieved model FLOP/s over the peak of all devices, in [0, 1] for a sane peak."""
    return tokens_per_s * flops_token / (peak_flops * devices)


def measured_peak_flops(device: torch.device, dtype: torch.dtype, n: int = 0,
                        seconds: float = 0.3) -> float:
    """Dense matmul FLOP/s of this device in `dtype`: the best of repeated n×n products.

    A lower bound of the datasheet peak; on CPU, where there is no datasheet figure for a
    shared machine, it is the honest ceiling for MFU.
    """
    n = n or (4096 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best, deadline = float("inf"), time.perf_counter() + seconds
    torch.matmul(a, b)  # warm-up (kernel selection, caches)
    while True:
        sync(device)
        t0 = time.perf_counter()
        torch.matmul(a, b)
        sync(device)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return 2.0 * n ** 3 / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(configured_tflops: float, device: torch.device, dtype: torch.dtype,
               cache_dir: str | None = None) -> tuple[float, str]:
    """(peak FLOP/s per device, how it was obtained): the config if set, else a probe.

    With `cache_dir` (the run's local cache on this machine) a probe is taken once per
    device and dtype and reused by every later launch: a restart does not spend 0.3 s of
    each rank's start-up measuring the same matmul again, and the run's MFU is
    measured against one ceiling."""
    if configured_tflops > 0:
        return configured_tflops * 1e12, "config:train.peak_tflops"
    source = f"measured:matmul_probe:{dtype}".replace("torch.", "")
    name = f"peak-{device}-{dtype}.json".replace("torch.", "").replace(":", "")
    cached = read_cached(cache_dir, name) if cache_dir else None
    try:
        peak = float(json.loads(cached)["flops"]) if cached else 0.0
    except (ValueError, KeyError, TypeError):  # a torn or foreign file: measure again
        peak = 0.0
    if not (peak > 0 and math.isfinite(peak)):
        peak = measured_peak_flops(device, dtype)
        if cache_dir:
            keep_cached(cache_dir, name, json.dumps({"flops": peak}).encode())
    return peak, source


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory on CUDA; this process's peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


@dataclass
class Meter:
    """Running totals of one segment's optimizer steps (rank 0 reports them)."""

    flops_token: float
    peak: float  # FLOP/s per device
    peak_source: str
    devices: int
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0

    def add(self, tokens: int, seconds: float) -> dict[str, float]:
        """Record one step; return its progress fields."""
        self.steps, self.seconds, self.tokens = (self.steps + 1, self.seconds + seconds,
                                                 self.tokens + tokens)
        tps = tokens / seconds
        return {"tokens_per_s": tps, "step_time_s": seconds,
                "mfu": mfu(tps, self.flops_token, self.peak, self.devices)}

    def summary(self, device: torch.device) -> dict[str, float | str | None]:
        tps = self.tokens / self.seconds if self.seconds else None
        return {"tokens_per_s": tps,
                "step_time_s": self.seconds / self.steps if self.steps else None,
                "mfu": mfu(tps, self.flops_token, self.peak, self.devices) if tps else None,
                "flops_per_token": self.flops_token, "peak_tflops": self.peak / 1e12,
                "peak_source": self.peak_source, "peak_mem_bytes": peak_memory_bytes(device)}
