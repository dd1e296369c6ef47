"""Secrets stay out of children and records: common/redact.py, the child
environment allow-list, and every place a failure, event or span is written."""

from __future__ import annotations

import json
import os
import sys

import pytest
from opentelemetry.trace import Status, StatusCode
from temporalio.exceptions import ApplicationError
from temporalio.service import TLSConfig

from activities.errors import classified, to_application_error
from activities.supervise import child_env, supervise
from common import telemetry
from common.errors import BadConfig, HardwareFault, StorageUnavailable
from common.procs import FORCED_CHILD_ENV, allowed_env
from common.redact import MASK, is_secret_name, redact, redact_value
from ops.client import tls_config
from storage.checkpoints import CheckpointStore
from storage.events import EventLog, read_events
from storage.tiered import TieredCheckpointer, TierPolicy
from tests.common.proc_environ import environ_of

JWT = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fw"
AWS_ID, AWS_SECRET = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
GH, HF = "ghp_R2d2C3poLuke0Leia1Han2Solo3Chewie4x", "hf_QwErTyUiOpAsDfGhJkLzXcVbNm12345678"
# A worker's secrets: Temporal's, and other tools' that happen to be in its environment.
WORKER_SECRETS = {"TEMPORAL_API_KEY": "tmprl-fake-key-Zx81Qa77", "HF_TOKEN": HF,
                  "WANDB_API_KEY": "wandb-fake-0123456789abcdef", "GITHUB_TOKEN": GH,
                  "MAINSPRING_FAKE_API_KEY": "ms-fake-api-key-9f8e7d"}
# What a trainer needs: storage credentials, build and threading settings, our own knobs.
TRAINER_NEEDS = {"AWS_SECRET_ACCESS_KEY": "s3-secret-for-the-trainer-0123456789abcd",
                 "AWS_ACCESS_KEY_ID": "msaccess0123456789", "AWS_ENDPOINT_URL": "http://s3:9",
                 "MAINSPRING_S3_ENDPOINT": "http://s3:9", "TORCH_EXTENSIONS_DIR": "/tmp/ext",
                 "OMP_NUM_THREADS": "2", "CXX": "g++", "NCCL_DEBUG": "WARN",
                 "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "UCX_TLS": "rc,cuda_copy",
                 "AWS_ENDPOINT_URL_S3": "http://s3:9",
                 "LC_ALL": "C.UTF-8", "TRACEPARENT": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}


def test_redact_masks_url_userinfo_keeping_scheme_and_host():
    assert redact("s3://AKIA:pw@bucket/x/*.txt") == "s3://***@bucket/x/*.txt"
    assert (redact("corpus https://user:hunter2xx@example.com/a.jsonl failed")
            == "corpus https://***@example.com/a.jsonl failed")


@pytest.mark.parametrize("text, expected", [
    ("password=hunter2xx step=40", "password=*** step=40"),
    ('{"api_key": "abc def ghi", "step": 40}', '{"api_key": "***", "step": 40}'),
    ("aws_secret_access_key: abc/def+ghi", "aws_secret_access_key: ***"),
    ("Authorization: Bearer abcdefgh12345678", "Authorization: Bearer ***"),
    ("curl -H 'Authorization: Basic dXNlcjpwYXNz'", "curl -H 'Authorization: Basic ***'"),
    ("mainspring worker --api-key sekrit123 --role trainer",
     "mainspring worker --api-key *** --role trainer"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Signature=abc123&X-Amz-Credential=AKID%2F2024&v=2",
     "https://b.s3.amazonaws.com/k?X-Amz-Signature=***&X-Amz-Credential=***&v=2"),
    ("export GITHUB_TOKEN=abcdefgh12", "export GITHUB_TOKEN=***"),
    # a secret pair inside the value of an ordinary key
    ("leaked: password=hunter2xx", "leaked: password=***"),
    ('note: "token=abcdefgh12 ok"', 'note: "token=*** ok"'),
])
def test_redact_masks_values_after_secret_named_keys(text, expected):
    assert redact(text, environ={}) == expected


def test_redact_masks_well_known_token_shapes():
    text = f"id {AWS_ID} {AWS_SECRET} | jwt {JWT} | {GH} {HF} sk-proj-AbCdEf0123456789GhIjKl"
    out = redact(text, environ={})
    for secret in (AWS_ID, AWS_SECRET, JWT, GH, HF, "sk-proj-AbCdEf0123456789GhIjKl"):
        assert secret not in out
    assert out == f"id {MASK} | jwt {MASK} | {MASK} {MASK} {MASK}"
    assert redact("slack xoxb-1234567890-AbCdEfGh", environ={}) == "slack ***"


def test_redact_masks_values_of_secret_named_environment_variables_anywhere():
    env = {"WANDB_API_KEY": "plainvalue0123", "MY_SERVICE_PASSWORD": "tr0ub4dor&3",
           "SHORT_TOKEN": "abc", "AWS_SHARED_CREDENTIALS_FILE": "/etc/aws/credentials",
           "AWS_ACCESS_KEY_ID": "mainspring"}
    text = ("login plainvalue0123 with tr0ub4dor&3; abc; read /etc/aws/credentials; "
            "s3://mainspring/runs")
    assert redact(text, environ=env) == ("login *** with ***; abc; read /etc/aws/credentials; "
                                         "s3://mainspring/runs")


ORDINARY = [
    ('{"event": "checkpoint_committed", "level": "info", "step": 40, "uri": '
     '"s3://mainspring/e2e/runs/r1/checkpoints/step-000000040", "bytes": 1048576}'),
    "sha256 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 ok",
    "commit 2fd4e1c67a2d28fced849ee1bb76e7391b93eb12 (a 40-hex sha1 is not an AWS secret)",
    "file:///tmp/pytest-of-root/pytest-1/store/runs/e2e-kill-s3/events/supervisor-12-000001.jsonl",
    ('{"flops_per_token": 123456, "tokens_consumed": 20480, "train_tokens": 9000, '
     '"trace_id": "0af7651916cd43dd8448eb211c80319c", "token_dtype": "uint16"}'),
    "trainer killed by SIGKILL; last output: step=40 loss=3.2100 lr=3e-4 attempt=2",
    "run sk-e2e-run-abcdefghijklmnopqrstu and cache /data/hf_cache_directory_for_tests/x",
    "Temporal gRPC: 127.0.0.1:7233 at 12:30:01, start_new_session=True, session: 3",
    "stdlib:json/*.py TOKENIZERS_PARALLELISM=false author=Ada",
    '  File "/work/main/trainer/segment.py", line 307, in main',
]


@pytest.mark.parametrize("line", ORDINARY)
def test_redact_leaves_ordinary_records_unchanged(line):
    assert redact(line, environ={}) == line


def test_is_secret_name_matches_credentials_not_lookalikes():
    secret = ["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "WANDB_API_KEY",
              "accessKeyId", "X-Amz-Signature", "Authorization", "db_password", "clientSecret",
              "TEMPORAL_API_KEY", "x-api-key", "oauth_token", "PGPASSWORD"]
    ordinary = ["tokens_consumed", "token_dtype", "TOKENIZERS_PARALLELISM", "GIT_AUTHOR_NAME",
                "SSH_AUTH_SOCK", "AWS_SHARED_CREDENTIALS_FILE", "XDG_SESSION_TYPE",
                "content_hash", "key", "flops_per_token_id", "TEMPORAL_TLS_KEY"]
    assert [n for n in secret if not is_secret_name(n)] == []
    assert [n for n in ordinary if is_secret_name(n)] == []


def test_redact_value_scrubs_nested_payloads_and_masks_strings_under_secret_keys():
    payload = {"corpus": "s3://u:p@b/x", "step": 3, "ok": True, "loss": 2.5,
               "args": ["--token", "abcdefgh12"], "nested": {"api_key": "x y", "n": [1, 2.0]},
               "windows": ((0, 5),), "session_token": None}
    assert redact_value(payload, environ={}) == {
        "corpus": "s3://***@b/x", "step": 3, "ok": True, "loss": 2.5,
        "args": ["--token", "abcdefgh12"],  # a lone list item has no key to judge it by
        "nested": {"api_key": MASK, "n": [1, 2.0]}, "windows": ((0, 5),),
        "session_token": None}


def test_child_env_keeps_what_trainers_need_and_drops_temporal_and_other_secrets(monkeypatch):
    env = {**WORKER_SECRETS, **TRAINER_NEEDS, "TEMPORAL_TLS_KEY": "/etc/t/key.pem",
           "TEMPORAL_ADDRESS": "t:7233", "OTEL_EXPORTER_OTLP_HEADERS": "x-team=abc",
           "PATH": "/usr/bin", "HOME": "/root", "SOME_TOOL_CONFIG": "x"}
    kept = allowed_env(env)
    assert kept == {**TRAINER_NEEDS, "PATH": "/usr/bin", "HOME": "/root", **FORCED_CHILD_ENV}
    for name, value in {**WORKER_SECRETS, **TRAINER_NEEDS}.items():
        monkeypatch.setenv(name, value)
    built = child_env({"MAINSPRING_WORKER_PID": "7"})
    assert not set(WORKER_SECRETS) & set(built)
    assert built["PYTHONPATH"].split(os.pathsep)[0] == os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert built["MAINSPRING_WORKER_PID"] == "7" and built["DS_ACCELERATOR"]


def _python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


@pytest.mark.process
def test_supervised_child_inherits_no_worker_secrets(tmp_path, monkeypatch):
    for name, value in {**WORKER_SECRETS, **TRAINER_NEEDS}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "env.json"
    supervise(_python("import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))",
                      str(out)), workdir=str(tmp_path / "w"), env=child_env(), poll_s=0.05)
    seen = json.loads(out.read_text())
    assert {k for k in WORKER_SECRETS if k in seen} == set()
    assert {k: seen.get(k) for k in TRAINER_NEEDS} == TRAINER_NEEDS


# What a crashing child prints: secrets it holds (the S3 key), found ones, its argv.
CRASH = f"""import os, sys
print("boto: signing with", os.environ["AWS_SECRET_ACCESS_KEY"])
print("Authorization: Bearer {JWT}")
print("GET s3://{AWS_ID}:{AWS_SECRET.replace('/', '_')}@bucket/corpus.txt")
print("config api_key={GH} hf={HF}")
print("step=40 loss=3.2100")
sys.exit(1)
"""
PRINTED = (TRAINER_NEEDS["AWS_SECRET_ACCESS_KEY"], JWT, AWS_ID, AWS_SECRET.replace("/", "_"),
           GH, HF)


@pytest.mark.process
def test_hardware_fault_message_scrubs_secrets_the_child_printed(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TRAINER_NEEDS["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(HardwareFault) as info:
        supervise(_python(CRASH), workdir=str(tmp_path), env=child_env(), poll_s=0.05)
    failure = to_application_error(info.value)
    recorded = json.dumps([info.value.message, failure.message, list(failure.details)])
    assert [s for s in PRINTED if s in recorded] == []
    assert "step=40 loss=3.2100" in info.value.message  # the evidence itself stays


@pytest.mark.process
def test_error_json_message_is_scrubbed_before_it_becomes_a_failure(tmp_path):
    code = ("import json; json.dump({'type': 'BadData', 'message': 'cannot read "
            "https://u:hunter2xx@h/c.txt?token=abcdefgh12'}, open('error.json', 'w')); exit(3)")
    with pytest.raises(ApplicationError) as info:
        supervise(_python(code), workdir=str(tmp_path), env=child_env(), poll_s=0.05)
    assert info.value.type == "BadData" and info.value.non_retryable
    text = info.value.message + json.dumps(info.value.details)
    assert "hunter2xx" not in text and "abcdefgh12" not in text and "https://***@h" in text


def test_activity_failures_reach_temporal_scrubbed_classified_or_not():
    @classified
    def storage_down() -> None:
        raise StorageUnavailable(f"s3://{AWS_ID}:pw12345678@b", f"denied for {GH}")

    @classified
    def crashed() -> None:
        raise RuntimeError(f"KeyError talking to https://u:hunter2xx@h with {HF}")

    for fn, kind in ((storage_down, "StorageUnavailable"), (crashed, "RuntimeError")):
        with pytest.raises(ApplicationError) as info:
            fn()
        err = info.value
        text = err.message + json.dumps(list(err.details))
        assert err.type == kind and not err.non_retryable
        assert not any(s in text for s in (AWS_ID, "pw12345678", GH, "hunter2xx", HF)), text
        # Temporal records the cause chain too: none is left to carry the raw message.
        assert err.__cause__ is None and err.__suppress_context__


def test_event_log_record_scrubs_payload_before_writing(tmp_path):
    url = f"file://{tmp_path}/store"
    with EventLog(url, "r1", "data") as events:
        back = events.emit("dataprep_started", corpus=f"s3://{AWS_ID}:pw12345678@b/*.txt",
                           note=f"operator pasted {GH}", step_count=3)
    stored = read_events(url, "r1")
    assert stored[0]["payload"] == back["payload"] == {
        "corpus": "s3://***@b/*.txt", "note": "operator pasted ***", "step_count": 3}


def test_report_of_a_log_written_before_redaction_shows_no_secret(tmp_path):
    from ops.report import build_report

    events = tmp_path / "store" / "runs" / "r1" / "events"
    events.mkdir(parents=True)
    raw = [{"event_id": "f1", "run_id": "r1", "kind": "fault", "ts": 1.0, "step": 5,
            "attempt": 1, "trace_id": "", "writer": "old",
            "payload": {"kind": "HardwareFault", "evidence": f"last output: token={GH}"}},
           {"event_id": "o1", "run_id": "r1", "kind": "operator", "ts": 2.0, "step": 6,
            "attempt": 1, "trace_id": "", "writer": "old",
            "payload": {"command": "pause", "who": "ada", "note": f"key {HF}"}}]
    (events / "old-000000.jsonl").write_text("".join(json.dumps(e) + "\n" for e in raw))
    paths = build_report(f"file://{tmp_path}/store", "r1", str(tmp_path / "out"))
    with open(paths["html"], encoding="utf-8") as f:
        page = f.read()
    assert GH not in page and HF not in page and "HardwareFault" in page


def test_span_files_hold_no_secrets_from_attributes_events_or_status(tmp_path, monkeypatch):
    monkeypatch.setattr(telemetry, "_configured", True)  # keep the global provider as it is
    provider = telemetry.configure("unit", spans_dir=str(tmp_path))
    with provider.get_tracer("t").start_as_current_span(f"GET {HF}") as span:
        span.set_attribute("url", f"https://u:hunter2xx@h/x?token={GH}")
        span.set_attribute("api_key", "abcdefgh12")
        span.record_exception(HardwareFault(f"last output: Authorization: Bearer {JWT}"))
        span.set_status(Status(StatusCode.ERROR, f"failed with {AWS_ID}"))
    provider.force_flush()
    (path,) = tmp_path.glob("unit-*.jsonl")
    text = path.read_text()
    assert not any(s in text for s in (HF, "hunter2xx", GH, "abcdefgh12", JWT, AWS_ID)), text
    assert "https://***@h/x" in text and "hardware fault" in text


@pytest.mark.process
def test_checkpoint_writer_process_gets_the_allow_listed_environment(tmp_path, monkeypatch):
    for name, value in {**WORKER_SECRETS, **TRAINER_NEEDS}.items():
        monkeypatch.setenv(name, value)
    ckpt = TieredCheckpointer(CheckpointStore(f"file://{tmp_path}/store", "r"),
                              CheckpointStore(str(tmp_path / "fast"), "r"), TierPolicy())
    try:
        names = set(environ_of(ckpt.writer_pid))
    finally:
        ckpt.close()
    assert not set(WORKER_SECRETS) & names
    assert {"AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "MAINSPRING_S3_ENDPOINT"} <= names


def _pem(tmp_path, name: str) -> str:
    path = tmp_path / name
    path.write_bytes(f"-----BEGIN {name}-----\n".encode())
    return str(path)


def test_tls_config_builds_mtls_ca_and_server_name_from_the_environment(tmp_path):
    env = {"TEMPORAL_TLS_CERT": _pem(tmp_path, "cert"), "TEMPORAL_TLS_KEY": _pem(tmp_path, "key"),
           "TEMPORAL_TLS_CA": _pem(tmp_path, "ca"), "TEMPORAL_TLS_SERVER_NAME": "t.example"}
    assert tls_config(env) == TLSConfig(client_cert=b"-----BEGIN cert-----\n",
                                        client_private_key=b"-----BEGIN key-----\n",
                                        server_root_ca_cert=b"-----BEGIN ca-----\n",
                                        domain="t.example")
    # the Temporal CLI's variable names work too
    assert tls_config({"TEMPORAL_TLS_CA_PATH": env["TEMPORAL_TLS_CA"]}) == TLSConfig(
        server_root_ca_cert=b"-----BEGIN ca-----\n")
    assert tls_config({}) is False
    assert tls_config({"TEMPORAL_API_KEY": "k"}) is True and tls_config({"TEMPORAL_TLS": "1"})


def test_tls_config_refuses_a_client_cert_without_its_key_naming_the_variable(tmp_path):
    with pytest.raises(BadConfig) as info:
        tls_config({"TEMPORAL_TLS_CERT": _pem(tmp_path, "cert")})
    assert info.value.field == "TEMPORAL_TLS_CERT" and "TEMPORAL_TLS_KEY" in info.value.fix
    with pytest.raises(BadConfig) as info:
        tls_config({"TEMPORAL_TLS_CA": str(tmp_path / "missing.pem")})
    assert info.value.field == "TEMPORAL_TLS_CA"
