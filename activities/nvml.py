"""NVML's view of this worker's GPUs, for its Prometheus endpoint.

`pynvml` comes from the `nvidia-ml-py` package (the `nvml` extra, also in `gpu`) and is
imported only here, only when asked: without the package, without an NVIDIA driver or
without a GPU, `shared()` is None and nothing is sampled — a CPU worker never needs it.
The worker process itself samples, in a thread of its own every SAMPLE_EVERY_S (no torch
here): the GPUs its trainer children see, `CUDA_VISIBLE_DEVICES` (indices or UUIDs) when
it is set, else all of them; the supervisors of its segments publish the newest sample
under their run's id.

Each sample, per GPU (NVML's own figures; a query the device does not support is None):
utilisation and memory-bandwidth utilisation (`nvmlDeviceGetUtilizationRates`: the
fraction of the last sample period in which a kernel ran / device memory was read or
written), memory used, PCIe throughput each way (`nvmlDeviceGetPcieThroughput`, KB/s
over a 20 ms window), power (mW), temperature (°C) and the volatile ECC error counts
(since the driver loaded; corrected and uncorrected).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment, in base units (fractions, bytes, bytes/s, W, °C)."""

    gpu: str  # NVML's index
    utilization: float | None = None
    memory_used: int | None = None
    memory_bandwidth: float | None = None
    pcie_tx: float | None = None
    pcie_rx: float | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None


def visible(count: int, cuda_visible: str | None) -> list[str]:
    """Pure: which GPUs the trainer sees, as NVML indices ("0", "1", …) or UUIDs
    ("GPU-…", "MIG-…"), from CUDA_VISIBLE_DEVICES (None: unset, every GPU)."""
    if cuda_visible is None:
        return [str(i) for i in range(count)]
    out = []
    for item in (x.strip() for x in cuda_visible.split(",")):
        if item.isdigit() and int(item) < count:
            out.append(item)
        elif item.startswith(("GPU-", "MIG-")):
            out.append(item)
        else:
            break  # CUDA stops at the first entry it cannot read
    return out


class Nvml:
    """An initialised NVML (`nv`: the pynvml module) and the handles of the GPUs to sample."""

    def __init__(self, nv: Any, gpus: list[tuple[str, Any]]) -> None:
        self.nv, self.gpus = nv, gpus
        self._latest: list[GpuSample] = []
        self._stop = threading.Event()

    def latest(self) -> list[GpuSample]:
        """The newest sample of the background sampler (start()), [] before its first."""
        return self._latest

    def start(self, every_s: float) -> Nvml:
        """Sample every `every_s` in a daemon thread: a PCIe query blocks for its 20 ms
        window per GPU and direction, which the supervisor's loop must not wait for."""
        def run() -> None:
            self._latest = self.sample()
            while not self._stop.wait(every_s):
                self._latest = self.sample()
        threading.Thread(target=run, name="mainspring-nvml", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @classmethod
    def open(cls, cuda_visible: str | None = None) -> Nvml | None:
        """None without pynvml, a driver or a GPU (logged once, never raised)."""
        try:
            import pynvml as nv
        except ImportError:
            return None
        try:
            nv.nvmlInit()
            gpus = []
            for name in visible(nv.nvmlDeviceGetCount(), cuda_visible):
                handle = nv.nvmlDeviceGetHandleByUUID(name) if name.startswith(("GPU-", "MIG-")) \
                    else nv.nvmlDeviceGetHandleByIndex(int(name))
                gpus.append((str(nv.nvmlDeviceGetIndex(handle)), handle))
        except nv.NVMLError as exc:  # no driver (NVML_ERROR_LIBRARY_NOT_FOUND), no GPU
            log.info("nvml_unavailable", error=str(exc))
            return None
        if not gpus:
            return None
        log.info("nvml_sampling", gpus=[g for g, _ in gpus])
        return cls(nv, gpus)

    def sample(self) -> list[GpuSample]:
        return [self._one(index, handle) for index, handle in self.gpus]

    def _one(self, index: str, h: Any) -> GpuSample:
        nv, q = self.nv, self._query
        rates = q(nv.nvmlDeviceGetUtilizationRates, h)
        memory = q(nv.nvmlDeviceGetMemoryInfo, h)
        power = q(nv.nvmlDeviceGetPowerUsage, h)
        tx = q(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES)
        rx = q(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES)
        return GpuSample(
            gpu=index,
            utilization=rates.gpu / 100.0 if rates is not None else None,
            memory_bandwidth=rates.memory / 100.0 if rates is not None else None,
            memory_used=int(memory.used) if memory is not None else None,
            pcie_tx=tx * 1024.0 if tx is not None else None,  # KB/s (NVML's KB: 1024 B)
            pcie_rx=rx * 1024.0 if rx is not None else None,
            power_w=power / 1000.0 if power is not None else None,  # mW
            temperature_c=q(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
            ecc_corrected=q(nv.nvmlDeviceGetTotalEccErrors, h,
                            nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
            ecc_uncorrected=q(nv.nvmlDeviceGetTotalEccErrors, h,
                              nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))

    def _query(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML query; None where the device does not support it (ECC off, a
        consumer card's PCIe counters) or it fails this time."""
        try:
            return fn(*args)
        except self.nv.NVMLError as exc:
            log.debug("nvml_query_failed", query=fn.__name__, error=str(exc))
            return None


_lock = threading.Lock()
_opened: list[Nvml | None] = []  # [the process's Nvml or None], once opened


SAMPLE_EVERY_S = 2.0


def shared() -> Nvml | None:
    """The worker process's NVML, opened and sampling from the first use (None on a CPU
    machine)."""
    with _lock:
        if not _opened:
            opened = Nvml.open(os.environ.get("CUDA_VISIBLE_DEVICES"))
            _opened.append(opened.start(SAMPLE_EVERY_S) if opened else None)
        return _opened[0]
