"""`mainspring run start|status|list|watch` and the operator commands (pause, resume,
rollback, set-lr, abort): the CLI's Temporal client side (DESIGN §6).

Each command runs under ops/cli_errors.temporal_command: an unknown run, an unknown
namespace or a server that does not answer is one line on stderr and exit 1. On stdout:
JSON for scripts (`--json`: one object per line), a table when it is a terminal.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from activities.contracts import WORKFLOW_TYPE
from common.errors import BadConfig
from ops.cli_errors import UnknownNamespace, describe_run, not_found
from ops.cli_output import is_terminal, json_line, print_status, print_table

if TYPE_CHECKING:
    from spec import RunSpec

# A query needs a worker to answer it (a closed run's, to replay it): with none up, say so
# after this long rather than hang (the status shows query_error).
QUERY_TIMEOUT = timedelta(seconds=20)


def load_spec(args: argparse.Namespace) -> RunSpec:
    """The RunSpec of `run start`: --spec FILE or --preset NAME, with --set KEY=VALUE."""
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


async def run_start(args: argparse.Namespace) -> int:
    from common import telemetry
    from ops.client import localize
    from storage.runs import check_claim

    spec = localize(load_spec(args))
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
                      "run": handle.result_run_id}), flush=True)
    if args.wait:
        args.run_id = spec.run_id  # for the one-line error should the run fail (cli_errors)
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


async def run_list(args: argparse.Namespace) -> int:
    from temporalio.service import RPCError, RPCStatusCode

    from ops.client import connect

    client = await connect(args.address, args.namespace)
    rows = []
    try:
        async for wf in client.list_workflows(list_query(args.stage, args.running),
                                              limit=args.limit):
            attrs = wf.typed_search_attributes
            row = {"run_id": wf.id, "status": wf.status.name if wf.status else None,
                   "started": wf.start_time.isoformat(timespec="seconds")}
            for key in ("MainspringStage", "MainspringStep", "MainspringLoss"):
                value = next((p.value for p in attrs if p.key.name == key), None)
                row[key.removeprefix("Mainspring").lower()] = value
            rows.append(row)
            if args.json or not is_terminal(sys.stdout):  # a script reads them as they come
                print(json_line(row), flush=True)
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            missing = await not_found(client)
            if isinstance(missing, UnknownNamespace):
                raise missing from None
        raise
    if not args.json and is_terminal(sys.stdout):
        print_table(rows, sys.stdout)
    return 0


async def run_status(args: argparse.Namespace) -> int:
    from temporalio.exceptions import TemporalError

    from ops.client import connect

    client = await connect(args.address, args.namespace)
    desc = await describe_run(client, args.run_id)
    out = {"run_id": args.run_id, "workflow_status": desc.status.name if desc.status else None}
    try:
        out.update(await client.get_workflow_handle(args.run_id).query(
            "status", rpc_timeout=QUERY_TIMEOUT))
    except TemporalError as exc:  # a closed run with no worker to replay it answers none
        out["query_error"] = str(exc)
    if args.json:
        print(json_line(out))
    elif is_terminal(sys.stdout):
        print_status(out, sys.stdout)
    else:
        print(json.dumps(out, default=str, indent=1))
    return 0


async def run_watch(args: argparse.Namespace) -> int:
    from temporalio.client import WorkflowExecutionStatus

    from ops.client import connect
    from ops.demo import watch

    client = await connect(args.address, args.namespace)
    desc = await describe_run(client, args.run_id)
    handle = client.get_workflow_handle(args.run_id)
    if desc.status == WorkflowExecutionStatus.RUNNING:
        status = await handle.query("status", rpc_timeout=QUERY_TIMEOUT)
        out = sys.stdout if args.json else sys.stderr  # plain/rich progress beside the result
        result = await watch(client, args.run_id, status["durable"], out=out,
                             as_json=args.json)
    else:  # ended: nothing to watch (and maybe no worker to answer a query)
        result = await handle.result()  # or WorkflowFailureError, ops/cli_errors.py's line
        result = result if isinstance(result, dict) else result.__dict__
    print(json_line({"kind": "result", **result}) if args.json
          else json.dumps(result, default=str))
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
    (common/commands.py) as sent. Its own fields are checked here (Refused)."""
    from common.commands import Abort, Pause, Resume, Rollback, SetLrScale

    who, note = args.who or operator_identity(), args.note
    if args.run_command == "rollback":
        cmd = Rollback(to_step=args.to_step, skip_data=not args.keep_data, who=who, note=note)
    elif args.run_command == "set-lr":
        cmd = SetLrScale(scale=args.scale, steps=args.steps, who=who, note=note)
    else:
        cmd = {"pause": Pause, "resume": Resume, "abort": Abort}[args.run_command](
            who=who, note=note)
    return cmd.to_dict()


async def run_operator(args: argparse.Namespace) -> int:
    """pause | resume | rollback | set-lr (Temporal updates, validated: a refusal says why)
    and abort (a signal)."""
    from temporalio.client import WorkflowExecutionStatus, WorkflowUpdateFailedError
    from temporalio.service import RPCError, RPCStatusCode

    from common.commands import Refused
    from ops.client import connect

    try:
        payload = operator_payload(args)
    except Refused as exc:  # the command's own fields: refused before it is sent
        print(f"mainspring: cannot {args.run_command} {args.run_id}: {exc}", file=sys.stderr)
        return 1

    client = await connect(args.address, args.namespace)
    desc = await describe_run(client, args.run_id)
    if desc.status != WorkflowExecutionStatus.RUNNING:
        return _closed(args, desc.status)
    handle = client.get_workflow_handle(args.run_id)
    name = args.run_command.replace("-", "_").replace("set_lr", "set_lr_scale")
    try:
        if name == "abort":
            await handle.signal("abort", payload)
            out = {"run_id": args.run_id, "signalled": "abort"}
        else:
            out = await handle.execute_update(name, payload)
    except WorkflowUpdateFailedError as exc:  # refused by the validator, or the run failed it
        cause = getattr(exc.cause, "message", None) or str(exc)
        print(f"mainspring: cannot {args.run_command} {args.run_id}: {cause}", file=sys.stderr)
        return 1
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:  # "workflow execution already completed"
            raise
        return _closed(args, (await handle.describe()).status)  # it ended meanwhile
    print(json_line(out))
    return 0


def _closed(args: argparse.Namespace, status) -> int:
    state = status.name.lower().replace("_", " ") if status else "closed"
    print(f"mainspring: cannot {args.run_command} {args.run_id}: the run is {state} — "
          "operator commands reach a running run; a failed, aborted or terminated one "
          "continues when started again with the same spec ('mainspring run start')",
          file=sys.stderr)
    return 1
