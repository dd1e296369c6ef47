"""`mainspring demo`: embedded Temporal, a worker fleet, the demo preset with an injected
worker kill, live progress, and a summary (one JSON line with --json)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

from temporalio.client import WorkflowFailureError
from temporalio.exceptions import TemporalError

from common.errors import StorageUnavailable
from common.procs import WorkerFleet
from ops.cli_output import automatic_rollback, injected, progress_view, recoveries, snapshot
from ops.client import connect, localize, start_run
from ops.report import build_report
from ops.services import TemporalDevServer, free_port, port_free
from ops.store_fields import checked_events
from spec import RunSpec, preset
from storage.events import read_events

# No worker to answer (a restart): show "waiting" after this long rather than hang.
QUERY_TIMEOUT = timedelta(seconds=10)


def summarize(spec: RunSpec, result: dict[str, Any] | None, status: str, wall_s: float) -> dict:
    """The demo's closing figures, counted from the run's own event log."""
    events = read_events(spec.storage.durable, spec.run_id)
    kinds = [e["kind"] for e in events]
    result = result or {}
    return {"run_id": spec.run_id, "status": status, "stages": result.get("stages", []),
            "faults_injected": sum(map(injected, events)),
            "faults_seen": sum(e["kind"] == "fault" and not injected(e) for e in events),
            "faults_recovered": recoveries(events),
            "spike_rollbacks": sum(automatic_rollback(e) for e in events),
            "batches_skipped": kinds.count("batch_skipped"),
            "human_actions": kinds.count("operator"),
            "initial_val_loss": result.get("initial_val_loss"),
            "final_val_loss": result.get("final_val_loss"),
            "promoted_checkpoint": result.get("promoted_checkpoint"), "wall_s": round(wall_s, 1)}


async def watch(client, run_id: str, durable: str, out=sys.stderr, every_s: float = 2.0,
                as_json: bool = False) -> dict:
    """Show progress until the run ends (across continue-as-new); return its result dict.
    On `out`: a rich step bar when it is a terminal, plain lines when not, JSON lines with
    `as_json` (ops/cli_output.py). A failed run raises WorkflowFailureError."""
    handle = client.get_workflow_handle(run_id)  # no run id: always the latest run
    task = asyncio.ensure_future(handle.result())
    try:
        with progress_view(out, as_json) as view:
            while not task.done():
                try:
                    status = await handle.query("status", rpc_timeout=QUERY_TIMEOUT)
                    view.show(snapshot(status, checked_events(read_events(durable, run_id))))
                except (TemporalError, StorageUnavailable) as exc:
                    view.waiting(type(exc).__name__)  # a query fails across continue-as-new
                await asyncio.wait([task], timeout=every_s)
    finally:
        if not task.done():  # Ctrl-C: stop waiting for the result, not the run
            task.cancel()
    result = task.result()
    return result if isinstance(result, dict) else result.__dict__


async def run_demo(as_json: bool, address: str = "", state_dir: str = ".mainspring") -> int:
    t0 = time.time()
    state_dir = os.path.abspath(state_dir)
    server = None
    if not address:
        if not port_free(7233):
            address = "127.0.0.1:7233"  # reuse a running `mainspring dev`
        else:
            server = TemporalDevServer(os.path.join(state_dir, "temporal"), port=free_port(),
                                       ui_port=free_port()).start()
            address = server.address
            print(f"Temporal UI: {server.ui_url}  (gRPC {address})", file=sys.stderr)
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    spec = localize(preset("demo", run_id=run_id, **{
        "storage.durable": os.path.join(state_dir, "store"),
        "storage.fast": os.path.join(state_dir, "fast")}))
    # the trainer worker takes as many segments at once as the sweep runs trials
    fleet = WorkerFleet(address, log_dir=os.path.join(state_dir, "logs", run_id),
                        env={"MAINSPRING_SPANS_DIR": os.path.join(state_dir, "spans", run_id)},
                        args=("--trainer-slots", str(spec.sweep.parallel))).start()
    status = "failed"
    result = None
    try:
        client = await connect(address)
        await start_run(client, spec)
        print(f"run {run_id} started: workflow id {run_id}, durable store {spec.storage.durable}",
              file=sys.stderr)
        try:
            result = await watch(client, spec.run_id, spec.storage.durable)
            status = result.get("status", "completed")
        except WorkflowFailureError as exc:
            print(f"run failed: {exc.cause}", file=sys.stderr)
    finally:
        fleet.stop()
        if server:
            server.stop()
    summary = summarize(spec, result, status, time.time() - t0)
    print(f"worker restarts by the process manager: {fleet.restarts}", file=sys.stderr)
    try:
        summary["report"] = build_report(spec.storage.durable, run_id,
                                         os.path.join(state_dir, "reports", run_id))["html"]
        print(f"report: {summary['report']}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - the summary still prints; say why no report
        summary["report"] = None
        print(f"no report: {exc}", file=sys.stderr)
    print(f"events: {spec.storage.durable}/runs/{run_id}/events/  "
          f"(mainspring events {run_id} --durable {spec.storage.durable})", file=sys.stderr)
    if as_json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:>20}: {value}")
    return 0 if status == "completed" else 1
