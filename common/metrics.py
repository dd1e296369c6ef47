"""Prometheus metrics for a worker process (DESIGN §4: "a Prometheus endpoint on each worker").

`serve_metrics(port, service)` sets up an OpenTelemetry MeterProvider whose
PrometheusMetricReader is scraped at `http://<host>:<port>/metrics` (prometheus_client's
HTTP server, a daemon thread). Port 0 means disabled: nothing is created, and the
training feed (`activities/metrics.py`) finds `training_instruments()` is None and does
nothing. One endpoint per process: a port is a process's, not a run's.

Instruments are named the OpenTelemetry way (dotted, no unit in the name, the unit in
`unit`); the exporter turns dots into `_`, appends the unit (`By` -> `_bytes`,
`{token}/s` -> `_per_second`; `1` and `{…}` annotations add nothing) and `_total` to
counters. What a user greps for, every series labelled `run_id`:

    mainspring_train_step                   gauge    last optimizer step reported
    mainspring_train_loss                   gauge    last finite training loss
    mainspring_learning_rate                gauge    LR of the last step
    mainspring_tokens_per_second            gauge    throughput of the last step
    mainspring_mfu                          gauge    model FLOPs utilisation (0..1)
    mainspring_peak_memory_bytes            gauge    peak GPU memory (CPU: peak RSS), rank 0
    mainspring_train_steps_total            counter  steps run (rollback replays count again)
    mainspring_tokens_total                 counter  tokens trained on (replays included)
    mainspring_batches_skipped_total        counter  updates skipped by the spike guard
    mainspring_checkpoints_committed_total  counter  durable checkpoint commits
    mainspring_step_time_seconds            gauge    wall time of the last optimizer step
    mainspring_grad_norm                    gauge    gradient 2-norm of the last step (pre-clip)
    mainspring_validation_loss              gauge    last online evaluation's held-out loss
    mainspring_checkpoint_stall_seconds     gauge    the loop's pause for the last checkpoint
    mainspring_checkpoint_stall_time_seconds_total  counter  those pauses, summed
    mainspring_checkpoint_upload_lag_seconds  gauge  last checkpoint: fast-tier copy -> durable
    mainspring_rollbacks_total              counter  spike-guard rollbacks
    mainspring_faults_total                 counter  faults the supervisor recorded, by `kind`
    mainspring_recoveries_total             counter  recoveries from them
    mainspring_mttr_seconds                 gauge    the last recovery's fault -> first new step
    mainspring_goodput                      gauge    productive step time / wall time (0..1)
    mainspring_memory_peak_allocated_bytes  gauge    per `rank` (CPU: peak RSS)
    mainspring_memory_reserved_bytes        gauge    per `rank`, peak (CPU: current RSS)
    mainspring_comm_exposed_time_seconds    gauge    exposed communication of a profiled step
    mainspring_comm_exposed_fraction        gauge    that time / its step time (0..1)
    mainspring_gpu_*                        gauges   NVML, per `gpu` (activities/nvml.py)

The efficiency figures and how each is measured: docs/design.md §4 ("Metrics").

The Temporal SDK's own worker metrics (task slots, poll and schedule-to-start latencies,
activity failures) come from its Rust core, which serves Prometheus itself and so needs a
port of its own: `serve_temporal_metrics(port)`, names prefixed `temporal_`.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

import structlog
from opentelemetry import metrics as otel_metrics

# The API's synchronous gauge type is spelled `_Gauge` (create_gauge returns one).
from opentelemetry.metrics import Counter, Meter
from opentelemetry.metrics import _Gauge as Gauge

from common.errors import BadConfig

log = structlog.get_logger(__name__)

PORT_ENV = "MAINSPRING_METRICS_PORT"
TEMPORAL_PORT_ENV = "MAINSPRING_TEMPORAL_METRICS_PORT"


@dataclass(frozen=True)
class TrainingInstruments:
    """The training instruments, created once per process (see the module docstring)."""

    step: Gauge
    loss: Gauge
    learning_rate: Gauge
    tokens_per_second: Gauge
    mfu: Gauge
    peak_memory: Gauge
    steps: Counter
    tokens: Counter
    batches_skipped: Counter
    checkpoints_committed: Counter
    step_time: Gauge
    grad_norm: Gauge
    validation_loss: Gauge
    checkpoint_stall: Gauge
    checkpoint_stall_time: Counter
    upload_lag: Gauge
    rollbacks: Counter
    faults: Counter
    recoveries: Counter
    mttr: Gauge
    goodput: Gauge
    memory_peak_allocated: Gauge
    memory_reserved: Gauge
    comm_exposed_time: Gauge
    comm_exposed_fraction: Gauge
    gpu: GpuInstruments

    @classmethod
    def create(cls, meter: Meter) -> TrainingInstruments:
        g, c = meter.create_gauge, meter.create_counter
        return cls(
            **cls._dashboard_series(meter),
            step=g("mainspring.train.step", unit="{step}", description="Last optimizer step"),
            loss=g("mainspring.train.loss", unit="1",
                   description="Last finite training loss (a non-finite one is not recorded)"),
            learning_rate=g("mainspring.learning_rate", unit="1",
                            description="Learning rate of the last step"),
            tokens_per_second=g("mainspring.tokens_per_second", unit="{token}/s",
                                description="Training throughput of the last step"),
            mfu=g("mainspring.mfu", unit="1", description="Model FLOPs utilisation, 0..1"),
            peak_memory=g("mainspring.peak_memory", unit="By",
                          description="Peak accelerator memory (CPU: peak RSS) of rank 0"),
            steps=c("mainspring.train.steps", unit="{step}",
                    description="Optimizer steps run, rollback replays included"),
            tokens=c("mainspring.tokens", unit="{token}",
                     description="Tokens trained on, rollback replays included"),
            batches_skipped=c("mainspring.batches_skipped", unit="{batch}",
                              description="Updates skipped by the spike guard"),
            checkpoints_committed=c("mainspring.checkpoints_committed", unit="{checkpoint}",
                                    description="Checkpoints committed to the durable tier"),
        )

    @staticmethod
    def _dashboard_series(meter: Meter) -> dict:
        """The wall-dashboard series (ops/dashboards/mainspring.json)."""
        g, c = meter.create_gauge, meter.create_counter
        return dict(
            step_time=g("mainspring.step_time", unit="s",
                        description="Wall time of the last optimizer step"),
            grad_norm=g("mainspring.grad_norm", unit="1",
                        description="Gradient 2-norm of the last step, before clipping"),
            validation_loss=g("mainspring.validation.loss", unit="1",
                              description="Held-out loss of the last online evaluation"),
            checkpoint_stall=g("mainspring.checkpoint.stall", unit="s",
                               description="The step loop's pause for the last checkpoint"),
            checkpoint_stall_time=c("mainspring.checkpoint.stall_time", unit="s",
                                    description="The step loop's checkpoint pauses, summed"),
            upload_lag=g("mainspring.checkpoint.upload_lag", unit="s",
                         description="Last checkpoint: fast-tier copy to durable commit"),
            rollbacks=c("mainspring.rollbacks", unit="{rollback}",
                        description="Rollbacks of the spike guard"),
            faults=c("mainspring.faults", unit="{fault}",
                     description="Faults the supervisor recorded, by kind"),
            recoveries=c("mainspring.recoveries", unit="{recovery}",
                         description="Recoveries from faults (a new launch's first step)"),
            mttr=g("mainspring.mttr", unit="s",
                   description="The last recovery's time from fault to first new step"),
            goodput=g("mainspring.goodput", unit="1",
                      description="Kept productive step time / wall time since this worker's "
                                  "first segment of the run, 0..1"),
            memory_peak_allocated=g("mainspring.memory.peak_allocated", unit="By",
                                    description="Peak allocated device memory per rank "
                                                "(CPU: peak RSS)"),
            memory_reserved=g("mainspring.memory.reserved", unit="By",
                              description="Peak reserved device memory per rank "
                                          "(CPU: current RSS)"),
            comm_exposed_time=g("mainspring.comm.exposed_time", unit="s",
                                description="Exposed communication time of the last "
                                            "profiled step (ops.profile_every)"),
            comm_exposed_fraction=g("mainspring.comm.exposed_fraction", unit="1",
                                    description="Compute/communication overlap: exposed "
                                                "communication / step time, 0..1"),
            gpu=GpuInstruments.create(meter),
        )


@dataclass(frozen=True)
class GpuInstruments:
    """NVML's view of the worker's GPUs (activities/nvml.py), labelled `run_id` and `gpu`."""

    utilization: Gauge
    memory_used: Gauge
    memory_bandwidth: Gauge
    pcie: Gauge
    power: Gauge
    temperature: Gauge
    ecc_errors: Gauge

    @classmethod
    def create(cls, meter: Meter) -> GpuInstruments:
        g = meter.create_gauge
        return cls(
            utilization=g("mainspring.gpu.utilization", unit="1",
                          description="Fraction of time a kernel ran (NVML), 0..1"),
            memory_used=g("mainspring.gpu.memory.used", unit="By",
                          description="Device memory in use (NVML)"),
            memory_bandwidth=g("mainspring.gpu.memory_bandwidth.utilization", unit="1",
                               description="Fraction of time device memory was read or "
                                           "written (NVML), 0..1"),
            pcie=g("mainspring.gpu.pcie.throughput", unit="By/s",
                   description="PCIe throughput by direction, tx | rx (NVML, 20 ms window)"),
            power=g("mainspring.gpu.power", unit="W", description="Power draw (NVML)"),
            temperature=g("mainspring.gpu.temperature", unit="Cel",
                          description="GPU die temperature (NVML)"),
            ecc_errors=g("mainspring.gpu.ecc_errors", unit="{error}",
                         description="ECC errors since the driver loaded, by type "
                                     "corrected | uncorrected (NVML, volatile)"),
        )


_served: tuple[int, TrainingInstruments] | None = None


def training_instruments() -> TrainingInstruments | None:
    """The process's instruments, or None when no endpoint is served (metrics are off)."""
    return _served[1] if _served else None


def serve_metrics(port: int, service: str, addr: str = "0.0.0.0") -> int | None:
    """Serve /metrics on `port` (0: disabled, returns None); returns the bound port.

    A second call in the same process keeps the first endpoint: the instruments and the
    MeterProvider are process-wide, like the port.
    """
    global _served
    if port <= 0:
        return None
    if _served:
        log.warning("metrics_already_served", port=_served[0], asked=port)
        return _served[0]
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from prometheus_client import start_http_server

    try:
        httpd, _ = start_http_server(port, addr=addr)
    except OSError as exc:
        raise _port_error("--metrics-port", PORT_ENV, port, exc) from None
    # Scope labels (otel_scope_name, …) would be the same on every series here: one meter.
    reader = PrometheusMetricReader(scope_info_enabled=False)
    provider = MeterProvider(metric_readers=[reader],
                             resource=Resource.create({"service.name": f"mainspring-{service}"}))
    otel_metrics.set_meter_provider(provider)
    _served = (httpd.server_port, TrainingInstruments.create(provider.get_meter("mainspring")))
    log.info("metrics_serving", port=httpd.server_port, addr=addr, path="/metrics")
    return httpd.server_port


def serve_temporal_metrics(port: int, addr: str = "0.0.0.0") -> int | None:
    """The Temporal SDK's worker metrics on their own port (0: disabled).

    Must run before the process's first Temporal client: it sets the SDK's default
    Runtime, and a client keeps the Runtime it was created with.
    """
    if port <= 0:
        return None
    from temporalio.runtime import Runtime

    Runtime.set_default(temporal_runtime(port, addr))
    log.info("temporal_metrics_serving", port=port, addr=addr, path="/metrics")
    return port


def temporal_runtime(port: int, addr: str = "0.0.0.0"):
    """A Temporal Runtime whose core serves Prometheus on addr:port (bound at once)."""
    from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

    # Prometheus conventions, as for our own names: `_total` counters, unit suffixes,
    # durations as float seconds (the SDK's defaults are none of these).
    config = PrometheusConfig(bind_address=f"{addr}:{port}", counters_total_suffix=True,
                              unit_suffix=True, durations_as_seconds=True)
    try:
        return Runtime(telemetry=TelemetryConfig(metrics=config))
    except ValueError as exc:  # the SDK reports a bind failure as ValueError
        raise _port_error("--temporal-metrics-port", TEMPORAL_PORT_ENV, port, exc) from None


def _port_error(flag: str, env: str, port: int, exc: Exception) -> BadConfig:
    in_use = getattr(exc, "errno", None) == errno.EADDRINUSE or "in use" in str(exc)
    problem = f"port {port} is already in use" if in_use else f"cannot serve on {port}: {exc}"
    return BadConfig(flag, problem, f"pick another port with {flag} or {env}, or 0 to disable")
