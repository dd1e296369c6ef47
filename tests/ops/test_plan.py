"""`mainspring plan`: the arithmetic against hand-worked numbers, and the plan against
published runs whose authors report their compute, accelerators, MFU (or throughput) and
accelerator-hours — within 10 % of each."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from common.errors import BadConfig
from ops.cli import main as cli
from ops.plan import (
    PlanInputs,
    available_interval,
    badput,
    bubble_fraction,
    chinchilla_tokens,
    cpu_share,
    dp_speedup,
    flops_per_token,
    goodput_model,
    grad_sync_bytes,
    pipeline_micro_batches,
    plan,
    pp_bytes,
    ring_allreduce_bytes,
    tp_bytes,
    young_interval,
)
from ops.plan_facts import MTBF_HOURS_PER_ACCELERATOR
from ops.plan_run import predict, run_mfu, training_span

STORE = "file://" + str(Path(__file__).resolve().parents[1] / "fixtures" / "report_run" / "store")


def test_flops_are_six_n_d_plus_the_attention_term():
    # 7B, 32 layers, d 4096, 4,096 tokens: 6·7e9 = 4.2e10 plus 12·32·4096·4096 = 6,442,450,944
    assert flops_per_token(7e9, 32, 4096, 4096) == 4.2e10 + 6_442_450_944
    assert flops_per_token(7e9, 32, 4096, 4096) * 2e12 == pytest.approx(9.6884901888e22)


def test_chinchilla_is_twenty_tokens_per_parameter():
    assert chinchilla_tokens(70e9) == 1.4e12


def test_young_interval_is_root_of_twice_save_time_mtbf():
    # √(2 · 60 s · 10,800 s) = √1,296,000 = 1,138.42 s
    assert young_interval(60, 10_800) == pytest.approx(1138.4200, abs=1e-4)


def test_availability_optimal_interval_grows_with_restart_cost():
    # no restart: 60 + √(2·10,800·60 + 60²) = 60 + √1,299,600 = 60 + 1,140 = 1,200 s
    assert available_interval(60, 10_800, 0) == pytest.approx(1200.0)
    # 600 s restarts: 60 + √(2·11,400·60 + 3,600) = 60 + √1,371,600 = 1,231.15 s
    assert available_interval(60, 10_800, 600) == pytest.approx(1231.1533, abs=1e-4)


def test_badput_is_saves_half_an_interval_and_the_restart_per_failure():
    lost = badput(1200, 60, 10_800, 600)
    assert lost == pytest.approx({"checkpoint": 0.05, "lost_work": 600 / 10_800,
                                  "restart": 600 / 10_800})


def test_llama3_failure_rate_gives_one_interruption_per_three_hours_on_16k_gpus():
    # 54 days · 24 h / 419 interruptions = 3.093 h for the job, whatever G was
    good = goodput_model(PlanInputs(params=1e9, tokens=1e9, accelerators=16_384,
                                    accelerator="h100", hour_price=1.0),
                         MTBF_HOURS_PER_ACCELERATOR, 60, 600)
    assert good["job_mtbf_s"] == pytest.approx(54 * 24 / 419 * 3600)
    # T_c = 60 + √(2·(11,135.4 + 600)·60 + 60²) = 1,248.2 s; badput 4.81 + 5.60 + 5.39 %
    assert good["interval_s"] == pytest.approx(1248.2, abs=0.1)
    assert good["goodput"] == pytest.approx(1 - 0.04807 - 0.05605 - 0.05388, abs=1e-4)


def test_ring_allreduce_of_7b_bf16_gradients_on_8_gpus_sends_24_5_gb_per_gpu():
    # 7e9 · 2 bytes = 14 GB; each rank sends 2·(8−1)/8 of it
    assert ring_allreduce_bytes(14e9, 8) == pytest.approx(24.5e9)
    assert grad_sync_bytes("zero1", 7e9, 8) == pytest.approx(24.5e9)
    assert grad_sync_bytes("zero3", 7e9, 8) == pytest.approx(36.75e9)  # 1.5x
    assert ring_allreduce_bytes(14e9, 1) == 0.0


def test_tensor_and_pipeline_traffic_follow_megatron():
    # one layer, 4,096 tokens, d 4,096, TP 8: 4 all-reduces of 4096·4096·2 bytes, 2·7/8 each
    assert tp_bytes(1, 4096, 4096, 8) == 4 * 1.75 * 4096 * 4096 * 2 == 234_881_024
    assert pp_bytes(4096, 4096, 2) == 2 * 4096 * 4096 * 2
    assert pp_bytes(4096, 4096, 1) == 0.0


def test_scaling_adds_exposed_gradient_traffic_to_the_compute_of_one_gpu():
    p = plan(PlanInputs(params=7e9, tokens=1e12, accelerators=8, accelerator="h100",
                        hour_price=2.0, layout="dp", mfu=0.5, mfu_at=1, layers=32,
                        d_model=4096, seq_len=4096, batch_tokens=4e6, goodput=1.0))
    s = p["scaling"]
    compute = flops_per_token(7e9, 32, 4096, 4096) * 4e6 / (8 * 989e12 * 0.5)
    exposed = 0.1 * 24.5e9 / 450e9  # 10 % of the ring all-reduce over NVLink's 450 GB/s
    assert s["compute_s"] == pytest.approx(compute)
    assert s["exposed_s"] == pytest.approx(exposed)
    assert s["linear_ratio"] == pytest.approx(compute / (compute + exposed))
    assert s["speedup"] == pytest.approx(8 * compute / (compute + exposed))


def test_ranks_beyond_the_cores_share_them_evenly_with_other_jobs_threads():
    assert cpu_share(1, 2) == cpu_share(2, 2) == 1.0  # a core each
    assert cpu_share(4, 2) == 0.5  # four single-threaded ranks on two cores
    assert cpu_share(2, 2, threads=2) == 0.5
    assert cpu_share(2, 2, background=2.0) == 0.5  # two other jobs' threads runnable
    assert cpu_share(1, 2, background=0.5) == 1.0


def test_dp_speedup_on_two_cores_is_compute_stretched_by_sharing_plus_the_ring():
    # 0.1 s of compute a step on a core of its own; 4 MB of gradients at 0.5 GB/s per rank
    two = dp_speedup(0.1, 4e6, 2, 0.5e9, cores=2)
    assert two["comm_s"] == pytest.approx(4e6 / 0.5e9)  # 2·(1/2)·4 MB = 4 MB: 8 ms
    assert two["speedup"] == pytest.approx(2 * 0.1 / 0.108)
    four = dp_speedup(0.1, 4e6, 4, 0.5e9, cores=2)  # each rank has half a core
    assert four["compute_s"] == pytest.approx(0.2)
    assert four["comm_s"] == pytest.approx(6e6 / 0.5e9)  # 2·(3/4)·4 MB = 6 MB: 12 ms
    assert four["speedup"] == pytest.approx(4 * 0.1 / 0.212)
    # one rank measured beside two other jobs' threads (2/3 of a core: 0.15 s a step), two
    # ranks beside four (half a core each: 0.2 s a step)
    busy = dp_speedup(0.1, 4e6, 2, 0.5e9, cores=2, background=2.0, base_background=2.0)
    assert busy["one_rank_s"] == pytest.approx(0.15)
    assert busy["compute_s"] == pytest.approx(0.2)
    assert busy["speedup"] == pytest.approx(2 * 0.15 / 0.208)


def test_llama_3_1_405b_h100_hours_within_ten_percent_of_its_model_card():
    # Llama 3 (arXiv 2407.21783): 405B, 15.6T tokens, 126 layers, d 16,384, 8K context,
    # 16M tokens a step on 16,384 H100s as TP 8 x PP 16 x DP 128 at 400 TFLOP/s per GPU
    # (table 4), "higher than 90 %" effective training time. Model card: 30.84M H100-hours.
    p = plan(PlanInputs(params=405e9, tokens=15.6e12, accelerators=16_384, accelerator="h100",
                        hour_price=2.0, layers=126, d_model=16_384, seq_len=8192,
                        batch_tokens=16e6, layout="zero1", tp=8, pp=16, mfu=400 / 989,
                        goodput=0.9))
    assert p["compute"]["total_flops"] == pytest.approx(4.11e25, rel=0.01)  # 6ND alone: 3.8e25
    assert p["accelerator_hours"]["expected"] == pytest.approx(30.84e6, rel=0.10)


def test_llama_65b_a100_hours_within_ten_percent_of_the_paper():
    # LLaMA (arXiv 2302.13971): 65.2B, 1.4T tokens, 80 layers, d 8,192, 2,048 context,
    # "380 tokens/sec/GPU on 2048 A100 GPU with 80GB" (section 2.4); table 15: 1,022,362
    # GPU-hours. The paper gives throughput, not MFU: MFU = 380 · FLOPs per token / peak.
    mfu = 380 * flops_per_token(65.2e9, 80, 8192, 2048) / 312e12
    assert mfu == pytest.approx(0.496, abs=0.001)
    p = plan(PlanInputs(params=65.2e9, tokens=1.4e12, accelerators=2048, accelerator="a100",
                        hour_price=1.0, layers=80, d_model=8192, seq_len=2048, mfu=mfu,
                        goodput=1.0))
    assert p["accelerator_hours"]["expected"] == pytest.approx(1_022_362, rel=0.10)
    assert p["wall_hours"]["expected"] / 24 == pytest.approx(21, rel=0.10)  # "about 21 days"


def test_tinyllama_a100_hours_within_ten_percent_of_its_readme():
    # TinyLlama (github.com/jzhang38/TinyLlama, README): 1.1B, 22 layers, d 2,048, 2,048
    # context, 16 A100-40G, "56% model flops utilization"; 3,456 A100 GPU-hours per 300B
    # tokens.
    p = plan(PlanInputs(params=1.1e9, tokens=300e9, accelerators=16, accelerator="a100",
                        hour_price=1.0, layers=22, d_model=2048, seq_len=2048, mfu=0.56,
                        goodput=1.0))
    assert p["accelerator_hours"]["expected"] == pytest.approx(3456, rel=0.10)


def test_every_default_the_plan_used_names_its_source():
    p = plan(PlanInputs(params=7e9, tokens=chinchilla_tokens(7e9), accelerators=64,
                        accelerator="h200", hour_price=3.0, api_price_in=3.0,
                        api_price_out=15.0, api_tokens_per_month=2e9))
    used = {d["input"] for d in p["defaults"]}
    assert {"--mfu", "--peak-tflops", "--mtbf-hours", "--checkpoint-s", "--restart-s",
            "--layers", "--api-output-share"} <= used
    assert all(d["source"] for d in p["defaults"])
    assert p["compute"]["mfu"] == 0.457 and p["compute"]["mfu_at"] == 1  # measured here
    assert p["scaling"]["mfu"] < 0.457  # one GPU's MFU loses the exposed traffic at 64


def test_build_versus_buy_is_the_training_cost_over_the_monthly_api_bill():
    p = plan(PlanInputs(params=1e9, tokens=20e9, accelerators=8, accelerator="h100",
                        hour_price=2.0, mfu=0.4, goodput=1.0, api_price_in=1.0,
                        api_price_out=3.0, api_tokens_per_month=1e9, api_output_share=0.5))
    monthly = 1e9 / 1e6 * (0.5 * 1.0 + 0.5 * 3.0)  # $2,000
    assert p["build_vs_buy"]["monthly_bill_usd"] == pytest.approx(monthly)
    assert p["build_vs_buy"]["break_even_months"]["expected"] == pytest.approx(
        p["cost_usd"]["expected"] / monthly)


def test_cost_range_spans_the_mfu_range_and_the_price_range():
    p = plan(PlanInputs(params=7e9, tokens=1e12, accelerators=64, accelerator="h100",
                        hour_price=2.0, hour_price_high=3.5))
    c, h = p["cost_usd"], p["accelerator_hours"]
    assert c["low"] == pytest.approx(h["low"] * 2.0)
    assert c["high"] == pytest.approx(h["high"] * 3.5)
    assert h["low"] < h["expected"] < h["high"]


def test_cli_prints_the_plan_as_one_json_object(capsys):
    code = cli(["plan", "--params", "7B", "--tokens", "chinchilla", "--accelerators", "64",
                "--accelerator", "h100", "--hour-price", "2..3.5", "--api-price-in", "3",
                "--api-price-out", "15", "--api-tokens-per-month", "2e9", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["tokens"] == 1.4e11
    assert out["inputs"]["hour_price"] == [2.0, 3.5]
    assert out["defaults"][0]["input"] == "--tokens" and "Chinchilla" in out["defaults"][0]["source"]
    assert math.isfinite(out["build_vs_buy"]["break_even_months"]["expected"])


def test_cli_text_names_each_default_with_its_source(capsys):
    assert cli(["plan", "--params", "1B", "--tokens", "20B", "--accelerators", "8",
                "--accelerator", "h200", "--hour-price", "3"]) == 0
    text = capsys.readouterr().out
    assert "--mtbf-hours = 50677: Llama 3" in text
    assert "NVIDIA H200 datasheet" in text


@pytest.mark.parametrize("flag,value,named", [
    ("--tokens", "lots", "chinchilla"), ("--accelerator", "tpu9", "h100"),
    ("--accelerators", "0", "above 0"), ("--hour-price", "-2", "above 0"),
    ("--mfu", "1.5", "(0, 1]")])
def test_a_bad_flag_is_exit_2_naming_the_flag_and_the_fix(capsys, flag, value, named):
    args = {"--params": "1B", "--tokens": "20B", "--accelerators": "8",
            "--accelerator": "h100", "--hour-price": "2", flag: value}
    assert cli(["plan", *[x for kv in args.items() for x in kv]]) == 2
    err = capsys.readouterr().err
    assert f"bad config: {flag}" in err and named in err


def test_accelerators_that_do_not_split_into_tp_x_pp_groups_are_refused():
    with pytest.raises(BadConfig, match="--tp/--pp"):
        PlanInputs(params=1e9, tokens=1e9, accelerators=12, accelerator="h100",
                   hour_price=1.0, tp=8)


def _event(kind: str, ts: float, **payload) -> dict:
    return {"kind": kind, "ts": ts, "step": payload.get("last_step"), "payload": payload}


def test_from_run_predicts_start_up_per_segment_plus_seconds_per_step():
    # two 50-step segments; the first window ends 2 s of start-up + 0.5 s a step in
    events = [_event("segment_started", 0.0, from_step=0, to_step=50, attempt=1),
              *[_event("train_metrics", 2.0 + 0.5 * k, first_step=k - 4, last_step=k,
                       attempt=1, segment="0-50") for k in range(5, 51, 5)],
              _event("segment_started", 30.0, from_step=50, to_step=100, attempt=1),
              _event("segment_finished", 60.0, from_step=50, to_step=100, attempt=1)]
    got = predict(training_span(events), fault_s=6.0)
    assert (got["seen_steps"], got["total_steps"], got["segments"]) == (10, 100, 2)
    assert got["seconds_per_step"] == pytest.approx(0.5)
    assert got["startup_s"] == pytest.approx(2.0)
    assert got["predicted_s"] == pytest.approx(2 * 2.0 + 0.5 * 100)  # 54 s
    assert got["error"] == pytest.approx((54 - 60) / 60)
    assert got["error_without_faults"] == pytest.approx(0.0)  # 60 s less 6 s of faults


def _span(name: str, start: float, end: float, **attributes) -> dict:
    return {"name": name, "start_ns": int(start * 1e9), "end_ns": int(end * 1e9),
            "attributes": attributes}


def test_from_run_times_steps_by_the_trainers_spans_and_adds_each_segments_commit_tail():
    # 200 steps in two segments; 3 s to the first step, then 0.1 s a step. The windows are
    # stamped by the supervisor's poll (step 10's 0.2 s late): they would say 0.08 s a step.
    events = [_event("segment_started", 0.0, from_step=0, to_step=100, attempt=1),
              _event("train_metrics", 4.2, first_step=1, last_step=10, attempt=1,
                     segment="0-100"),
              _event("train_metrics", 5.0, first_step=11, last_step=20, attempt=1,
                     segment="0-100"),
              _event("segment_started", 25.0, from_step=100, to_step=200, attempt=1),
              _event("segment_finished", 50.0, from_step=100, to_step=200, attempt=1)]
    # the trainer's spans end at each last step's own time; the checkpoints after them
    # reach the durable tier 2.0 s (the writer's first upload), 0.4 s and 0.6 s later
    spans = [_span("steps 1-10", 3.0, 4.0, rank=0, first_step=1, last_step=10),
             _span("steps 11-20", 4.0, 5.0, rank=0, first_step=11, last_step=20),
             _span("steps 21-30", 5.0, 6.0, rank=0, first_step=21, last_step=30),
             *[_span(f"checkpoint stage {k}", t, t + 0.01, rank=0, step=k)
               for k, t in ((0, 2.9), (10, 4.0), (20, 5.0))],
             _span("upload 0", 3.0, 4.9), _span("upload 10", 4.1, 4.4),
             _span("upload 20", 5.1, 5.6)]
    got = predict(training_span(events, spans))
    assert (got["marks_from"], got["seen_steps"]) == ("spans", 20)
    assert got["seconds_per_step"] == pytest.approx(0.1)
    assert got["startup_s"] == pytest.approx(3.0)
    assert got["tail_s"] == pytest.approx(0.5)  # the median of 0.4 and 0.6; not the 2.0
    assert got["predicted_s"] == pytest.approx(2 * (3.0 + 0.5) + 0.1 * 200)  # 27 s
    # without spans: the windows, and no tail (no commits recorded)
    assert predict(training_span(events))["seconds_per_step"] == pytest.approx(0.08)


def test_from_run_takes_the_rate_from_the_later_half_of_its_tenth_and_the_slow_start_as_head():
    # 400 steps, one segment, a span every 10 steps: 2 s to the first step, steps 1-20 at
    # 0.2 s (the segment's own start-up work shares the cores), then 0.1 s a step
    ends = {10: 4.0, 20: 6.0, 30: 7.0, 40: 8.0}
    spans = [_span(f"steps {k - 9}-{k}", t - 1.0, t, rank=0, first_step=k - 9, last_step=k)
             for k, t in ends.items()]
    events = [_event("segment_started", 0.0, from_step=0, to_step=400, attempt=1),
              _event("segment_finished", 44.0, from_step=0, to_step=400, attempt=1)]
    got = predict(training_span(events, spans))
    assert got["seconds_per_step"] == pytest.approx(0.1)  # steps 21-40; from step 10: 0.133
    assert got["startup_s"] == pytest.approx(8.0 - 0.1 * 40)  # 2 s + 20 steps' 0.1 s excess
    assert got["predicted_s"] == pytest.approx(4.0 + 0.1 * 400)
    assert got["error"] == pytest.approx(0.0)


def test_from_run_on_the_recorded_faulted_run(capsys):
    # tests/fixtures/report_run: 160 CPU steps in two segments, three faults (a crash, a
    # spike rollback); the prediction sees the windows ending by step 16, its first 10 %
    # (its step spans are 20 steps long: the first ends past it)
    assert cli(["plan", "--from-run", "map-run", "--store", STORE, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["seen_steps"], got["total_steps"], got["faults"]) == (15, 160, 3)
    assert got["marks_from"] == "windows"
    assert got["actual_s"] == pytest.approx(72.53, abs=0.01)
    assert got["error"] < -0.2  # the faults cost what the first 10 % could not show
    assert abs(got["error_without_faults"]) < 0.15


def test_from_run_without_events_is_exit_2_naming_the_flag(capsys):
    assert cli(["plan", "--from-run", "no-such-run", "--store", STORE]) == 2
    assert "bad config: --from-run" in capsys.readouterr().err


def _windows(*pairs: tuple[int, float | None]) -> list[dict]:
    step, out = 0, []
    for steps, mfu in pairs:
        out.append(_event("train_metrics", float(step), first_step=step + 1,
                          last_step=step + steps, steps=steps, mfu=mfu))
        step += steps
    return out


def test_mfu_from_a_run_is_the_step_weighted_harmonic_mean_of_its_windows():
    # 10 steps at 0.2 and 30 at 0.1: 40 steps' time is 10/0.2 + 30/0.1 = 350 "units", so
    # MFU 40/350 = 0.1143 (the arithmetic mean of windows, 0.15, overstates the fast ones)
    spec = {"train": {"nodes": 1, "procs_per_node": 2, "peak_tflops": 989.0}}
    got = run_mfu("r", _windows((10, 0.2), (30, 0.1), (5, None)), spec, [])
    assert got["mfu"] == pytest.approx(40 / 350)
    # two windows: the 10th and 90th percentiles lie a tenth in from each end
    assert (got["low"], got["high"]) == (pytest.approx(0.11), pytest.approx(0.19))
    assert (got["at"], got["peak_tflops"], got["windows"], got["steps"]) == (2, 989.0, 2, 40)
    assert "run r" in got["source"] and "989 TFLOP/s" in got["source"]


def test_mfu_from_a_run_without_mfu_figures_names_the_flag_and_the_fix():
    with pytest.raises(BadConfig, match="--mfu-from-run") as err:
        run_mfu("r", _windows((10, None)), None, [])
    assert "no MFU figures" in err.value.problem and "--mfu" in err.value.fix


def test_plan_takes_its_mfu_range_and_accelerators_from_a_recorded_run(capsys):
    # tests/fixtures/report_run: two CPU ranks, 35 windows, MFU 0.10-0.28 of a probed peak
    args = ["plan", "--params", "1B", "--tokens", "20B", "--accelerators", "8",
            "--accelerator", "cpu", "--hour-price", "1", "--mfu-from-run", "map-run",
            "--store", STORE, "--json"]
    assert cli(args) == 0
    got = json.loads(capsys.readouterr().out)
    source = [d for d in got["defaults"] if d["input"] == "--mfu-from-run"]
    assert len(source) == 1 and "35 train_metrics windows" in source[0]["source"]
    assert got["compute"]["mfu"] == pytest.approx(source[0]["value"])
    assert got["compute"]["mfu"] == pytest.approx(0.1798, abs=1e-4)
    assert got["compute"]["mfu_at"] == 2
    low, high = got["compute"]["mfu_range"]
    assert 0.1 < low < got["compute"]["mfu"] < high < 0.3


def test_mfu_from_run_beside_mfu_or_of_a_run_not_there_is_exit_2(capsys):
    base = ["plan", "--params", "1B", "--tokens", "20B", "--accelerators", "8",
            "--accelerator", "cpu", "--hour-price", "1", "--store", STORE]
    assert cli([*base, "--mfu-from-run", "map-run", "--mfu", "0.3"]) == 2
    assert "bad config: --mfu-from-run" in capsys.readouterr().err
    assert cli([*base, "--mfu-from-run", "no-such-run"]) == 2
    assert "bad config: --mfu-from-run" in capsys.readouterr().err


def test_the_pipeline_bubble_is_1f1bs_idle_share_worked_by_hand():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert bubble_fraction(8, 64) == pytest.approx(7 / 71)
    # 4M tokens of 4,096-token sequences over 8 data-parallel pipelines: 122 each
    assert pipeline_micro_batches(4e6, 4096, 8) == pytest.approx(4e6 / 4096 / 8)
    assert pipeline_micro_batches(4096, 4096, 8) == 1.0  # at least one


def test_a_pipelines_bubble_stretches_the_compute_of_g_not_of_one_accelerator():
    # 70B over 64 H100s at TP 8 x PP 4 (dp 2), 4M-token steps of 4,096-token sequences:
    # each pipeline runs 2M tokens = 488 micro-batches of one sequence, bubble 3/491
    base = dict(params=7e10, tokens=1e12, accelerators=64, accelerator="h100", hour_price=2.0,
                layout="zero1", tp=8, pp=4, mfu=0.5, mfu_at=1, layers=80, d_model=8192,
                seq_len=4096, batch_tokens=4e6, goodput=1.0)
    s = plan(PlanInputs(**base))["scaling"]
    m = 4e6 / 4096 / 2
    assert s["bubble_fraction"] == pytest.approx(3 / (m + 3))
    step_flops = flops_per_token(7e10, 80, 8192, 4096) * 4e6
    assert s["compute_s"] == pytest.approx(step_flops / (64 * 989e12 * 0.5) / (1 - 3 / (m + 3)))
    # smaller steps, fewer micro-batches: a larger bubble, a slower step
    small = plan(PlanInputs(**{**base, "batch_tokens": 65536}))["scaling"]
    assert small["bubble_fraction"] == pytest.approx(3 / (8 + 3))  # 16 sequences, 8 each
    # an MFU measured at the layout already paid its bubble: taken out, then put back, the
    # step's compute is what that MFU says
    at_g = plan(PlanInputs(**{**base, "batch_tokens": 65536, "mfu_at": 64}))["scaling"]
    assert at_g["compute_s"] + at_g["exposed_s"] == pytest.approx(
        flops_per_token(7e10, 80, 8192, 4096) * 65536 / (64 * 989e12 * 0.5))


def test_plan_takes_its_mfu_from_the_throughput_benchmarks_line(tmp_path, capsys):
    # what benchmarks/throughput.py prints (a gpu_check.jsonl holds other figures around it)
    line = {"figure": "throughput", "value": 3000.0, "step_time_s": 0.5, "mfu": 0.4,
            "peak_tflops": 0.2, "peak_source": "measured:matmul_probe", "device": "cpu",
            "model": "tiny", "rows": "packed", "step_time_spread": [0.4, 1.0]}
    saved = tmp_path / "gpu_check.jsonl"
    saved.write_text('{"figure": "packed_attention_exact", "ok": true}\nnot json\n'
                     + json.dumps(line) + "\n")
    base = ["plan", "--params", "1B", "--tokens", "20B", "--accelerators", "8",
            "--accelerator", "cpu", "--hour-price", "1"]
    assert cli([*base, "--mfu-from-throughput", str(saved), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["compute"]["mfu"] == 0.4 and got["compute"]["mfu_at"] == 1
    assert got["compute"]["peak_tflops"] == 0.2
    # the spread of its step times: 0.5 s median, 0.4 fastest, 1.0 slowest
    assert got["compute"]["mfu_range"] == [pytest.approx(0.2), pytest.approx(0.5)]
    [source] = [d for d in got["defaults"] if d["input"] == "--mfu-from-throughput"]
    assert "benchmarks/throughput.py on cpu" in source["source"]
    # beside --mfu or --mfu-from-run, an unreadable file, a file with no figure: exit 2
    for extra, words in ((["--mfu", "0.3"], "given with --mfu"),
                         (["--mfu-from-run", "map-run", "--store", STORE], "given with"),
                         ([], None)):
        target = str(saved) if words else str(tmp_path / "missing.jsonl")
        assert cli([*base, "--mfu-from-throughput", target, *extra]) == 2
        err = capsys.readouterr().err
        assert "--mfu-from" in err and (words or "cannot read") in err
    (tmp_path / "other.jsonl").write_text('{"figure": "resume_exact", "value": 0.0}\n')
    assert cli([*base, "--mfu-from-throughput", str(tmp_path / "other.jsonl")]) == 2
    assert "no throughput figure" in capsys.readouterr().err


def test_a_cpu_hosts_ranks_beyond_its_cores_share_them_in_the_plan():
    # 4 single-threaded ranks on a 2-core host, an MFU measured on one rank with a core of
    # its own: each rank computes at half speed, so 1 -> 4 ranks is a 2x speed-up, not 4x
    base = dict(params=2e6, tokens=1e9, accelerators=4, accelerator="cpu", hour_price=0.1,
                layout="dp", per_node=4, mfu=0.2, mfu_at=1, layers=2, d_model=64,
                seq_len=64, batch_tokens=4096, overlap=1.0, goodput=1.0)
    owned = plan(PlanInputs(**{**base, "cores": 4}))["scaling"]
    shared = plan(PlanInputs(**{**base, "cores": 2}))["scaling"]
    assert owned["core_share"] == 1.0 and shared["core_share"] == 0.5
    assert shared["compute_s"] == pytest.approx(2 * owned["compute_s"])
    assert shared["speedup"] == pytest.approx(owned["speedup"] / 2, rel=1e-3)
    assert shared["mfu"] == pytest.approx(0.2 / 2, rel=1e-3)
    # an MFU measured on those 4 ranks already paid the sharing: the plan gives it back
    at_g = plan(PlanInputs(**{**base, "cores": 2, "mfu_at": 4}))["scaling"]
    assert at_g["mfu"] == pytest.approx(0.2, rel=1e-6)
    # the rule is a CPU host's: an accelerator's ranks own their devices
    with pytest.raises(BadConfig, match="--cores"):
        PlanInputs(**{**base, "accelerator": "h100", "cores": 2})
