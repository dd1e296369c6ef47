"""A faulted run records no secret anywhere: not in its event log, span
files, report, Temporal history or worker logs, whatever its workers hold and its trainer
printed."""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path

import pytest

from ops.client import connect
from ops.report import build_report
from tests.e2e.runs import run_to_end, tiny_spec

pytestmark = pytest.mark.e2e

JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJtYWluc3ByaW5nLWUyZSJ9.c2lnbmF0dXJlLWZha2U"
FOUND = {"jwt": JWT, "password": "e2e-Passw0rd-in-a-url",
         "github": "ghp_E2eFakeT0kenFound1nALog000", "aws_id": "AKIAE2EFAKEKEY000001"}
# The worker's environment: other tools' credentials (a TEMPORAL_API_KEY would switch the
# workers to TLS, see ops/client.py) and a storage secret the trainer legitimately gets.
WORKER_ENV = {"HF_TOKEN": "hf_E2eFakeHuggingFaceT0ken00001",
              "WANDB_API_KEY": "wandb-e2e-fake-key-01",
              "GITHUB_TOKEN": "ghp_E2eFakeGitHubT0kenInEnv00001",
              "MAINSPRING_FAKE_API_KEY": "ms-e2e-fake-api-key-01",
              "AWS_ACCESS_KEY_ID": "mse2efakeaccess01",
              "AWS_SECRET_ACCESS_KEY": "e2e-fake-s3-secret-the-trainer-holds-01"}
SECRETS = {**FOUND, **WORKER_ENV}

# Test-only crash, on the PYTHONPATH of the fleet and so of every child: the first trainer
# launcher (torchrun) dies at interpreter start, printing what a crashing process can —
# its environment and credentials it came across. The retry runs normally.
SITECUSTOMIZE = f'''
import os, sys
marker = os.environ.get("MAINSPRING_TEST_CRASH_ONCE")
if marker and "torch.distributed.run" in sys.orig_argv and "RANK" not in os.environ:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        pass
    else:
        env = os.environ.get
        print("env HF_TOKEN=" + env("HF_TOKEN", "") + " GITHUB_TOKEN=" + env("GITHUB_TOKEN", ""))
        print("env " + env("WANDB_API_KEY", "-") + " " + env("MAINSPRING_FAKE_API_KEY", "-"))
        print("boto: signing with " + env("AWS_SECRET_ACCESS_KEY", "-"))
        print("Authorization: Bearer {JWT}")
        print("GET https://trainer:{FOUND["password"]}@example.com/corpus.txt")
        print("found {FOUND["github"]} and {FOUND["aws_id"]}", flush=True)
        os._exit(1)
'''


def _payload_text(node) -> str:
    """A history as text with every payload decoded (they are base64 JSON in the proto)."""
    if isinstance(node, dict):
        if "data" in node and "metadata" in node:
            return base64.b64decode(node["data"]).decode(errors="replace")
        return " ".join(_payload_text(v) for v in node.values())
    if isinstance(node, list):
        return " ".join(_payload_text(v) for v in node)
    return str(node)


async def _histories(address: str, run_id: str) -> str:
    client = await connect(address)
    texts = []
    async for run in client.list_workflows(f"WorkflowId = '{run_id}'"):
        history = await client.get_workflow_handle(run_id, run_id=run.run_id).fetch_history()
        texts.append(history.to_json() + _payload_text(history.to_json_dict()))
    return "\n".join(texts)


def _files_text(root, pattern: str) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(root.rglob(pattern)))


def test_faulted_run_leaves_no_secret_in_events_spans_report_history_or_logs(
        temporal_server, fleet_factory, tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    spans, store = tmp_path / "spans", tmp_path / "store"
    # the cold launch (torchrun): the launcher that crashes at interpreter start prints
    # into the segment's log, which a warm standby's import does not
    fleet_factory(env={**WORKER_ENV, "PYTHONPATH": str(hooks),
                       "MAINSPRING_TEST_CRASH_ONCE": str(tmp_path / "crashed"),
                       "MAINSPRING_SPANS_DIR": str(spans)}, args=("--no-standby",))
    spec = tiny_spec("e2e-secrets", str(store), str(tmp_path / "fast"),
                     **{"sweep.enabled": False, "train.total_steps": 10,
                        "train.segment_steps": 10, "train.checkpoint_every": 5,
                        "data.max_documents": 40})
    result = asyncio.run(run_to_end(temporal_server.address, spec, timeout_s=300))
    assert result["status"] == "completed" and os.path.exists(tmp_path / "crashed")

    history = asyncio.run(_histories(temporal_server.address, spec.run_id))
    report = build_report(spec.storage.durable, spec.run_id, str(tmp_path / "report"))
    records = {"events": _files_text(store / "runs" / spec.run_id / "events", "*.jsonl"),
               "spans": _files_text(spans, "*.jsonl"), "history": history,
               "report": Path(report["html"]).read_text(encoding="utf-8"),
               "worker logs": _files_text(tmp_path / "logs", "*.log")}
    # Not vacuous: the crash's log tail is in the fault event, scrubbed. (The worker
    # restarts a crashed launch in place, from its warm standby, so it no longer reaches the
    # history or an activity span's error; both are still searched for every secret below.)
    assert "Authorization: Bearer ***" in records["events"]
    assert '"in_place": true' in records["events"]
    assert "recovered" in records["events"] and spec.run_id in records["report"]
    leaks = {(where, name) for where, text in records.items()
             for name, secret in SECRETS.items() if secret in text}
    assert leaks == set()
