"""FLOPs per token, MFU and the peak they are measured against."""

from __future__ import annotations

import os

import pytest
import torch

from spec import ModelConfig
from trainer.model import GPT
from trainer.throughput import (
    Meter,
    flops_per_token,
    matmul_params,
    measured_peak_flops,
    mfu,
    peak_flops,
    peak_memory_bytes,
)


def test_flops_per_token_is_six_n_plus_attention_term():
    # GPT-2 124M-like: 6 * 85M + 12 * 12 * 768 * 1024 (nanoGPT's estimate_mfu numbers).
    assert flops_per_token(85_000_000, 12, 768, 1024) == 6 * 85_000_000 + 12 * 12 * 768 * 1024
    assert flops_per_token(10, 2, 4, 8) - flops_per_token(10, 2, 4, 4) == 12 * 2 * 4 * 4


def test_untied_input_embedding_is_not_matmul_work_but_tied_one_is():
    tied = ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=4, tie_embeddings=True)
    untied = ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=4, tie_embeddings=False)
    n_tied, n_untied = GPT(tied, 100).param_count(), GPT(untied, 100).param_count()
    assert matmul_params(n_tied, tied, 100) == n_tied
    assert matmul_params(n_untied, untied, 100) == n_untied - 100 * 32 == n_tied


def test_mfu_is_achieved_over_peak_flops_across_devices():
    assert mfu(1000.0, 1e9, 4e12) == pytest.approx(0.25)
    assert mfu(1000.0, 1e9, 4e12, devices=2) == pytest.approx(0.125)


def test_configured_peak_wins_over_the_probe():
    assert peak_flops(989.0, torch.device("cpu"), torch.float32) == (989e12,
                                                                      "config:train.peak_tflops")


def test_matmul_probe_measures_a_positive_cpu_peak_and_names_its_dtype():
    measured = measured_peak_flops(torch.device("cpu"), torch.float32, n=128, seconds=0.05)
    assert 1e6 < measured < 1e14
    peak, source = peak_flops(0.0, torch.device("cpu"), torch.float32)
    assert peak > 0 and source == "measured:matmul_probe:float32"


def test_a_probe_is_taken_once_per_device_and_dtype_and_reread_by_later_launches(
        tmp_path, monkeypatch):
    from trainer import throughput
    probes = []

    def probe(device, dtype):
        probes.append((device, dtype))
        return 1.5e12 * len(probes)
    monkeypatch.setattr(throughput, "measured_peak_flops", probe)
    cpu, cache = torch.device("cpu"), str(tmp_path / "device")
    first = peak_flops(0.0, cpu, torch.float32, cache)
    assert peak_flops(0.0, cpu, torch.float32, cache) == first == (
        1.5e12, "measured:matmul_probe:float32")
    assert peak_flops(0.0, cpu, torch.bfloat16, cache)[0] == 3e12  # a dtype of its own
    assert len(probes) == 2
    for name in os.listdir(cache):  # a torn file is measured again, and replaced
        (tmp_path / "device" / name).write_text('{"flo')
    assert peak_flops(0.0, cpu, torch.float32, cache)[0] == 4.5e12
    assert peak_flops(0.0, cpu, torch.float32, cache)[0] == 4.5e12 and len(probes) == 3


def test_cpu_peak_memory_is_the_resident_set_in_bytes():
    before = peak_memory_bytes(torch.device("cpu"))
    big = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB touched
    assert peak_memory_bytes(torch.device("cpu")) >= max(before, 64 * 1024 * 1024)
    del big


def test_meter_reports_per_step_fields_and_segment_means():
    m = Meter(flops_token=1e6, peak=1e10, peak_source="config", devices=1)
    assert m.add(1000, 0.5) == {"tokens_per_s": 2000.0, "step_time_s": 0.5, "mfu": 0.2}
    m.add(1000, 1.5)
    s = m.summary(torch.device("cpu"))
    assert s["tokens_per_s"] == 1000.0 and s["step_time_s"] == 1.0
    assert s["mfu"] == pytest.approx(0.1) and s["peak_tflops"] == 0.01
    assert s["peak_mem_bytes"] > 0
