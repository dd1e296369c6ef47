"""Storage URL and path rules of RunSpec fields. Stdlib only: the workflow sandbox imports it.

A spec's URLs are checked once, when it is validated, so a typo fails the run at once
with the field and the fix instead of surfacing on a worker (`s3://` used to become a
local directory `./s3:`; `nosuch://x` was retried as an outage). Accepted:

- `storage.durable`: a local path, `file:///abs/path`, `s3://bucket[/prefix]` (S3 bucket
  naming rules), `memory://name` (one process only: unit tests);
- `storage.fast`: a local path, apart from a local `storage.durable` (neither inside the
  other);
- `data.corpus`: `stdlib:<glob>`, or a local path / glob, `file://`, `s3://bucket/...`,
  `memory://` (globs allowed in the path); `data.tokenizer.path`: the same without stdlib;
- `ops.otlp_endpoint`: empty, `host:port` or `http(s)://host:port[/path]`;
- no URL carries credentials: `user:pass@` or a secret-looking query parameter
  (`?token=`, `X-Amz-Signature=`, ...) is refused, never echoed in the message.
"""

from __future__ import annotations

import posixpath
import re
from urllib.parse import urlsplit

from common.errors import BadConfig

SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
# https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html
BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
IPV4_RE = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")
SECRET_PARAM_RE = re.compile(
    r"[?&;][\w.-]*(token|signature|sig|password|passwd|pwd|secret|credential|key|auth)"
    r"[\w.-]*=", re.IGNORECASE)
DURABLE_SCHEMES = ("file", "s3", "s3a", "memory")
INPUT_SCHEMES = DURABLE_SCHEMES
STDLIB_PREFIX = "stdlib:"
CREDENTIALS_FIX = ("put credentials in the environment (AWS_ACCESS_KEY_ID / "
                   "AWS_SECRET_ACCESS_KEY) or a profile, not in the URL")


def split(value: str) -> tuple[str, str, str] | None:
    """(scheme, authority, path) of `scheme://authority/path`, or None for a plain path."""
    if "://" not in value:
        return None
    scheme, rest = value.split("://", 1)
    authority, slash, path = rest.partition("/")
    return scheme.lower(), authority, slash + path


def check_credentials(value: str, name: str, fix: str = CREDENTIALS_FIX) -> None:
    """No `user:pass@` and no secret-looking query parameter (the value is not echoed)."""
    parts = split(value)
    if parts and "@" in parts[1]:
        raise BadConfig(name, "the URL carries credentials (user:password@)", fix)
    if "://" in value and SECRET_PARAM_RE.search(value):
        raise BadConfig(name, "the URL carries a secret-looking query parameter", fix)


def check_durable(value: str, name: str) -> None:
    """storage.durable: local path, file:///abs, s3://bucket[/prefix] or memory://name."""
    _check_location(value, name, DURABLE_SCHEMES,
                    "use a local path, file:///abs/path, s3://bucket/prefix or memory://name")


def check_input(value: str, name: str, stdlib: bool = False) -> None:
    """data.corpus (stdlib=True) and data.tokenizer.path: a readable file, directory or glob."""
    if stdlib and value.startswith(STDLIB_PREFIX):
        _check_text(value, name)
        _require("://" not in value, name, "a stdlib: corpus is a glob, not a URL",
                 "write e.g. stdlib:*.py or stdlib:json/*.py")
        return
    _check_location(value, name, INPUT_SCHEMES,
                    "use a local path or glob, file:///abs/path, s3://bucket/prefix/*.jsonl, "
                    "memory://name" + (" or stdlib:*.py" if stdlib else ""))


def check_local_dir(value: str, name: str) -> None:
    """storage.fast: a directory on this machine's disk."""
    _check_text(value, name)
    _require("://" not in value and not SCHEME_RE.match(value), name,
             "must be a local directory, not a URL",
             "give a local path such as /mnt/nvme/mainspring-fast")
    _require("::" not in value, name, "must not contain '::'", "give a plain local path")


def tier_path(durable: str) -> str | None:
    """The local directory a durable location names (None: not on a local disk, e.g. s3://)."""
    parts = split(durable)
    if parts is None:
        return durable
    return parts[2] if parts[0] == "file" else None


def tiers_overlap(durable_dir: str, fast_dir: str) -> bool:
    """Pure: one directory is the other or lies inside it (paths as given, normalised)."""
    a, b = posixpath.normpath(durable_dir), posixpath.normpath(fast_dir)
    if posixpath.isabs(a) != posixpath.isabs(b):
        return False  # one is relative to a root not known here: the worker checks real paths
    return posixpath.commonpath([a, b]) in (a, b)


def check_tiers_apart(durable: str, fast: str, name: str = "storage.fast") -> None:
    """storage.fast and storage.durable share no directory: the fast tier's garbage collector
    removes whole run directories under `fast`, and with `fast` at `<durable>/runs` (or
    `fast == durable` and a run named `runs`) those were another run's durable checkpoints.
    The worker checks again with symlinks resolved (storage/fast_tier.py)."""
    local = tier_path(durable)
    _require(local is None or not tiers_overlap(local, fast), name,
             f"{fast!r} overlaps storage.durable {durable!r} (one lies inside the other)",
             "put the fast tier on a directory of its own outside the durable store, e.g. "
             "/mnt/nvme/mainspring-fast next to /data/mainspring-store")


def check_endpoint(value: str, name: str) -> None:
    """ops.otlp_endpoint: empty, host:port or http(s)://host:port[/path], without credentials
    (spans go over OTLP/HTTP, common/telemetry.py; a collector listens on port 4318)."""
    if value:
        _check_text(value, name)
        check_credentials(value, name, "put the collector's auth header in "
                          "OTEL_EXPORTER_OTLP_HEADERS on the workers, not in the URL")
        fix = "write host:port or http(s)://host:port (an OTLP/HTTP collector, usually port 4318)"
        try:  # what common/telemetry.py:traces_url will parse; .port checks the port
            parts = urlsplit(value if "://" in value else f"http://{value}")
            host, _ = parts.hostname, parts.port
        except ValueError as exc:
            raise BadConfig(name, f"is not a host:port address ({exc})", fix) from None
        _require(parts.scheme in ("http", "https"), name,
                 f"{parts.scheme}:// is not OTLP/HTTP", fix)
        _require(bool(host), name, "names no host", fix)


def _check_location(value: str, name: str, schemes: tuple[str, ...], fix: str) -> None:
    _check_text(value, name)
    check_credentials(value, name)
    _require("::" not in value, name, "chained fsspec URLs (a::b) are not supported", fix)
    parts = split(value)
    if parts is None:  # a local path
        _require(not SCHEME_RE.match(value), name,
                 f"looks like a URL without '//' ({value.split(':', 1)[0]}:)",
                 f"{fix}; for a local path starting that way write ./{value}")
        return
    scheme, authority, path = parts
    if scheme in ("http", "https"):
        raise BadConfig(name, f"{scheme}:// is not a storage protocol mainspring reads or writes",
                        f"{fix}; an S3-compatible service at an http(s) address is s3://bucket "
                        "with AWS_ENDPOINT_URL set to that address on every worker")
    _require(scheme in schemes, name, f"unknown storage protocol {scheme!r}", fix)
    if scheme in ("s3", "s3a"):
        _check_bucket(authority, name)
        segments = path.strip("/").split("/") if path.strip("/") else []
        _require(all(s not in ("", ".", "..") for s in segments), name,
                 "has an empty, '.' or '..' path segment", "write s3://bucket/prefix/sub")
    elif scheme == "file":
        _require(authority == "" and path.startswith("/"), name,
                 "a file:// URL needs an absolute path (three slashes)",
                 "write file:///abs/path, or just the path")
    else:  # memory
        _require(bool((authority + path).strip("/")), name, "names no location",
                 "write memory://name")


def _check_bucket(bucket: str, name: str) -> None:
    fix = ("write s3://bucket/prefix with a bucket name of 3-63 lowercase letters, digits, "
           "'.' and '-', starting and ending with a letter or digit")
    _require(bool(bucket), name, "names no bucket", fix)
    _require(bool(BUCKET_RE.match(bucket)), name, f"{bucket!r} is not a valid S3 bucket name", fix)
    _require(".." not in bucket and not IPV4_RE.match(bucket)
             and not bucket.startswith(("xn--", "sthree-"))
             and not bucket.endswith(("-s3alias", "--ol-s3")), name,
             f"{bucket!r} is not a valid S3 bucket name", fix)


def _check_text(value: str, name: str) -> None:
    _require(bool(value.strip()), name, "is empty", "give a path or URL")
    _require(value == value.strip(), name, "starts or ends with whitespace", "remove it")
    bad = next((i for i, ch in enumerate(value) if ord(ch) < 32 or ord(ch) == 0x7F), -1)
    _require(bad < 0, name, f"contains a control character at position {bad}", "remove it")


def _require(ok: bool, name: str, problem: str, fix: str) -> None:
    if not ok:
        raise BadConfig(name, problem, fix)
