"""The `mainspring` command line (DESIGN §6): the parser, `dev`, `worker`, `bench`.

The run commands are in ops/cli_runs.py, `events` in ops/cli_events.py, `data quarantine`
in ops/cli_quarantine.py, `sweep` in ops/cli_sweep.py, what they print in
ops/cli_output.py, and the one-line errors (unknown run, unreachable server: exit 1) in
ops/cli_errors.py. A bad config exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
from typing import NoReturn

from common.errors import BadConfig
from common.metrics import PORT_ENV, TEMPORAL_PORT_ENV
from common.procs import NODE_ENV
from ops.cli_args import seconds
from ops.cli_errors import temporal_command, unreachable
from ops.client import TemporalUnreachable


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
                                standby_launcher=not args.no_standby,
                                spec_root=args.spec_root))
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
                    address=args.node_address or default_address(toward=args.address),
                    rdzv_port=args.rdzv_port,
                    procs=args.procs, gpus=args.gpus, worker=f"{args.node}-{os.getpid()}")


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


def benchmark_doc(path: str) -> str:
    """A benchmark's first line of text (its docstring's or comment's)."""
    with open(path) as f:
        return next((ln.strip().strip('"#').strip() for ln in f
                     if ln.strip().strip('"#').strip() and not ln.startswith("#!")), "")


def cmd_bench(args: argparse.Namespace) -> int:
    """`mainspring bench [--json]` lists the benchmarks; `mainspring bench NAME [ARGS]` runs
    one (each prints one JSON line with its figure and inputs)."""
    import subprocess

    from ops.cli_output import json_line

    scripts = benchmark_scripts()
    if not args.name:
        for name, path in scripts.items():
            doc = benchmark_doc(path)
            print(json_line({"name": name, "path": path, "doc": doc}) if args.json
                  else f"{name:<18} {doc}")
        return 0
    if args.name not in scripts:
        known = ", ".join(scripts) or f"none: no benchmarks/ next to {os.path.dirname(BENCHMARKS)}"
        raise BadConfig("bench", f"unknown benchmark {args.name!r}", f"use one of {known}")
    path = scripts[args.name]
    cmd = ["bash", path] if path.endswith(".sh") else [sys.executable, path]
    return subprocess.call([*cmd, *args.args], cwd=os.path.dirname(BENCHMARKS))


def build_parser() -> argparse.ArgumentParser:
    from ops import cli_runs
    from ops.client import default_address

    p = argparse.ArgumentParser(prog="mainspring",
                                description="The mainspring command line (DESIGN §6).")
    sub = p.add_subparsers(dest="command", required=True)

    def json_flag(sp: argparse.ArgumentParser, text: str) -> None:
        sp.add_argument("--json", action="store_true", help=f"for scripts: {text}")

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
    worker.add_argument("--drain-timeout-s", default=300.0,
                        type=seconds(1, "below it no segment finishes its step and hands over"),
                        help="on SIGTERM, how long running segments get to commit at their "
                             "current step and hand over before they are killed")
    worker.add_argument("--no-standby", action="store_true",
                        help="trainer role: keep no warm trainer launcher ready (each launch "
                             "then starts torchrun and imports torch anew)")
    worker.add_argument("--spec-root", default="",
                        help="orchestrator role: the directory a run spec's relative paths "
                             "are anchored at (env MAINSPRING_SPEC_ROOT; default: the "
                             "directory the worker is started in; docs/runspec.md)")
    node = worker.add_argument_group("node (trainer role): multi-node segments, docs/multinode.md")
    node.add_argument("--node", default=os.environ.get(NODE_ENV, ""),
                      help="this node's name: the worker announces itself to the node registry "
                           "and polls its own queue too (env MAINSPRING_NODE; default: not a node)")
    node.add_argument("--node-address", default="",
                      help="where the other nodes reach this one (default: its hostname's address, or "
                           "where that is loopback the address it reaches --address from)")
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
    start.set_defaults(fn=temporal_command(cli_runs.run_start, interruptible=True))
    status = run_sub.add_parser("status", help="a run's stage, step, loss and more")
    status.add_argument("run_id")
    json_flag(status, "the status as one JSON object on one line")
    temporal_flags(status)
    status.set_defaults(fn=temporal_command(cli_runs.run_status))

    listing = run_sub.add_parser("list", help="runs on this Temporal namespace, newest first")
    listing.add_argument("--stage", help="e.g. needs_attention, paused, train")
    listing.add_argument("--running", action="store_true", help="only runs still running")
    listing.add_argument("--limit", type=int, default=50)
    json_flag(listing, "one JSON object per run and line")
    temporal_flags(listing)
    listing.set_defaults(fn=temporal_command(cli_runs.run_list))

    watch_p = run_sub.add_parser("watch", help="show a run's progress until it ends")
    watch_p.add_argument("run_id")
    json_flag(watch_p, "one JSON object per progress update on stdout, then the result")
    temporal_flags(watch_p)
    watch_p.set_defaults(fn=temporal_command(cli_runs.run_watch, interruptible=True))

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
        op.set_defaults(fn=temporal_command(cli_runs.run_operator))

    bench = sub.add_parser("bench", help="list the scoreboard benchmarks, or run one")
    bench.add_argument("name", nargs="?", help="e.g. resume_exact (none: list them)")
    json_flag(bench, "the list as one JSON object per benchmark and line")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    bench.set_defaults(fn=cmd_bench)

    from ops.cli_events import register as register_events

    register_events(sub)  # mainspring events RUN [--kind K]... [--json] [--follow]

    from ops.report import register as register_report

    register_report(sub)  # mainspring report RUN_ID [--durable URL] [--out DIR]

    from ops.explain import register as register_explain

    register_explain(sub)  # mainspring explain RUN_ID [--incident N] [--json]

    from ops.cli_quarantine import register as register_data

    register_data(sub)  # mainspring data quarantine RUN [--json]

    from ops.cli_sweep import register as register_sweep

    register_sweep(sub)  # mainspring sweep RUN [--json]

    from ops.trace_view import register as register_trace

    register_trace(sub)  # mainspring trace RUN [--json | --perfetto FILE]; goodput RUN [--json]

    from ops.plan_cli import register as register_plan

    register_plan(sub)  # mainspring plan --params N --tokens T ... [--json] | --from-run RUN

    demo = sub.add_parser("demo", help="one command: services, workers, a faulted run, summary")
    demo.add_argument("--json", action="store_true", help="end with one JSON summary line")
    demo.add_argument("--address", default="", help="use this Temporal instead of embedding one")
    demo.add_argument("--state-dir", default=".mainspring")
    demo.set_defaults(fn=temporal_command(_demo))
    return p


async def _demo(args: argparse.Namespace) -> int:
    from common import telemetry
    from ops.demo import run_demo

    telemetry.configure_logging(os.environ.get("MAINSPRING_LOG_LEVEL", "warning"))
    return await run_demo(args.json, args.address, args.state_dir)


def main(argv: list[str] | None = None) -> int:
    """The `mainspring` command. With argv None it is this process's own command line (the
    console script, `python -m ops.cli`); callers in-process (tests) pass argv."""
    args = build_parser().parse_args(argv)
    code = _dispatch(args)
    if argv is None and getattr(args.fn, "temporal_client", False):
        exit_now(code)
    return code


def _dispatch(args: argparse.Namespace) -> int:
    try:
        return args.fn(args) or 0
    except BadConfig as exc:
        print(f"mainspring: bad config: {exc}", file=sys.stderr)
        return 2
    except TemporalUnreachable as exc:  # `worker`: no traceback either
        print(f"mainspring: {unreachable(exc.address, exc.reason)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `mainspring run list | head -1`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown, after a command that was a Temporal client:
    the SDK's Rust threads may still call into Python while it finalizes, and the process
    then aborts ("Fatal Python error: PyGILState_Release", exit -6) after a command that
    worked — about one `run set-lr` in six here (temporalio/sdk-python#300, open). Each
    command has flushed its spans (telemetry.flush); logs and stdio are flushed here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, a closed stream
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
