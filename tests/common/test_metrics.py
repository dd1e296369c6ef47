"""The worker's Prometheus endpoint (common/metrics.py) fed by the supervisor's progress path
(activities/metrics.py): scraped over HTTP exactly as Prometheus would."""

from __future__ import annotations

import socket
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from activities.metrics import MetricsForwarder
from common import metrics
from common.errors import BadConfig
from common.protocol import CommitLine, StartLine, StepLine
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
