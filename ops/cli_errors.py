"""One line on stderr, exit 1, no traceback, for what a person can fix:
an unknown run id or namespace, a Temporal server that does not answer, a run that ended
while it was watched. Each line names the problem and the fix.

Only these exceptions are mapped (TemporalUnreachable from ops/client.py, the SDK's
RPCError by status, WorkflowFailureError); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable

from temporalio.client import Client, WorkflowExecutionDescription, WorkflowFailureError
from temporalio.service import RPCError, RPCStatusCode

from activities.contracts import WORKFLOW_TYPE
from ops.client import TemporalUnreachable, default_address


class UnknownRun(Exception):
    """No TrainingRun has this workflow id on the namespace (`other_type`: the workflow
    that has it, when it is not a run)."""

    def __init__(self, run_id: str, namespace: str, other_type: str = "") -> None:
        self.run_id, self.namespace, self.other_type = run_id, namespace, other_type
        super().__init__(f"no run {run_id!r} on namespace {namespace}")


class UnknownNamespace(Exception):
    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        super().__init__(f"no namespace {namespace!r}")


MAPPED = (TemporalUnreachable, UnknownRun, UnknownNamespace, RPCError, WorkflowFailureError)

# What to do about a refusal by status; UNAVAILABLE is TemporalUnreachable's line.
RPC_FIXES = {
    RPCStatusCode.UNAUTHENTICATED: "check TEMPORAL_API_KEY and the TLS settings "
                                   "(docs/security.md)",
    RPCStatusCode.PERMISSION_DENIED: "check that this API key or certificate may use the "
                                     "namespace (docs/security.md)",
    RPCStatusCode.DEADLINE_EXCEEDED: "check that the run's workers are up ('mainspring worker "
                                     "--role orchestrator'), then try again",
    RPCStatusCode.RESOURCE_EXHAUSTED: "the server is rate-limiting: try again shortly",
}


async def describe_run(client: Client, run_id: str) -> WorkflowExecutionDescription:
    """The run's workflow (the newest execution of its id); UnknownRun / UnknownNamespace
    when there is none."""
    try:
        desc = await client.get_workflow_handle(run_id).describe()
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            raise
        raise await not_found(client, run_id) from None
    if desc.workflow_type != WORKFLOW_TYPE:
        raise UnknownRun(run_id, client.namespace, desc.workflow_type)
    return desc


async def not_found(client: Client, run_id: str = "") -> Exception:
    """A NOT_FOUND answer, told apart: the namespace is missing, or (it is there) the run."""
    from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest

    try:
        await client.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace=client.namespace))
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return UnknownNamespace(client.namespace)
        raise
    return UnknownRun(run_id, client.namespace)


def explain(exc: BaseException, args: argparse.Namespace) -> str:
    """Pure: the one line (without the `mainspring: ` prefix) for a mapped exception."""
    address = getattr(args, "address", "") or default_address()
    if isinstance(exc, TemporalUnreachable):
        return unreachable(exc.address, exc.reason)
    if isinstance(exc, UnknownRun):
        what = f" (it is a {exc.other_type} workflow, not a run)" if exc.other_type else ""
        return (f"no run {exc.run_id!r} on namespace {exc.namespace} at {address}{what} — "
                "list runs with 'mainspring run list' (or pass the --address and --namespace "
                "it runs on)")
    if isinstance(exc, UnknownNamespace):
        return (f"no namespace {exc.namespace!r} at {address} — pass --namespace (the dev "
                f"server has 'default'), or create it with 'temporal operator namespace "
                f"create --namespace {exc.namespace} --address {address}'")
    if isinstance(exc, WorkflowFailureError):
        run_id = getattr(args, "run_id", "") or "RUN"
        cause = exc.cause if exc.cause is not None else exc
        return (f"run {run_id!r} ended without completing: {_flat(str(cause))} — see why with "
                f"'mainspring events {run_id} --kind fault' or 'mainspring report {run_id}'; "
                "a failed, aborted or terminated run continues when started again with the "
                "same spec")
    if isinstance(exc, RPCError):
        if exc.status == RPCStatusCode.UNAVAILABLE:
            return unreachable(address, _flat(exc.message))
        fix = RPC_FIXES.get(exc.status, "see the Temporal server's log")
        status = exc.status.name if exc.status is not None else "unknown status"
        return (f"the Temporal server at {address} refused the call: {_flat(exc.message)} "
                f"({status}) — {fix}")
    raise TypeError(f"not a mapped CLI error: {type(exc).__name__}")  # MAPPED says which


def unreachable(address: str, reason: str) -> str:
    return (f"cannot reach the Temporal server at {address} ({reason}) — start one with "
            "'mainspring dev' or pass --address (or set TEMPORAL_ADDRESS)")


def _flat(text: str, limit: int = 300) -> str:
    """One line: newlines folded, cut at `limit` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def temporal_command(run: Callable[[argparse.Namespace], Awaitable[int]], *,
                     interruptible: bool = False) -> Callable[[argparse.Namespace], int]:
    """`run(args)` on an event loop; a MAPPED failure is one line on stderr and exit 1.
    `interruptible`: Ctrl-C only stops the watching (exit 0); the run goes on."""
    def command(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(run(args))
        except MAPPED as exc:
            print(f"mainspring: {explain(exc, args)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            if not interruptible:
                raise
            print("mainspring: stopped watching; the run goes on", file=sys.stderr)
            return 0
    command.temporal_client = True  # type: ignore[attr-defined]  # ops/cli.py:exit_now
    return command
