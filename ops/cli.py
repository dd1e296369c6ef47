"""The `mainspring` command line (DESIGN §6)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

from ops.errors import BadConfig


def _load_spec(args: argparse.Namespace):
    from ops.spec import RunSpec, deep_merge, dotted_to_nested, preset

    overrides = {}
    for item in args.set or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise BadConfig(f"--set {item}", "expected KEY=VALUE", "e.g. --set train.total_steps=400")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    if args.spec:
        try:
            with open(args.spec) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise BadConfig("--spec", f"cannot read {args.spec}: {exc}", "give a JSON RunSpec file")
        return RunSpec.from_dict(deep_merge(raw, dotted_to_nested(overrides)))
    return preset(args.preset, **overrides)


def cmd_dev(args: argparse.Namespace) -> int:
    from ops.services import SeaweedS3, TemporalDevServer

    state = os.path.abspath(args.state_dir)
    server = TemporalDevServer(os.path.join(state, "temporal"), port=args.port,
                               ui_port=args.ui_port, headless=args.headless).start()
    print(f"Temporal gRPC: {server.address}")
    if not args.headless:
        print(f"Temporal UI:   {server.ui_url}")
    s3 = None
    if args.s3:
        s3 = SeaweedS3(os.path.join(state, "s3"), s3_port=args.s3_port).start()
        print(f"S3 endpoint:   {s3.endpoint}  bucket: s3://{s3.bucket}")
        for key, value in s3.env().items():
            print(f"export {key}={value}")
    print("Ctrl-C stops.", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        server.stop()
        if s3:
            s3.stop()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from ops import telemetry
    from ops.worker import run_workers

    telemetry.configure(f"worker-{args.role}", replay_safe=args.role in ("orchestrator", "all"))
    try:
        asyncio.run(run_workers({args.role}, args.address, args.namespace, args.trainer_slots))
    finally:
        telemetry.flush()
    return 0


async def _run_start(args: argparse.Namespace) -> int:
    from ops.client import connect, localize, start_run
    from ops.demo import watch

    spec = localize(_load_spec(args))
    client = await connect(args.address, args.namespace)
    handle = await start_run(client, spec)
    print(json.dumps({"run_id": spec.run_id, "workflow_id": handle.id,
                      "run": handle.result_run_id}))
    if args.wait:
        result = await watch(client, spec)
        print(json.dumps(result, default=str))
    return 0


async def _run_status(args: argparse.Namespace) -> int:
    from ops.client import connect

    client = await connect(args.address, args.namespace)
    handle = client.get_workflow_handle(args.run_id)
    desc = await handle.describe()
    out = {"run_id": args.run_id, "workflow_status": desc.status.name if desc.status else None}
    try:
        out.update(await handle.query("status"))
    except Exception as exc:  # noqa: BLE001 - a closed run may not answer queries
        out["query_error"] = str(exc)
    print(json.dumps(out, default=str, indent=1))
    return 0


async def _run_resume(args: argparse.Namespace) -> int:
    """Continue a run paused in needs_attention (the TrainingRun `resume` update)."""
    from temporalio.client import WorkflowUpdateFailedError
    from temporalio.service import RPCError

    from ops.client import connect

    client = await connect(args.address, args.namespace)
    handle = client.get_workflow_handle(args.run_id)
    try:
        out = await handle.execute_update("resume", args.note)
    except (WorkflowUpdateFailedError, RPCError) as exc:  # not paused / already closed
        cause = getattr(getattr(exc, "cause", None), "message", None) or str(exc)
        print(f"mainspring: cannot resume {args.run_id}: {cause}", file=sys.stderr)
        return 1
    print(json.dumps(out, default=str))
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    from storage.events import read_events

    for event in read_events(args.durable, args.run_id, tuple(args.kind or ())):
        stamp = time.strftime("%H:%M:%S", time.localtime(event["ts"]))
        print(f"{stamp} step={event['step']} {event['kind']:<20} {json.dumps(event['payload'])}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ops.client import default_address

    p = argparse.ArgumentParser(prog="mainspring", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def temporal_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--address", default=default_address(), help="Temporal frontend host:port")
        sp.add_argument("--namespace", default=os.environ.get("TEMPORAL_NAMESPACE", "default"))

    dev = sub.add_parser("dev", help="run the Temporal dev server (and S3) locally")
    dev.add_argument("--port", type=int, default=7233)
    dev.add_argument("--ui-port", type=int, default=8233)
    dev.add_argument("--headless", action="store_true")
    dev.add_argument("--s3", action="store_true", help="also start SeaweedFS's S3 gateway")
    dev.add_argument("--s3-port", type=int, default=8333)
    dev.add_argument("--state-dir", default=".mainspring")
    dev.set_defaults(fn=cmd_dev)

    worker = sub.add_parser("worker", help="run workers for one role")
    worker.add_argument("--role", choices=("orchestrator", "data", "trainer", "all"), required=True)
    worker.add_argument("--trainer-slots", type=int, default=1)
    temporal_flags(worker)
    worker.set_defaults(fn=cmd_worker)

    run = sub.add_parser("run", help="start and inspect runs")
    run_sub = run.add_subparsers(dest="run_command", required=True)
    start = run_sub.add_parser("start")
    src = start.add_mutually_exclusive_group(required=True)
    src.add_argument("--spec", help="RunSpec JSON file")
    src.add_argument("--preset", help="a built-in spec, e.g. demo")
    start.add_argument("--set", action="append", help="override, e.g. train.total_steps=400")
    start.add_argument("--wait", action="store_true", help="watch until the run ends")
    temporal_flags(start)
    start.set_defaults(fn=lambda a: asyncio.run(_run_start(a)))
    status = run_sub.add_parser("status")
    status.add_argument("run_id")
    temporal_flags(status)
    status.set_defaults(fn=lambda a: asyncio.run(_run_status(a)))

    resume = run_sub.add_parser("resume", help="continue a run paused in needs_attention")
    resume.add_argument("run_id")
    resume.add_argument("--note", default="", help="why it is safe to continue (recorded)")
    temporal_flags(resume)
    resume.set_defaults(fn=lambda a: asyncio.run(_run_resume(a)))

    events = sub.add_parser("events", help="print a run's event log")
    events.add_argument("run_id")
    events.add_argument("--durable", default=".mainspring/store", help="durable storage URL")
    events.add_argument("--kind", action="append")
    events.set_defaults(fn=cmd_events)

    demo = sub.add_parser("demo", help="one command: services, workers, a faulted run, summary")
    demo.add_argument("--json", action="store_true", help="end with one JSON summary line")
    demo.add_argument("--address", default="", help="use this Temporal instead of embedding one")
    demo.add_argument("--state-dir", default=".mainspring")
    demo.set_defaults(fn=lambda a: asyncio.run(_demo(a)))
    return p


async def _demo(args: argparse.Namespace) -> int:
    from ops import telemetry
    from ops.demo import run_demo

    telemetry.configure_logging(os.environ.get("MAINSPRING_LOG_LEVEL", "warning"))
    return await run_demo(args.json, args.address, args.state_dir)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args) or 0
    except BadConfig as exc:
        print(f"mainspring: bad config: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
