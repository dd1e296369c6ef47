"""A lost rank and a hung rank in one world-size-2 segment, and the Grafana dashboard proven
on a real Prometheus scraping it. Real Temporal dev server, real workers, real DeepSpeed
children on CPU/gloo, the durable store on real S3 (SeaweedFS).

First one rank is SIGKILLed mid-segment: the launcher stops the other, the supervisor
records a `rank_lost` fault naming the rank, and restarts the segment in place (the same
attempt, the same worker, its warm standby) from the last commit. Then, in the restarted
launch, one rank is SIGSTOPped: the supervisor's AUTO hang timeout — max(hang_floor_s,
hang_step_factor x the p99 step time measured in the launch) — fires, the fault is recorded,
and the segment is restarted in place again from the last commit. The run's post-incident
record is checked from the store alone: one trace across every process (both ranks, the
checkpoint writer's uploads), each fault a span event where it was seen, `mainspring trace`
and `goodput` naming them. With test_demo.py (worker_lost) and test_drain.py (preempted),
these are the claims of test_trace.py's longer faulted run, a soak test now.

Meanwhile a real `prometheus` server (Debian's package) scrapes the real trainer worker's
endpoint every second. Then every PromQL expression in ops/dashboards/mainspring.json, with
`$run` substituted, goes through Prometheus's HTTP API: each must return data, and every
value must be finite and inside the range its panel declares (min 0 everywhere: no negative
time; goodput and overlap in [0, 1]). The NVML panels — exactly those tagged "[nvml]",
exactly the `mainspring_gpu_*` series — are empty where no NVIDIA GPU is, and only there are
they let off.

One run, three tests: the module fixture makes the run, each test checks its own claims on
it, so the scenario is paid for once. Without the `prometheus` binary the dashboard test
skips, naming the package, and the other two still run."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import time

import jsonschema
import pytest

from activities.hang import checkpoint_io_s, hang_deadline
from common.metrics import PORT_ENV
from common.procs import WorkerFleet
from ops.cli import main
from ops.services import free_port
from ops.trace_view import TRACE_EVENT_SCHEMA
from storage import fast_tier
from tests.e2e.conftest import terminate_running
from tests.e2e.prometheus import (
    DASHBOARD,
    PROMETHEUS,
    Prometheus,
    check_panels,
    needs_prometheus,
    nvidia_gpu_present,
    panels,
)
from tests.e2e.runs import (
    HUNG,
    MID_SEGMENT,
    assert_recovered_from,
    assert_restarted_in_place,
    chaos_for,
    first_fault,
    newest_commit_at_or_before,
    run_in_background,
    strike,
    tiny_spec,
    wait_for,
)
from tests.e2e.test_trace import assert_nested, assert_one_trace, fault_span_events

pytestmark = pytest.mark.e2e

# The faulted segment, with an eval, a profile and a metrics record often enough that every
# panel of the dashboard has data to show.
SPEC = {**HUNG, "train.eval_every": 10, "ops.profile_every": 5, "ops.metrics_every": 10}
STEPS = SPEC["train.total_steps"]
# the rank killed while steps 22-32 run (MID_SEGMENT); the hang after the kill's window and
# its recovery from step 20 or 30 (test_layout_faults.py's windows)
HANG_AT = (38, 46)
FAULTS = ("rank_lost", "hang")
LAUNCHES = 3  # the segment's first launch, and one restart in place per fault


def measured_step_times(spec, attempt: int, restart: int) -> list[float]:
    """The step times the supervisor's window held when launch `restart` of attempt
    `attempt` hung (progress.jsonl): those of the attempt's launches up to that one, each
    without its first step (its warm-up leaves the window when its second is measured)."""
    root = pathlib.Path(fast_tier.run_dir(spec.storage.fast, spec.run_id), "segments")
    path = next(root.glob("*/progress.jsonl"))
    launches: dict[tuple[int, int], list[float]] = {}
    current = None
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "start":
            current = (rec["attempt"], rec.get("restart", 0))
            launches[current] = []
        elif rec["type"] == "step":
            launches[current].append(rec["step_time_s"])
    return [t for r in range(restart + 1) for t in launches[(attempt, r)][1:]]


@pytest.fixture(scope="module")
def faulted(temporal_server, seaweed, tmp_path_factory):
    """The run the tests read: per fault, the strike, its fault event, what the store held
    when it was recorded and the commit a resume had to start from; the run's result; and
    the Prometheus that scraped the trainer worker all along (None without the binary),
    up until the module ends."""
    root = tmp_path_factory.mktemp("rank-faults")
    port = free_port()
    with pytest.MonkeyPatch.context() as env:
        for key, value in seaweed.env().items():  # this process reads the store too
            env.setenv(key, value)
        t0 = time.monotonic()
        # one worker per role process: only the trainer worker serves the endpoint here
        fleets = [WorkerFleet(temporal_server.address, roles=("orchestrator", "data"),
                              log_dir=str(root / "logs"), env=seaweed.env()).start(),
                  WorkerFleet(temporal_server.address, roles=("trainer",),
                              log_dir=str(root / "logs-trainer"),
                              env={**seaweed.env(), PORT_ENV: str(port)}).start()]
        prom = None
        try:
            prom = Prometheus(root, f"127.0.0.1:{port}") if PROMETHEUS else None
            spec = tiny_spec("e2e-rank-faults", "s3://mainspring/e2e-rank-faults",
                             str(root / "fast"), **SPEC)
            chaos = chaos_for(fleets[1], spec)
            runner, box = run_in_background(temporal_server.address, spec, 300)
            struck = {}
            for kind, window, seen in (("kill_rank", MID_SEGMENT[1], "rank_lost"),
                                       ("hang", HANG_AT, "hang")):
                done = strike(chaos, spec, kind, MID_SEGMENT[0], window)
                fault = first_fault(spec, seen)
                struck[seen] = {"struck": done, "fault": fault,
                                "committed": chaos.durable.list_committed(),
                                "resume_from": newest_commit_at_or_before(
                                    spec, fault["payload"]["last_step"])}
            runner.join(300)
            # the workers stay up until the module ends: Prometheus marks the series of a
            # target gone stale, and a query finds none of them
            yield {"spec": spec, "box": box, "prom": prom, **struck,
                   "seconds": time.monotonic() - t0}
        finally:
            asyncio.run(terminate_running(temporal_server.address, "end of the rank-faults run"))
            for fleet in fleets:
                fleet.stop()
            if prom is not None:
                prom.stop()


def test_a_sigkilled_rank_of_two_is_restarted_in_place_from_the_last_commit_with_no_commit_lost(  # noqa: E501
        faulted, tmp_path, capsys):
    spec, lost = faulted["spec"], faulted["rank_lost"]
    killed, fault = lost["struck"], lost["fault"]
    assert killed["rank"] == 1, killed
    p = fault["payload"]
    assert faulted["box"]["result"]["status"] == "completed", faulted["box"]

    assert (p["kind"], p["rank"], p["injected"]) == ("rank_lost", 1, False), p
    # the evidence: torchrun stopping the others, or rank 0's own error (gloo's connection
    # reset by the dead peer) when it wrote error.json first
    assert p["evidence"] and p["log_tail"]
    assert fault["ts"] - killed["ts"] < 10.0, p  # the launcher's stop, not a timeout
    events = assert_recovered_from(spec, fault, lost["resume_from"], lost["committed"], FAULTS)
    recovered = assert_restarted_in_place(spec, events, fault, LAUNCHES)
    assert recovered["lost_steps"] == p["last_step"] - lost["resume_from"]

    # one trace across every process of the run, read back from the durable store
    spans, _ = assert_one_trace(spec)
    assert {"mainspring-worker-orchestrator", "mainspring-worker-data",
            "mainspring-worker-trainer", "mainspring-trainer",
            "mainspring-checkpoint-writer"} <= {s["service"] for s in spans}
    assert {s["attributes"].get("rank") for s in spans if s["name"].startswith("trainer rank")} \
        == {0, 1}
    assert any(s["name"].startswith("upload ") and s["links"] for s in spans)
    assert_nested(spans, spec.run_id)
    fault_span_events(spec, "rank_lost")  # on the span where it was seen
    # `mainspring trace` names the fault; --perfetto passes the schema; goodput counts it
    capsys.readouterr()
    assert main(["trace", spec.run_id, "--durable", spec.storage.durable]) == 0
    assert "rank_lost" in capsys.readouterr().out
    perfetto = tmp_path / "trace.json"
    assert main(["trace", spec.run_id, "--durable", spec.storage.durable,
                 "--perfetto", str(perfetto)]) == 0
    jsonschema.validate(json.loads(perfetto.read_text()), TRACE_EVENT_SCHEMA)
    capsys.readouterr()
    assert main(["goodput", spec.run_id, "--durable", spec.storage.durable, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < figures["train"]["goodput"] < 1
    assert figures["faults"]["rank_lost"]["recovered"] == figures["faults"]["rank_lost"]["count"]
    print(f"\nrank-faults e2e: {faulted['seconds']:.1f}s for the run; the lost rank detected "
          f"{fault['ts'] - killed['ts']:.1f}s after the kill")


def test_a_sigstopped_rank_of_two_is_detected_within_the_auto_timeout_plus_5s_and_restarted_in_place_from_the_last_commit(  # noqa: E501
        faulted):
    spec, hung = faulted["spec"], faulted["hang"]
    assert spec.ops.hang_timeout_s == "auto"
    stopped, fault = hung["struck"], hung["fault"]
    assert stopped["rank"] == 1 and stopped["stopped"], stopped
    p = fault["payload"]
    assert faulted["box"]["result"]["status"] == "completed", faulted["box"]

    # the AUTO timeout fired, and says what it was made of
    assert (p["timeout"], p["auto"]) == ("hang_timeout_s", True), p
    assert p["phase"] in ("step", "checkpoint"), p  # stopped after a checkpoint step or not
    assert p["rank"] == 1 and "rank 1 is stopped" in p["evidence"] and not p["injected"]
    # the window: the attempt's steps so far, across its launches (the kill's restart
    # included), less each launch's warm-up step
    assert p.get("restart") == 1, p  # it hung in the kill's restart in place
    times = measured_step_times(spec, p["attempt"], p["restart"])
    assert p["steps_measured"] == len(times) > 0 and p["p99_step_s"] == pytest.approx(
        max(times), abs=1e-4)  # fewer than 100 steps: the p99 is the slowest
    io = checkpoint_io_s(p["checkpoint_bytes"], spec.ops.checkpoint_mb_per_s) \
        if p["phase"] == "checkpoint" else 0.0
    assert p["timeout_s"] == pytest.approx(hang_deadline(
        times, spec.ops.hang_floor_s, spec.ops.hang_step_factor) + io, abs=1e-3)
    # ... within the timeout + 5 s of the stop
    assert fault["ts"] - stopped["ts"] <= p["timeout_s"] + 5.0, (fault["ts"] - stopped["ts"], p)
    assert p["waited_s"] > p["timeout_s"]

    events = assert_recovered_from(spec, fault, hung["resume_from"], hung["committed"], FAULTS)
    assert_restarted_in_place(spec, events, fault, LAUNCHES)
    fault_span_events(spec, "hang")  # a span event where it was seen, in the store
    print(f"\nhung rank: timeout {p['timeout_s']}s ({p['timeout_how']}), detected "
          f"{fault['ts'] - stopped['ts']:.1f}s after the stop")


@needs_prometheus
def test_every_dashboard_query_returns_sane_data_from_a_real_prometheus_scraping_a_real_segment(  # noqa: E501
        faulted):
    dashboard = json.loads(DASHBOARD.read_text())
    prom, run = faulted["prom"], faulted["spec"].run_id
    assert faulted["box"]["result"]["status"] == "completed", faulted["box"]
    # the last state scraped: the final step, and the in-place restarts' recoveries
    wait_for(lambda: [s for s in prom.query(f'mainspring_train_step{{run_id="{run}"}}')
                      if float(s["value"][1]) == STEPS], 30, "the final step scraped")
    wait_for(lambda: prom.query(f'mainspring_recoveries_total{{run_id="{run}"}} >= 2'), 30,
             "both recoveries scraped")

    # the `run` variable: Grafana's label_values(mainspring_train_step, run_id)
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "run")
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"]
                                 ).groups()
    assert run in prom.get(f"/api/v1/label/{label}/values", **{"match[]": metric})

    gpu = nvidia_gpu_present()
    seen, let_off = check_panels(prom, panels(dashboard), run, gpu)
    assert len(seen) >= 20, seen
    assert bool(let_off) == (not gpu), let_off
    # the run's own figures: two real faults (one of each kind) recovered, gradients and
    # overlap measured
    assert seen['sum by (kind) (mainspring_faults_total{run_id="$run"})'] == [1.0, 1.0]
    assert seen['mainspring_recoveries_total{run_id="$run"}'] == [2.0]
    assert seen['mainspring_grad_norm{run_id="$run"}'][0] > 0
    assert len(seen['mainspring_memory_peak_allocated_bytes{run_id="$run"}']) == 2  # ranks
    assert 0 < seen['mainspring_comm_exposed_fraction{run_id="$run"}'][0] <= 1
    print(f"\nprometheus dashboard e2e: {len(seen)} queries with data, NVML let off "
          f"{sorted(let_off)}")
    for expr, values in seen.items():
        print(f"  {expr}: {[round(v, 4) for v in values]}")
