"""Temporal client connection and run start/status helpers shared by the CLI, demo and tests."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.common import (
    SearchAttributeKey,
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDReusePolicy,
)
from temporalio.contrib.opentelemetry import OpenTelemetryPlugin
from temporalio.service import TLSConfig

from activities.contracts import ORCHESTRATOR_QUEUE, WORKFLOW_TYPE
from common.errors import BadConfig
from spec import RunSpec
from spec.paths import anchor
from spec.summary import static_details, static_summary

DEFAULT_ADDRESS = "127.0.0.1:7233"
# Temporal CLI: --id-reuse-policy AllowDuplicateFailedOnly (README, "From the Temporal CLI")
ID_REUSE_POLICY = WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY


def default_address() -> str:
    return os.environ.get("TEMPORAL_ADDRESS", DEFAULT_ADDRESS)


# PEM files for TLS / mTLS to the Temporal frontend (docs/security.md). The `_PATH` names
# are the Temporal CLI's own, so one environment serves both.
TLS_FILES = {"client_cert": ("TEMPORAL_TLS_CERT", "TEMPORAL_TLS_CERT_PATH"),
             "client_private_key": ("TEMPORAL_TLS_KEY", "TEMPORAL_TLS_KEY_PATH"),
             "server_root_ca_cert": ("TEMPORAL_TLS_CA", "TEMPORAL_TLS_CA_PATH")}


def tls_config(environ: Mapping[str, str] | None = None) -> TLSConfig | bool:
    """TLS settings for the Temporal connection, from the environment.

    False: plaintext (the local dev server). True: TLS with the system's CA roots
    (TEMPORAL_TLS=1, or TEMPORAL_API_KEY set: an API key is never sent in the clear).
    A TLSConfig when any of TEMPORAL_TLS_CERT / _KEY (mTLS: both or neither), TEMPORAL_TLS_CA
    (a private CA) or TEMPORAL_TLS_SERVER_NAME (the name the certificate carries, when it
    is not the address's host) is set.
    """
    env = os.environ if environ is None else environ
    files = {field: _pem(env, names) for field, names in TLS_FILES.items()}
    if bool(files["client_cert"]) != bool(files["client_private_key"]):
        given = "TEMPORAL_TLS_CERT" if files["client_cert"] else "TEMPORAL_TLS_KEY"
        raise BadConfig(given, "mTLS needs a client certificate and its private key",
                        "set both TEMPORAL_TLS_CERT and TEMPORAL_TLS_KEY (PEM files), or neither")
    server_name = env.get("TEMPORAL_TLS_SERVER_NAME") or None
    if any(files.values()) or server_name:
        return TLSConfig(**files, domain=server_name)
    return bool(env.get("TEMPORAL_API_KEY")) or env.get("TEMPORAL_TLS", "") in ("1", "true")


def _pem(env: Mapping[str, str], names: tuple[str, ...]) -> bytes | None:
    name = next((n for n in names if env.get(n)), None)
    if name is None:
        return None
    try:
        with open(env[name], "rb") as f:
            return f.read()
    except OSError as exc:
        raise BadConfig(name, f"cannot read {env[name]}: {exc.strerror}",
                        "point it at a readable PEM file") from None


class TemporalUnreachable(RuntimeError):
    """Nothing answered at `address` (refused, no such host, a TLS handshake that failed):
    `cause` is the SDK's words, `reason` their gist. A RuntimeError, as the SDK's own is,
    so callers that wait for a server to come back (benchmarks/harness.py) still catch it."""

    def __init__(self, address: str, cause: str) -> None:
        self.address, self.cause, self.reason = address, cause, connect_reason(cause)
        super().__init__(f"cannot reach the Temporal server at {address}: {self.reason}")


# The SDK's bridge (temporalio 1.x) reports a failed connection as a bare RuntimeError
# "Failed client connect: <the Rust error's Debug text>"; there is no typed exception.
CONNECT_FAILED = "Failed client connect"


def connect_reason(cause: str) -> str:
    """Pure: the gist of a failed connection's Debug text ("Connection refused", "failed to
    lookup address information: …"), or the text itself, cut at 200 characters."""
    found = (re.findall(r'(?:message|error): "([^"]+)"', cause)
             or re.findall(r'ConnectError\("([^"]+)"', cause))
    text = found[-1] if found else cause.removeprefix(CONNECT_FAILED).lstrip(": ")
    return " ".join(text.split())[:200]


async def connect(address: str = "", namespace: str = "") -> Client:
    """Connect with tracing. TLS, mTLS, Temporal Cloud: `tls_config` and TEMPORAL_API_KEY.

    Raises TemporalUnreachable when nothing answers, BadConfig for an address that is no
    host:port."""
    address = address or default_address()
    api_key = os.environ.get("TEMPORAL_API_KEY") or None
    try:
        return await Client.connect(address,
                                    namespace=namespace or os.environ.get("TEMPORAL_NAMESPACE",
                                                                          "default"),
                                    api_key=api_key, tls=tls_config(),
                                    plugins=[OpenTelemetryPlugin(add_temporal_spans=True)])
    except RuntimeError as exc:
        if not str(exc).startswith(CONNECT_FAILED):
            raise
        raise TemporalUnreachable(address, str(exc)) from exc
    except ValueError as exc:  # the SDK parses the target before connecting
        if "invalid target" not in str(exc):
            raise
        raise BadConfig("--address", f"{address!r} is not a Temporal frontend address ({exc})",
                        "give host:port, e.g. 127.0.0.1:7233 (or set TEMPORAL_ADDRESS)") from None


def localize(spec: RunSpec) -> RunSpec:
    """Relative paths (storage, corpus, tokenizer, fault files) become absolute under this
    directory and `~/` this user's home, so every worker and child agrees (spec/paths.py)."""
    return anchor(spec, os.getcwd(), home=os.path.expanduser("~"))


async def start_run(client: Client, spec: RunSpec) -> WorkflowHandle[Any, Any]:
    """Start TrainingRun with workflow id = run id, the run-id search attribute and the
    static summary and details the Web UI lists (spec/summary.py).

    A failed, aborted or terminated run can be started again with its id (to resume it,
    with the same spec: storage/runs.py); a running or completed one is refused by Temporal
    (WorkflowAlreadyStartedError), as a different spec is refused by the run's claim.
    """
    attrs = TypedSearchAttributes([SearchAttributePair(
        SearchAttributeKey.for_keyword("MainspringRunId"), spec.run_id)])
    return await client.start_workflow(WORKFLOW_TYPE, spec.to_dict(), id=spec.run_id,
                                       task_queue=ORCHESTRATOR_QUEUE, search_attributes=attrs,
                                       id_reuse_policy=ID_REUSE_POLICY,
                                       static_summary=static_summary(spec),
                                       static_details=static_details(spec))
