"""Storage URLs in a RunSpec are checked when it is validated (common/urls.py)."""

import pytest

from common.errors import BadConfig
from spec import PRESETS, RunSpec, deep_merge, dotted_to_nested
from storage.fs import resolve


def _spec(**dotted) -> RunSpec:
    return RunSpec.from_dict(deep_merge(PRESETS["demo"], dotted_to_nested(dotted)))


def _error(**dotted) -> BadConfig:
    with pytest.raises(BadConfig) as info:
        _spec(**dotted)
    return info.value


@pytest.mark.parametrize("url", [
    "s3://", "s3:///x", "s3://Bad_Bucket/x", "s3://ab/x", "s3://bucket..name/x",
    "s3://192.168.1.10/x", "s3://bucket/a//b", "s3://bucket/../x", "s3:bucket/x",
    "nosuch://x", "http://store.example.com/x", "https://s3.amazonaws.com/bucket",
    "   ", " /data/store", "file://host/data", "file://relative", "memory://", "a::b",
    "/data/\x00store", "gs://bucket/x"])
def test_bad_durable_urls_are_refused_naming_the_field(url):
    err = _error(**{"storage.durable": url})
    assert err.field == "storage.durable" and err.fix


def test_durable_urls_accepted_are_exactly_the_four_forms():
    for url in ("s3://mainspring/runs", "s3://my.bucket-01", "file:///data/x", "memory://tests",
                "relative/store", "/abs/store", "~/store"):
        assert _spec(**{"storage.durable": url}).storage.durable == url
    assert _error(**{"storage.durable": "s3://"}).field == "storage.durable"  # was ./s3:


def test_http_is_refused_with_the_s3_endpoint_as_the_fix():
    err = _error(**{"storage.durable": "http://minio:9000/bucket"})
    assert "AWS_ENDPOINT_URL" in err.fix and "s3://" in err.fix


@pytest.mark.parametrize("url", ["s3://bucket/fast", "file:///tmp/fast", "s3:x"])
def test_fast_tier_must_be_a_local_path(url):
    assert _error(**{"storage.fast": url}).field == "storage.fast"


@pytest.mark.parametrize("field,url", [
    ("data.corpus", "gs://bucket/*.txt"), ("data.corpus", "http://example.com/corpus.txt"),
    ("data.corpus", "s3:///docs/*.jsonl"), ("data.corpus", "stdlib:s3://x"),
    ("data.tokenizer.path", "nosuch://tok.json"), ("data.tokenizer.path", "s3://"),
    ("data.tokenizer.path", "stdlib:tokenizer.json")])
def test_corpus_and_tokenizer_protocols_are_checked(field, url):
    assert _error(**{field: url}).field == field


def test_corpus_forms_data_prep_reads_are_accepted_and_only_those():
    for corpus in ("stdlib:*.py", "stdlib:json/*.py", "/data/corpus/*.jsonl.gz",
                   "s3://mainspring/corpus/*.parquet", "file:///data/c", "memory://c/*.txt"):
        assert _spec(**{"data.corpus": corpus}).data.corpus == corpus
    assert _error(**{"data.corpus": "nosuch://c/*.txt"}).field == "data.corpus"


@pytest.mark.parametrize("field,url", [
    ("storage.durable", "s3://AKIAEXAMPLE:hunter2secret@bucket/prefix"),
    ("data.corpus", "s3://bucket/c.jsonl?X-Amz-Signature=hunter2secret"),
    ("data.corpus", "file:///c.txt?token=hunter2secret"),
    ("data.tokenizer.path", "s3://bucket/tok.json?password=hunter2secret"),
    ("ops.otlp_endpoint", "http://user:hunter2secret@collector:4318"),
    ("ops.otlp_endpoint", "https://collector:4318/v1/traces?api_key=hunter2secret")])
def test_credentials_in_any_url_are_refused_without_echoing_them(field, url):
    err = _error(**{field: url})
    assert err.field == field and "hunter2secret" not in str(err)
    assert ("OTEL_EXPORTER_OTLP_HEADERS" if field == "ops.otlp_endpoint"
            else "AWS_ACCESS_KEY_ID") in err.fix


@pytest.mark.parametrize("endpoint", ["grpc://collector:4317", "s3://bucket", "http://",
                                      "https:///v1/traces", "/v1/traces", "http://[bad",
                                      "collector:http", "collector:70000"])
def test_an_otlp_endpoint_must_be_an_http_collector_address(endpoint):
    err = _error(**{"ops.otlp_endpoint": endpoint})
    assert err.field == "ops.otlp_endpoint" and "4318" in err.fix


def test_otlp_endpoints_a_collector_takes_are_accepted():
    for endpoint in ("", "collector:4318", "http://127.0.0.1:4318", "https://otel.example.com",
                     "[::1]:4318",
                     "https://gw.example.com/otlp/v1/traces"):
        assert _spec(**{"ops.otlp_endpoint": endpoint}).ops.otlp_endpoint == endpoint


def test_unknown_protocol_at_a_worker_is_bad_config_not_a_retryable_outage():
    with pytest.raises(BadConfig) as info:
        resolve("nosuch://bucket/x")
    assert not info.value.retryable and "nosuch" in str(info.value)
