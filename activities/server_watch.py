"""The Temporal server's outages, as a trainer worker sees them while a segment runs.

A server that goes away mid-segment is no reason to stop training, and nothing stops it:
the child never talks to Temporal; a heartbeat that cannot reach the server is retried for
about 10 s, logged and dropped (sdk-core `activity_heartbeat_manager.rs`: only NotFound
cancels the activity); task polls retry without limit (`retry.rs`,
`task_poll_retry_policy`), so the workers reconnect by themselves once it is back. Two
things still went wrong, and this module sees to them:

- the outage left no record. `watching` probes the frontend's gRPC health service every
  `every_s` from a thread and connection of its own; `misses` failed probes in a row are a
  `fault` event (kind `server_unavailable`) and the next good probe is its `recovered`
  (outage and detection times, the steps trained meanwhile), in the run's durable event
  log, which does not need the server. Ids are per attempt and outage, so a rerun of the
  same attempt's code writes the same ids;
- a segment that ended while the server was away lost its result: the SDK tries the
  completion for about 10 s and drops it, and the workflow then waited out the heartbeat
  timeout for a retry that had nothing left to train (seen with the dev server: 136 s).
  Leaving `watching` while the server is unreachable waits for it, heartbeating (the SDK's
  local heartbeat timer cancels an activity that stops heartbeating), so the result lands as
  soon as it is back.

Only a frontend that does not answer is away. Some do not serve `grpc.health.v1` (a proxy,
a cloud endpoint: UNIMPLEMENTED), and their answer says nothing about Temporal behind them:
the probe then asks the API itself (`GetSystemInfo`, what the SDK calls on connect) from
then on. A frontend that serves neither turns the watch off with a warning (it could never
see an outage there, nor its end), so it records no fault and holds no result; counted as
an outage, it held every finished segment's result for MAX_HOLD_S. A slow answer is an
answer: a probe fails on no answer within PROBE_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import structlog
from temporalio import activity
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.service import ConnectConfig, RPCError, RPCStatusCode, ServiceClient

from activities.contracts import TrainSegmentInput
from activities.recovery import already_recovered
from activities.supervise import ProgressTail
from common.errors import StorageUnavailable
from common.faults import SERVER_WATCH, Fault, record_fault, recovered_id
from common.protocol import StartLine, StepLine
from common.threads import in_context
from spec import RunSpec
from storage.events import EventLog

log = structlog.get_logger(__name__)

KIND = "server_unavailable"  # common/fault_kinds.py FAULT_KINDS
EVERY_S = 2.0  # between probes: an outage is seen within misses x EVERY_S
MISSES = 2  # failed probes in a row that make an outage (one slow answer is not one)
# An answer later than this is none. The SDK gives an activity's completion about 10 s of
# retries (module doc): a frontend that answers within that still takes the result.
# (3 s made a frontend that answers in 4 s an outage, and its results waited for it.)
PROBE_TIMEOUT_S = 10.0
# Answers from a frontend that is there but does not serve this method to us: health
# without the service (UNIMPLEMENTED), without the workflow service's entry (NOT_FOUND),
# or not to this caller. Any other error, or none within the timeout, is the frontend away.
NOT_SERVED = frozenset({RPCStatusCode.UNIMPLEMENTED, RPCStatusCode.NOT_FOUND,
                        RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNAUTHENTICATED})
MAX_HOLD_S = 3600.0  # the longest a finished segment waits for the server to come back

_CONFIG: dict[str, ConnectConfig] = {}


def configure(config: ConnectConfig) -> None:
    """The worker's own connection settings (address, TLS, API key), from ops/worker.py;
    until it is called `watching` watches nothing (an activity run outside a worker)."""
    _CONFIG["connect"] = config


class Unprobeable(Exception):
    """The frontend answers, but serves neither health checks nor GetSystemInfo to us."""

    def __init__(self, address: str, status: str) -> None:
        self.address, self.status = address, status
        super().__init__(f"{address} serves neither grpc.health.v1 nor GetSystemInfo ({status})")


class HealthProbe:
    """One check of the frontend per call: '' when it answers, else what failed; raises
    Unprobeable for a frontend no probe can read (module doc). Own event loop and lazy
    connection, so it can start while the server is away and never waits on the worker's
    event loop."""

    def __init__(self, config: ConnectConfig, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.config = dataclasses.replace(config, lazy=True)
        self.address, self.timeout_s = config.target_host, timeout_s
        self.loop = asyncio.new_event_loop()
        self.client: ServiceClient | None = None
        self.health = True  # False once the frontend said it serves no health checks

    def __call__(self) -> str:
        try:  # at most two calls, each with its own deadline
            return self.loop.run_until_complete(
                asyncio.wait_for(self._check(), 2 * self.timeout_s + 1))
        except Unprobeable:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to answer is the finding
            return f"{type(exc).__name__}: {exc}"[:300]

    async def _check(self) -> str:
        if self.client is None:
            self.client = await ServiceClient.connect(self.config)
        timeout = timedelta(seconds=self.timeout_s)
        if self.health:
            try:
                serving = await self.client.check_health(timeout=timeout)
                return "" if serving else "health check: NOT_SERVING"
            except RPCError as exc:
                if exc.status not in NOT_SERVED:
                    raise
                self.health = False
                log.warning("server_watch_health_unsupported", address=self.address,
                            status=exc.status.name, instead="GetSystemInfo")
        try:
            await self.client.workflow_service.get_system_info(GetSystemInfoRequest(),
                                                               timeout=timeout)
        except RPCError as exc:
            if exc.status in NOT_SERVED:
                raise Unprobeable(self.address, exc.status.name) from None
            raise
        return ""

    def close(self) -> None:
        if not self.loop.is_running():  # a probe stuck past stop()'s join keeps its loop
            self.loop.close()


class ServerWatch:
    """Probe results in, `fault`/`recovered` events out (module doc). `observe` is the
    whole decision; the thread only calls it every `every_s`."""

    def __init__(self, probe: Callable[[], str], events: EventLog, *, id_base: str,
                 segment: str, address: str, progress_file: str, every_s: float = EVERY_S,
                 misses: int = MISSES) -> None:
        self.probe, self.events, self.id_base, self.segment = probe, events, id_base, segment
        self.address, self.every_s, self.misses = address, every_s, misses
        self.tail = ProgressTail(progress_file)
        self.last_ok = time.time()  # the server answered when the attempt was handed out
        self.failed = 0  # probes failed in a row
        self.outages = 0
        self.outage: Fault | None = None  # the open one
        self.last_step: int | None = None
        self.restarted = False  # a child (re)started during the open outage
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def reachable(self) -> bool:
        return self.failed == 0

    @property
    def watching(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def observe(self, error: str, now: float) -> None:
        """One probe's result ('' = the server answered) at `now`."""
        for line in self.tail.read():
            if isinstance(line, StepLine):
                self.last_step = line.step
            elif isinstance(line, StartLine) and self.outage is not None:
                self.restarted = True
        if not error:
            if self.outage is not None:
                self._recovered(now)
            self.failed, self.last_ok = 0, now
            return
        self.failed += 1
        if self.failed == self.misses and self.outage is None:
            self._fault(error, now)

    def _fault(self, error: str, now: float) -> None:
        self.outages += 1
        self.restarted = False
        self.outage = Fault(
            KIND, f"{self.failed} health checks of the Temporal frontend {self.address} "
                  f"failed in a row; the last: {error}",
            event_id=f"fault/{KIND}/{self.id_base}/{self.outages}", detected_by=SERVER_WATCH,
            attempt=self.events.attempt, segment=self.segment, last_step=self.last_step,
            fault_ts=self.last_ok, detected_ts=now, facts={"address": self.address})
        record_fault(self.events, self.outage)
        self._flush()

    def _recovered(self, now: float) -> None:
        o, self.outage = self.outage, None
        assert o is not None and o.fault_ts is not None
        if already_recovered(self.events, o.event_id):  # the retried attempt closed it
            log.info("fault_already_recovered", fault_event_id=o.event_id,
                     outage_s_here=round(now - o.fault_ts, 3))
            return
        trained = None if o.last_step is None or self.last_step is None \
            else self.last_step - o.last_step
        self.events.emit(
            "recovered", step=self.last_step, event_id=recovered_id(o.event_id),
            fault_event_id=o.event_id, fault_kind=KIND, attempt=self.events.attempt,
            resumed_step=self.last_step, steps_during_outage=trained,
            # the child trained on: nothing was lost unless it restarted meanwhile (then
            # the new attempt's own `recovered` counts what it redid)
            lost_steps=None if self.restarted else 0, child_restarted=self.restarted,
            detection_s=o.detection_s, outage_s=round(now - o.fault_ts, 3), restart_s=0.0,
            restore_s=0.0, mttr_s=round(now - o.fault_ts, 3))
        self._flush()

    def _flush(self) -> None:
        try:
            self.events.flush()
        except StorageUnavailable as exc:  # kept in the buffer for the next flush
            log.warning("server_watch_event_not_stored", error=exc.cause[:200])

    def start(self) -> ServerWatch:
        # the activity's context (its span: the events are span events there too)
        self._thread = in_context(self._run, name="server-watch")
        return self

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.every_s):
                error = self.probe()
                if self._stop.is_set():
                    return
                self.observe(error, time.time())
        except Unprobeable as exc:  # ends the thread: `watching` turns false, nothing held
            self.failed = 0
            log.warning("server_watch_off", address=self.address, reason=str(exc),
                        fix="serve grpc.health.v1 or GetSystemInfo to the workers, or ignore: "
                            "server outages are then not recorded for this run")
        except Exception:  # the watch is a record, never a reason to fail the segment
            log.exception("server_watch_failed", address=self.address)

    def hold_until_reachable(self, heartbeat: Callable[[], None],
                             shutdown: Callable[[float], bool], max_s: float) -> None:
        """Before the activity returns: while the last probe failed, wait for a good one
        (heartbeating), at most `max_s` or until the worker shuts down."""
        began = time.monotonic()
        if not self.reachable:
            log.warning("segment_done_server_unreachable", address=self.address)
        while not self.reachable and self.watching and time.monotonic() - began < max_s:
            heartbeat()
            if shutdown(self.every_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # a probe still waiting for its answer sees _stop when it returns, and then
            # observes nothing: the segment's result does not wait for it
            self._thread.join(self.every_s + 2)
        self._flush()


@contextmanager
def watching(spec: RunSpec, inp: TrainSegmentInput, attempt: int, execution: str,
             workdir: str, heartbeat: Callable[[], None]) -> Iterator[ServerWatch | None]:
    """Watch the server for the duration of one train_segment attempt (module doc)."""
    config = _CONFIG.get("connect")
    if config is None:
        yield None
        return
    probe = HealthProbe(config)
    watch = ServerWatch(
        probe, EventLog(spec.storage.durable, spec.run_id, "server-watch", attempt=attempt),
        id_base=f"{inp.from_step}-{inp.to_step}/{execution}/{attempt}",
        segment=f"{inp.from_step}-{inp.to_step}", address=probe.address,
        progress_file=os.path.join(workdir, "progress.jsonl")).start()
    try:
        yield watch
    finally:
        try:
            watch.hold_until_reachable(heartbeat, _worker_stopping, MAX_HOLD_S)
        finally:
            watch.stop()
            probe.close()


def _worker_stopping(wait_s: float) -> bool:
    """Wait up to `wait_s`; True once the worker shuts down (a drain: stop waiting)."""
    activity.wait_for_worker_shutdown_sync(wait_s)
    return activity.is_worker_shutdown()
