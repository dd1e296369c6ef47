"""NVML sampling (activities/nvml.py): which GPUs, NVML's units into base units, a query the
device does not support left out — and nothing at all on a machine without NVML. NVML
itself runs only on an NVIDIA machine, so the readings here come from a stand-in module
with pynvml's names and NVML's documented units; on this CPU machine the real import path
is the one exercised by `shared()`."""

from __future__ import annotations

import types

import pytest

from activities import nvml
from activities.nvml import Nvml, visible


class NVMLError(Exception):
    pass


def fake_pynvml(ecc: bool) -> types.SimpleNamespace:
    def total_ecc(handle, error_type, counter_type):
        if not ecc:
            raise NVMLError("Not Supported")
        return {0: 12, 1: 1}[error_type]

    return types.SimpleNamespace(
        NVMLError=NVMLError, NVML_PCIE_UTIL_TX_BYTES=0, NVML_PCIE_UTIL_RX_BYTES=1,
        NVML_TEMPERATURE_GPU=0, NVML_MEMORY_ERROR_TYPE_CORRECTED=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=87, memory=41),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=40 * 2**30, total=80 * 2**30),
        nvmlDeviceGetPowerUsage=lambda h: 312_500,  # mW
        nvmlDeviceGetPcieThroughput=lambda h, c: (1000, 250)[c],  # KB/s
        nvmlDeviceGetTemperature=lambda h, sensor: 64,  # °C
        nvmlDeviceGetTotalEccErrors=total_ecc)


def test_a_sample_is_in_base_units_and_unsupported_queries_are_none():
    [s] = Nvml(fake_pynvml(ecc=True), [("3", object())]).sample()
    assert (s.gpu, s.utilization, s.memory_bandwidth) == ("3", 0.87, 0.41)
    assert s.memory_used == 40 * 2**30
    assert (s.pcie_tx, s.pcie_rx) == (1000 * 1024.0, 250 * 1024.0)
    assert (s.power_w, s.temperature_c) == (312.5, 64)
    assert (s.ecc_corrected, s.ecc_uncorrected) == (12, 1)
    [s] = Nvml(fake_pynvml(ecc=False), [("0", object())]).sample()
    assert (s.ecc_corrected, s.ecc_uncorrected, s.utilization) == (None, None, 0.87)


@pytest.mark.parametrize("cuda_visible, expected", [
    (None, ["0", "1", "2", "3"]), ("2,0", ["2", "0"]), ("", []), ("1,7,2", ["1"]),
    ("GPU-8a1b,1", ["GPU-8a1b", "1"]), ("foo,1", [])])
def test_the_gpus_sampled_are_the_ones_cuda_visible_devices_shows_the_trainer(
        cuda_visible, expected):
    assert visible(4, cuda_visible) == expected


def test_without_pynvml_or_a_driver_nothing_is_sampled_and_nothing_raises(monkeypatch):
    monkeypatch.setattr(nvml, "_opened", [])
    try:
        import pynvml  # noqa: F401  (the nvml extra; absent from a CPU install)
    except ImportError:
        assert Nvml.open() is None
    else:  # installed: only a machine with an NVIDIA driver and GPU gets a sampler
        import glob
        assert (Nvml.open() is None) == (not glob.glob("/dev/nvidia[0-9]*"))
    assert nvml.shared() is nvml.shared()  # opened once per process
