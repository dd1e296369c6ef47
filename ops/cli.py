"""The `mainspring` command line (DESIGN §6)."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import re
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

from activities.contracts import WORKFLOW_TYPE
from common.errors import BadConfig
from common.metrics import PORT_ENV, TEMPORAL_PORT_ENV
from common.procs import NODE_ENV

if TYPE_CHECKING:
    from spec import RunSpec


def _load_spec(args: argparse.Namespace):
    from spec import RunSpec, deep_merge, dotted_to_nested, preset

    overrides = {}
    for item in args.set or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise BadConfig(f"--set {item}", "expected KEY=VALUE", "e.g. --set train.total_steps=400")
        try:
            overrides[key] = json.loads(value)
        except ValueError:  # not JSON (JSONDecodeError), or a number json refuses to read
            overrides[key] = value
    if args.spec:
        try:
            with open(args.spec) as f:
                raw = json.load(f)
        except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, an absurd number
            raise BadConfig("--spec", f"cannot read {args.spec}: {exc}",
                            "give a JSON RunSpec file") from None
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
    from common import telemetry
    from ops.worker import run_workers

    telemetry.configure(f"worker-{args.role}", replay_safe=args.role in ("orchestrator", "all"))
    try:
        asyncio.run(run_workers({args.role}, args.address, args.namespace, args.trainer_slots,
                                args.metrics_port, args.temporal_metrics_port,
                                drain_timeout_s=args.drain_timeout_s, node=_node(args),
                                fast_root=os.path.abspath(args.fast_root) if args.fast_root else "",
                                standby_launcher=not args.no_standby))
    finally:
        telemetry.flush()
    return 0


def _node(args: argparse.Namespace):
    """The node this trainer worker is (`--node`), or None: the shared trainer queue only."""
    from activities.contracts import NodeInfo, node_queue
    from activities.nodes import default_address

    if not args.node:
        return None
    if args.role not in ("trainer", "all"):
        raise BadConfig("--node", f"a {args.role} worker runs no training",
                        "give --node to `mainspring worker --role trainer`")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", args.node):
        raise BadConfig("--node", f"{args.node!r} is not a node name",
                        "use 1-63 letters, digits, '.', '_' or '-' (a hostname works)")
    if not 1 <= args.rdzv_port <= 65535 or args.procs < 1 or args.gpus < 0:
        raise BadConfig("--rdzv-port/--procs/--gpus", f"got {args.rdzv_port}/{args.procs}/"
                        f"{args.gpus}", "a port in 1..65535, --procs >= 1, --gpus >= 0")
    return NodeInfo(name=args.node, queue=node_queue(args.node),
                    address=args.node_address or default_address(), rdzv_port=args.rdzv_port,
                    procs=args.procs, gpus=args.gpus, worker=f"{args.node}-{os.getpid()}")


async def _run_start(args: argparse.Namespace) -> int:
    from common import telemetry
    from ops.client import localize
    from storage.runs import check_claim

    spec = localize(_load_spec(args))
    # the run's own claim refuses it too; saying so here saves starting a doomed workflow
    check_claim(spec.storage.durable, spec.run_id, spec.spec_hash())
    # The client's StartWorkflow span is the root of the run's trace: it goes where the
    # run's own processes send theirs (ops.otlp_endpoint). Logs to stderr, JSON to stdout.
    telemetry.configure("cli", otlp_endpoint=spec.ops.otlp_endpoint,
                        log_level=os.environ.get("MAINSPRING_LOG_LEVEL", "warning"))
    try:
        return await _start_and_watch(args, spec)
    finally:
        # an unreachable collector delays the exit by the exporter's timeout (10 s unless
        # OTEL_EXPORTER_OTLP_TRACES_TIMEOUT says otherwise); the span file has the span
        telemetry.flush()


async def _start_and_watch(args: argparse.Namespace, spec: RunSpec) -> int:
    from temporalio.exceptions import WorkflowAlreadyStartedError

    from ops.client import connect, start_run
    from ops.demo import watch

    client = await connect(args.address, args.namespace)
    try:
        handle = await start_run(client, spec)
    except WorkflowAlreadyStartedError:
        print(f"mainspring: run {spec.run_id} is running or has completed in Temporal; only a "
              "failed, aborted or terminated run can be started again (to resume it, with the "
              "same spec); to start a new run, pick a new run_id", file=sys.stderr)
        return 1
    print(json.dumps({"run_id": spec.run_id, "workflow_id": handle.id,
                      "run": handle.result_run_id}))
    if args.wait:
        result = await watch(client, spec.run_id, spec.storage.durable)
        print(json.dumps(result, default=str))
    return 0


def list_query(stage: str | None, running_only: bool) -> str:
    """Temporal visibility query for mainspring runs (search attributes, DESIGN §6)."""
    clauses = [f"WorkflowType = '{WORKFLOW_TYPE}'"]
    if stage:
        clauses.append(f"MainspringStage = '{stage}'")
    if running_only:
        clauses.append("ExecutionStatus = 'Running'")
    return " AND ".join(clauses)


async def _run_list(args: argparse.Namespace) -> int:
    from ops.client import connect

    client = await connect(args.address, args.namespace)
    async for wf in client.list_workflows(list_query(args.stage, args.running), limit=args.limit):
        attrs = wf.typed_search_attributes
        row = {"run_id": wf.id, "status": wf.status.name if wf.status else None,
               "started": wf.start_time.isoformat(timespec="seconds")}
        for key in ("MainspringStage", "MainspringStep", "MainspringLoss"):
            value = next((p.value for p in attrs if p.key.name == key), None)
            row[key.removeprefix("Mainspring").lower()] = value
        print(json.dumps(row))
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


def operator_identity() -> str:
    """Who sent an operator command (recorded in the run's `operator` event)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        user = os.environ.get("USER", "unknown")
    return f"{user}@{socket.gethostname()}"


def operator_payload(args: argparse.Namespace) -> dict:
    """The JSON object a TrainingRun operator update/signal takes: the typed command
    (activities/contracts.py) as sent. Its own fields are checked here (Refused)."""
    from activities.contracts import Abort, Pause, Resume, Rollback, SetLrScale

    who, note = args.who or operator_identity(), args.note
    if args.run_command == "rollback":
        cmd = Rollback(to_step=args.to_step, skip_data=not args.keep_data, who=who, note=note)
    elif args.run_command == "set-lr":
        cmd = SetLrScale(scale=args.scale, steps=args.steps, who=who, note=note)
    else:
        cmd = {"pause": Pause, "resume": Resume, "abort": Abort}[args.run_command](
            who=who, note=note)
    return cmd.to_dict()


async def _run_operator(args: argparse.Namespace) -> int:
    """pause | resume | rollback | set-lr (Temporal updates, validated: a refusal says why)
    and abort (a signal)."""
    from temporalio.client import WorkflowUpdateFailedError
    from temporalio.service import RPCError

    from activities.contracts import Refused
    from ops.client import connect

    try:
        payload = operator_payload(args)
    except Refused as exc:  # the command's own fields: refused before it is sent
        print(f"mainspring: cannot {args.run_command} {args.run_id}: {exc}", file=sys.stderr)
        return 1

    client = await connect(args.address, args.namespace)
    handle = client.get_workflow_handle(args.run_id)
    name = args.run_command.replace("-", "_").replace("set_lr", "set_lr_scale")
    try:
        if name == "abort":
            await handle.signal("abort", payload)
            out = {"run_id": args.run_id, "signalled": "abort"}
        else:
            out = await handle.execute_update(name, payload)
    except (WorkflowUpdateFailedError, RPCError) as exc:  # refused / run closed / unknown id
        cause = getattr(getattr(exc, "cause", None), "message", None) or str(exc)
        print(f"mainspring: cannot {args.run_command} {args.run_id}: {cause}", file=sys.stderr)
        return 1
    print(json.dumps(out, default=str))
    return 0


async def _run_watch(args: argparse.Namespace) -> int:
    from ops.client import connect
    from ops.demo import watch

    client = await connect(args.address, args.namespace)
    status = await client.get_workflow_handle(args.run_id).query("status")
    print(json.dumps(await watch(client, args.run_id, status["durable"]), default=str))
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    from storage.events import read_events

    for event in read_events(args.durable, args.run_id, tuple(args.kind or ())):
        stamp = time.strftime("%H:%M:%S", time.localtime(event["ts"]))
        print(f"{stamp} step={event['step']} {event['kind']:<20} {json.dumps(event['payload'])}")
    return 0


BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")


def benchmark_scripts() -> dict[str, str]:
    """name -> path of each scoreboard benchmark (benchmarks/*.py with a __main__, *.sh)."""
    if not os.path.isdir(BENCHMARKS):
        return {}
    found = {}
    for entry in sorted(os.listdir(BENCHMARKS)):
        name, ext = os.path.splitext(entry)
        path = os.path.join(BENCHMARKS, entry)
        if ext == ".py":
            with open(path) as f:
                if "__main__" not in f.read():  # a shared helper module, not a benchmark
                    continue
        if ext in (".py", ".sh"):
            found[name] = path
    return found


def cmd_bench(args: argparse.Namespace) -> int:
    """`mainspring bench` lists the benchmarks; `mainspring bench NAME [ARGS]` runs one
    (each prints one JSON line with its figure and inputs)."""
    import subprocess

    scripts = benchmark_scripts()
    if not args.name:
        for name, path in scripts.items():
            with open(path) as f:
                doc = next((ln.strip().strip('"#').strip() for ln in f
                            if ln.strip().strip('"#').strip() and not ln.startswith("#!")), "")
            print(f"{name:<18} {doc}")
        return 0
    if args.name not in scripts:
        known = ", ".join(scripts) or f"none: no benchmarks/ next to {os.path.dirname(BENCHMARKS)}"
        raise BadConfig("bench", f"unknown benchmark {args.name!r}", f"use one of {known}")
    path = scripts[args.name]
    cmd = ["bash", path] if path.endswith(".sh") else [sys.executable, path]
    return subprocess.call([*cmd, *args.args], cwd=os.path.dirname(BENCHMARKS))


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
    # String defaults pass through `type`, so a malformed env var is an argparse error.
    worker.add_argument("--metrics-port", type=int, default=os.environ.get(PORT_ENV, "0"),
                        help="serve Prometheus /metrics here (0: off; env MAINSPRING_METRICS_PORT)")
    worker.add_argument("--temporal-metrics-port", type=int,
                        default=os.environ.get(TEMPORAL_PORT_ENV, "0"),
                        help="the Temporal SDK's worker metrics, on a port of their own "
                             "(0: off; env MAINSPRING_TEMPORAL_METRICS_PORT)")
    worker.add_argument("--drain-timeout-s", type=float, default=300.0,
                        help="on SIGTERM, how long running segments get to commit at their "
                             "current step and hand over before they are killed")
    worker.add_argument("--no-standby", action="store_true",
                        help="trainer role: keep no warm trainer launcher ready (each launch "
                             "then starts torchrun and imports torch anew)")
    node = worker.add_argument_group("node (trainer role): multi-node segments, docs/multinode.md")
    node.add_argument("--node", default=os.environ.get(NODE_ENV, ""),
                      help="this node's name: the worker announces itself to the node registry "
                           "and polls its own queue too (env MAINSPRING_NODE; default: not a node)")
    node.add_argument("--node-address", default="",
                      help="where the other nodes reach this one (default: its hostname's address)")
    node.add_argument("--rdzv-port", type=int, default=29400,
                      help="the rendezvous store's port when this node leads a segment")
    node.add_argument("--procs", type=int, default=1, help="ranks this node runs (its GPUs)")
    node.add_argument("--gpus", type=int, default=0, help="GPUs this node has (announced)")
    node.add_argument("--fast-root", default="",
                      help="this node's fast checkpoint tier (local NVMe); default the spec's "
                           "storage.fast")
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

    listing = run_sub.add_parser("list", help="runs on this Temporal namespace, newest first")
    listing.add_argument("--stage", help="e.g. needs_attention, paused, train")
    listing.add_argument("--running", action="store_true", help="only runs still running")
    listing.add_argument("--limit", type=int, default=50)
    temporal_flags(listing)
    listing.set_defaults(fn=lambda a: asyncio.run(_run_list(a)))

    watch_p = run_sub.add_parser("watch", help="print a run's progress until it ends")
    watch_p.add_argument("run_id")
    temporal_flags(watch_p)
    watch_p.set_defaults(fn=lambda a: asyncio.run(_run_watch(a)))

    operator_help = {
        "pause": "stop the running segment at its next step (with a checkpoint) and wait",
        "resume": "continue a run that is paused or in needs_attention",
        "rollback": "go back to the newest checkpoint at or before --to-step, skipping the "
                    "data the abandoned steps read",
        "set-lr": "multiply the scheduled LR by --scale from the current step",
        "abort": "stop at a checkpoint and end the run (it fails as RunAborted)"}
    for command, text in operator_help.items():
        op = run_sub.add_parser(command, help=text, description=text)
        op.add_argument("run_id")
        op.add_argument("--note", "--reason", dest="note", default="",
                        help="why (recorded in the run's operator event)")
        op.add_argument("--who", default="", help="who is acting (default: user@host)")
        if command == "rollback":
            op.add_argument("--to-step", type=int, required=True)
            op.add_argument("--keep-data", action="store_true",
                            help="replay the abandoned steps' data instead of skipping it")
        if command == "set-lr":
            op.add_argument("--scale", type=float, required=True, help="factor on the LR")
            op.add_argument("--steps", type=int, default=0, help="for this many steps (0: to the end)")
        temporal_flags(op)
        op.set_defaults(fn=lambda a: asyncio.run(_run_operator(a)))

    bench = sub.add_parser("bench", help="list the scoreboard benchmarks, or run one")
    bench.add_argument("name", nargs="?", help="e.g. resume_exact (none: list them)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    bench.set_defaults(fn=cmd_bench)

    events = sub.add_parser("events", help="print a run's event log")
    events.add_argument("run_id")
    events.add_argument("--durable", default=".mainspring/store", help="durable storage URL")
    events.add_argument("--kind", action="append")
    events.set_defaults(fn=cmd_events)

    from ops.report import register as register_report

    register_report(sub)  # mainspring report RUN_ID [--durable URL] [--out DIR]

    from ops.trace_view import register as register_trace

    register_trace(sub)  # mainspring trace RUN [--json | --perfetto FILE]; goodput RUN [--json]

    demo = sub.add_parser("demo", help="one command: services, workers, a faulted run, summary")
    demo.add_argument("--json", action="store_true", help="end with one JSON summary line")
    demo.add_argument("--address", default="", help="use this Temporal instead of embedding one")
    demo.add_argument("--state-dir", default=".mainspring")
    demo.set_defaults(fn=lambda a: asyncio.run(_demo(a)))
    return p


async def _demo(args: argparse.Namespace) -> int:
    from common import telemetry
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
