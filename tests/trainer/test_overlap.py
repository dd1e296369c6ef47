"""Compute/communication overlap (trainer/overlap.py): exposed communication time ÷ step
time, from profiler events given as literal inputs."""

from __future__ import annotations

import pytest
import torch

from trainer.overlap import (
    ProfiledOp,
    exposed_comm_us,
    ops_from_profile,
    overlap_fraction,
    union_us,
)


def kernel(name: str, start: float, end: float, stream: int = 7) -> ProfiledOp:
    return ProfiledOp(name, start, end, thread=stream, device="cuda")


def test_gpu_exposed_comm_is_nccl_kernel_time_no_compute_kernel_covers():
    ops = [
        kernel("ampere_sgemm_128x64_tn", 0, 100),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 80, 200, stream=20),
        kernel("Memcpy DtoD (Device -> Device)", 100, 150),  # neither: does not hide it
        kernel("void at::native::vectorized_elementwise_kernel", 150, 300),
        # the CPU side of a GPU profile only launches: it hides nothing
        ProfiledOp("aten::mm", 0, 1000, thread=1),
        ProfiledOp("nccl:all_reduce", 60, 70, thread=1),
    ]
    # comm [80, 200]; compute covers [80, 100] and [150, 200] of it: 50 µs exposed
    assert exposed_comm_us(ops) == pytest.approx(50.0)
    assert overlap_fraction(exposed_comm_us(ops) / 1e6, 500e-6) == pytest.approx(0.1)


def test_gpu_comm_fully_under_compute_is_not_exposed_and_two_streams_of_comm_count_once():
    ops = [kernel("sm90_xmma_gemm", 0, 1000),
           kernel("ncclKernel_AllGather_RING_LL", 100, 300, stream=20),
           kernel("ncclKernel_ReduceScatter_RING_LL", 200, 400, stream=21)]
    assert exposed_comm_us(ops) == 0.0
    ops.append(kernel("ncclKernel_AllReduce", 900, 1100, stream=20))
    assert exposed_comm_us(ops) == pytest.approx(100.0)  # [1000, 1100]


def test_cpu_gloo_comm_is_exposed_where_no_operator_runs_and_ranges_around_it_do_not_hide_it():
    ops = [
        ProfiledOp("aten::mm", 0, 400, thread=1),
        # a Python-level range around the collective: not compute done meanwhile
        ProfiledOp("DeepSpeedEngine.allreduce_gradients", 400, 1000, thread=1),
        ProfiledOp("c10d::allreduce_", 410, 450, thread=1),
        ProfiledOp("gloo:all_reduce", 420, 900, thread=2, is_async=True),  # gloo's thread
        ProfiledOp("aten::copy_", 950, 990, thread=1),  # unflatten, after the wait
    ]
    # communication [410, 900]; nothing computes then
    assert exposed_comm_us(ops) == pytest.approx(490.0)
    assert overlap_fraction(490e-6, 1000e-6) == pytest.approx(0.49)


def test_cpu_compute_on_another_thread_during_an_async_collective_hides_it():
    ops = [ProfiledOp("c10d::allreduce_", 0, 10, thread=1),
           ProfiledOp("gloo:all_reduce", 10, 110, thread=3, is_async=True),
           ProfiledOp("aten::addmm", 20, 80, thread=1)]  # overlap_comm: backward goes on
    assert exposed_comm_us(ops) == pytest.approx(50.0)  # [0, 20] and [80, 110]


def test_no_communication_is_zero_and_the_fraction_is_clamped_to_the_step():
    assert exposed_comm_us([ProfiledOp("aten::mm", 0, 10)]) == 0.0
    assert exposed_comm_us([]) == 0.0
    assert overlap_fraction(0.0, 0.2) == 0.0
    assert overlap_fraction(0.3, 0.2) == 1.0  # a collective begun before the window
    assert overlap_fraction(0.1, 0.0) is None


def test_union_merges_overlapping_and_touching_spans_and_drops_empty_ones():
    assert union_us([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]


def test_a_real_cpu_profile_without_collectives_reads_back_with_no_exposed_comm():
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    prof.start()
    torch.ones(64, 64) @ torch.ones(64, 64)
    prof.stop()
    ops = ops_from_profile(prof)
    assert any(op.name == "aten::mm" and op.end_us > op.start_us and op.device == "cpu"
               for op in ops), ops
    assert exposed_comm_us(ops) == 0.0
