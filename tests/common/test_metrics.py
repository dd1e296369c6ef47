"""The worker's Prometheus endpoint (common/metrics.py) fed by the supervisor's progress path
(activities/metrics.py): scraped over HTTP exactly as Prometheus would."""

from __future__ import annotations

import json
import pathlib
import re
import socket
import time
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from activities.metrics import MeteredEventLog, MetricsForwarder, RunTally, tally
from common import metrics
from common.errors import BadConfig
from common.protocol import CommitLine, EvalLine, StartLine, StepLine
from ops.cli import build_parser
from ops.services import free_port
from storage.events import EventLog, read_events


def step(n: int, loss: float | None, verdict: str = "ok", tps: float = 1000.0,
         dt: float = 0.256) -> StepLine:
    return StepLine(step=n, loss=loss, lr=1e-4 * n, verdict=verdict, tokens_per_s=tps,
                    step_time_s=dt, mfu=0.1 * n, peak_mem_bytes=5000 + n)


def scrape(port: int) -> dict[tuple[str, str], float]:
    """{(sample name, run_id label): value} from the text exposition."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, s.labels.get("run_id", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def endpoint():
    """The process's endpoint (one per process, as in a worker): started once, reused."""
    port = metrics.serve_metrics(free_port(), "test", addr="127.0.0.1")
    assert port and metrics.training_instruments() is not None
    return port


def test_progress_lines_through_the_forwarder_are_scraped_with_run_id_labels(tmp_path,
                                                                              endpoint):
    run_a, run_b = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
    # The constructor train_segment uses: it picks up the endpoint by itself.
    fwd = MetricsForwarder(EventLog(str(tmp_path), run_a, "supervisor", attempt=1), 10,
                           segment="0-80", attempt=1, execution="wf.1")
    for line in (step(1, 3.5), step(2, 3.0, tps=2000.0, dt=0.128), step(3, None, "skip"),
                 CommitLine(step=3, uri="file:///x", bytes=1), step(4, 9.0, "skip", dt=0.512),
                 StartLine(resumed_from=None, world_size=1, to_step=80, attempt=1)):
        fwd.on_progress(line)
    other = MetricsForwarder(EventLog(str(tmp_path), run_b, "supervisor", attempt=1), 10,
                             segment="0-80", attempt=1)
    other.on_progress(step(7, 1.25))

    got = scrape(endpoint)
    assert got[("mainspring_train_step", run_a)] == 4
    assert got[("mainspring_train_loss", run_a)] == 9.0  # step 3's null loss left it alone
    assert got[("mainspring_learning_rate", run_a)] == pytest.approx(4e-4)
    assert got[("mainspring_tokens_per_second", run_a)] == 1000.0
    assert got[("mainspring_mfu", run_a)] == pytest.approx(0.4)
    assert got[("mainspring_peak_memory_bytes", run_a)] == 5004
    assert got[("mainspring_train_steps_total", run_a)] == 4
    assert got[("mainspring_tokens_total", run_a)] == 256 + 256 + 256 + 512  # rate x time
    assert got[("mainspring_batches_skipped_total", run_a)] == 2
    assert got[("mainspring_checkpoints_committed_total", run_a)] == 1
    # Another run on the same worker is its own series, untouched by the first.
    assert got[("mainspring_train_step", run_b)] == 7
    assert got[("mainspring_train_loss", run_b)] == 1.25
    assert got[("mainspring_train_steps_total", run_b)] == 1


def test_a_metrics_port_already_in_use_is_a_bad_config_naming_the_flag(monkeypatch):
    monkeypatch.setattr(metrics, "_served", None)  # as in a fresh worker process
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(BadConfig) as err:
            metrics.serve_metrics(port, "test", addr="127.0.0.1")
    assert err.value.field == "--metrics-port" and "already in use" in err.value.problem
    assert metrics.training_instruments() is None


def test_port_zero_or_unset_serves_nothing_and_training_events_still_flow(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(metrics, "_served", None)  # as in a fresh worker process
    monkeypatch.delenv(metrics.PORT_ENV, raising=False)
    monkeypatch.delenv(metrics.TEMPORAL_PORT_ENV, raising=False)
    args = build_parser().parse_args(["worker", "--role", "trainer"])
    assert (args.metrics_port, args.temporal_metrics_port) == (0, 0)
    assert metrics.serve_metrics(args.metrics_port, "test") is None
    assert metrics.serve_temporal_metrics(args.temporal_metrics_port) is None
    assert metrics.training_instruments() is None

    events = EventLog(str(tmp_path), "r", "supervisor", attempt=1)
    fwd = MetricsForwarder(events, 2, segment="0-2", attempt=1)
    assert fwd.live is None
    for line in (step(1, 2.0), step(2, None, "skip"), CommitLine(step=2, uri="file:///x")):
        fwd.on_progress(line)
    got = read_events(str(tmp_path), "r", ("train_metrics",))  # the commit flushed them
    assert [(e["payload"]["last_step"], e["payload"]["skipped"]) for e in got] == [(2, 1)]


def test_worker_ports_come_from_the_flags_or_the_environment(monkeypatch):
    monkeypatch.setenv(metrics.PORT_ENV, "9464")
    monkeypatch.setenv(metrics.TEMPORAL_PORT_ENV, "9465")
    args = build_parser().parse_args(["worker", "--role", "trainer"])
    assert (args.metrics_port, args.temporal_metrics_port) == (9464, 9465)
    args = build_parser().parse_args(["worker", "--role", "trainer", "--metrics-port", "9100"])
    assert args.metrics_port == 9100


def test_temporal_runtime_serves_prometheus_and_names_its_flag_when_the_port_is_busy():
    port = free_port()
    runtime = metrics.temporal_runtime(port, "127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200  # empty until a client or worker records something
    with pytest.raises(BadConfig) as err:
        metrics.temporal_runtime(port, "127.0.0.1")
    assert err.value.field == "--temporal-metrics-port" and "already in use" in err.value.problem
    del runtime


def samples(port: int, run_id: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, its labels but run_id, sorted): value} of one run's series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "run_id"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.labels.get("run_id") == run_id}


def test_wall_dashboard_series_come_from_progress_lines_and_the_supervisor_s_events(
        tmp_path, endpoint):
    run = f"w-{uuid.uuid4().hex[:8]}"
    events = MeteredEventLog(str(tmp_path), run, "supervisor", attempt=1)
    fwd = MetricsForwarder(events, 10, segment="0-80", attempt=1)
    assert samples(endpoint, run)[("mainspring_rollbacks_total", ())] == 0  # from the start
    two_ranks = [[0, 3000, 4000], [1, 3100, 4200]]
    for line in (step(1, 3.0, dt=1.0), step(2, 2.9, dt=1.0),
                 StepLine(step=3, loss=2.8, lr=1e-4, step_time_s=0.5, grad_norm=1.5,
                          mem_by_rank=two_ranks, comm_exposed_s=0.1, comm_exposed_frac=0.2),
                 CommitLine(step=3, uri="file:///x", stall_s=0.25, upload_lag_s=1.5),
                 EvalLine(step=3, val_loss=3.25),
                 step(4, 50.0, "rollback", dt=1.0),  # vetoed, and the model goes back
                 step(4, 2.7, dt=0.5),  # the replay: its time replaces the first's
                 CommitLine(step=4, uri="file:///x", stall_s=0.5, upload_lag_s=2.0)):
        fwd.on_progress(line)
    fault = events.emit("fault", step=4, event_id="fault/0-80/x/1", kind="rank_lost",
                        injected=False)
    events.emit("fault", step=4, event_id="fault/0-80/x/1", kind="worker_lost")  # again: once
    events.emit("fault", step=2, event_id="fault/injected/2", kind="crash", injected=True)
    events.emit("recovered", step=3, event_id="recovered/0-80/x/1.1", mttr_s=7.5,
                fault_event_id=fault["event_id"])

    got = samples(endpoint, run)
    assert got[("mainspring_step_time_seconds", ())] == 0.5
    assert got[("mainspring_grad_norm", ())] == 1.5
    assert got[("mainspring_validation_loss", ())] == 3.25
    assert got[("mainspring_checkpoint_stall_seconds", ())] == 0.5
    assert got[("mainspring_checkpoint_stall_time_seconds_total", ())] == 0.75
    assert got[("mainspring_checkpoint_upload_lag_seconds", ())] == 2.0
    assert got[("mainspring_rollbacks_total", ())] == 1
    assert got[("mainspring_faults_total", (("kind", "rank_lost"),))] == 1
    assert ("mainspring_faults_total", (("kind", "worker_lost"),)) not in got
    assert ("mainspring_faults_total", (("kind", "crash"),)) not in got  # injected: no fault
    assert got[("mainspring_recoveries_total", ())] == 1
    assert got[("mainspring_mttr_seconds", ())] == 7.5
    for rank, allocated, reserved in two_ranks:
        assert got[("mainspring_memory_peak_allocated_bytes", (("rank", str(rank)),))] == allocated
        assert got[("mainspring_memory_reserved_bytes", (("rank", str(rank)),))] == reserved
    assert got[("mainspring_comm_exposed_time_seconds", ())] == 0.1
    assert got[("mainspring_comm_exposed_fraction", ())] == 0.2
    # kept applied step time: 1 + 1 + 0.5 + the replay's 0.5 (the rollback step's 1 s is
    # replaced), over the wall time since the run's first segment began here: far more
    goodput = got[("mainspring_goodput", ())]
    assert 0 < goodput <= 1
    assert tally(run).productive == pytest.approx(3.0)
    assert not any(name.startswith("mainspring_gpu_") for name, _ in got)  # no NVML here
    # the dashboard's other queries are on series this endpoint serves (the e2e test runs
    # them on a real Prometheus)
    served = {name for name, _ in got}
    assert {n for n in dashboard_names() if not n.startswith("mainspring_gpu_")} <= served


def dashboard_names() -> set[str]:
    dashboard = json.loads((pathlib.Path(__file__).resolve().parents[2] / "ops" / "dashboards"
                            / "mainspring.json").read_text())
    return {n for p in dashboard["panels"] for t in p.get("targets", [])
            for n in re.findall(r"mainspring_[a-z_]+", t["expr"])}


def test_goodput_counts_each_step_number_s_last_execution_and_only_applied_updates():
    t = RunTally(since=100.0)
    for step_no, seconds, applied in ((1, 1.0, True), (2, 1.0, True), (3, 1.0, False),
                                      (2, 2.0, True), (3, 1.5, True)):  # a replay of 2-3
        t.step(step_no, seconds, applied)
    assert t.productive == pytest.approx(1.0 + 2.0 + 1.5)
    assert t.goodput(110.0) == pytest.approx(0.45)
    assert t.goodput(100.0) is None and t.goodput(101.0) == 1.0  # clamped
    assert t.first("fault/a") and not t.first("fault/a")


def test_nvml_samples_are_published_under_the_names_the_dashboard_s_nvml_panels_query(
        tmp_path, endpoint, monkeypatch):
    from activities import nvml
    from tests.activities.test_nvml import fake_pynvml

    sampler = nvml.Nvml(fake_pynvml(ecc=True), [("0", object())]).start(0.01)
    deadline = time.monotonic() + 10
    while not sampler.latest() and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    monkeypatch.setattr(nvml, "_opened", [sampler])  # as on a CUDA worker with pynvml
    run = f"g-{uuid.uuid4().hex[:8]}"
    MetricsForwarder(EventLog(str(tmp_path), run, "supervisor", attempt=1), 10,
                     segment="0-80", attempt=1).on_progress(step(1, 3.0))
    got = {(name, labels): v for (name, labels), v in samples(endpoint, run).items()
           if name.startswith("mainspring_gpu_")}
    assert got[("mainspring_gpu_utilization", (("gpu", "0"),))] == 0.87
    assert got[("mainspring_gpu_memory_bandwidth_utilization", (("gpu", "0"),))] == 0.41
    assert got[("mainspring_gpu_memory_used_bytes", (("gpu", "0"),))] == 40 * 2**30
    assert got[("mainspring_gpu_pcie_throughput_bytes_per_second",
                (("direction", "rx"), ("gpu", "0")))] == 250 * 1024
    assert got[("mainspring_gpu_power_watts", (("gpu", "0"),))] == 312.5
    assert got[("mainspring_gpu_temperature_celsius", (("gpu", "0"),))] == 64
    assert got[("mainspring_gpu_ecc_errors", (("gpu", "0"), ("type", "uncorrected")))] == 1
    queried = {n for n in dashboard_names() if n.startswith("mainspring_gpu_")}
    assert queried == {name for name, _ in got}  # every NVML series on the wall, no other
