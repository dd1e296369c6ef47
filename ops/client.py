"""Temporal client connection and run start/status helpers shared by the CLI, demo and tests."""

from __future__ import annotations

import os
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from temporalio.contrib.opentelemetry import OpenTelemetryPlugin

from activities.contracts import ORCHESTRATOR_QUEUE, WORKFLOW_TYPE
from ops.spec import RunSpec
from storage.fs import normalize_url

DEFAULT_ADDRESS = "127.0.0.1:7233"


def default_address() -> str:
    return os.environ.get("TEMPORAL_ADDRESS", DEFAULT_ADDRESS)


async def connect(address: str = "", namespace: str = "") -> Client:
    """Connect with tracing. TLS / Temporal Cloud: TEMPORAL_API_KEY (+ TEMPORAL_TLS=1)."""
    api_key = os.environ.get("TEMPORAL_API_KEY") or None
    tls = bool(api_key) or os.environ.get("TEMPORAL_TLS", "") in ("1", "true")
    return await Client.connect(address or default_address(),
                                namespace=namespace or os.environ.get("TEMPORAL_NAMESPACE", "default"),
                                api_key=api_key, tls=tls,
                                plugins=[OpenTelemetryPlugin(add_temporal_spans=True)])


def localize(spec: RunSpec) -> RunSpec:
    """Relative storage paths become absolute, so workers in other directories agree."""
    return spec.replace(**{"storage.durable": normalize_url(spec.storage.durable),
                           "storage.fast": os.path.abspath(spec.storage.fast)})


async def start_run(client: Client, spec: RunSpec) -> WorkflowHandle[Any, Any]:
    """Start TrainingRun with workflow id = run id and the run-id search attribute."""
    attrs = TypedSearchAttributes([SearchAttributePair(
        SearchAttributeKey.for_keyword("MainspringRunId"), spec.run_id)])
    return await client.start_workflow(WORKFLOW_TYPE, spec.to_dict(), id=spec.run_id,
                                       task_queue=ORCHESTRATOR_QUEUE, search_attributes=attrs)
