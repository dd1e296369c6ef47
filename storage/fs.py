"""fsspec filesystems by URL: local paths, file://, s3:// (any S3-compatible store), memory://.

S3 endpoint and credentials come from the environment, as with the AWS CLI:
`AWS_ENDPOINT_URL` (or `MAINSPRING_S3_ENDPOINT`), `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`.
Listing caches are off: several processes write the same prefixes and must see each
other's commits at once.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Iterator
from typing import IO
from uuid import uuid4

import fsspec
from fsspec.spec import AbstractFileSystem

from ops.errors import StorageUnavailable

CHUNK = 8 << 20


def s3_options() -> dict:
    endpoint = os.environ.get("MAINSPRING_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
    opts: dict = {"use_listings_cache": False, "skip_instance_cache": True}
    if endpoint:
        opts["client_kwargs"] = {"endpoint_url": endpoint}
        # S3-compatible stores (SeaweedFS, MinIO) do not need AWS's checksum trailers.
        opts["config_kwargs"] = {"request_checksum_calculation": "when_required",
                                 "response_checksum_validation": "when_required",
                                 "retries": {"max_attempts": 3, "mode": "standard"}}
    return opts


def normalize_url(url: str) -> str:
    """A bare path becomes an absolute file:// URL; URLs pass through."""
    if "://" in url:
        return url.rstrip("/")
    return "file://" + os.path.abspath(os.path.expanduser(url))


def resolve(url: str) -> tuple[AbstractFileSystem, str]:
    """(filesystem, root path without protocol) for a URL or local path."""
    url = normalize_url(url)
    protocol = url.split("://", 1)[0]
    options = s3_options() if protocol in ("s3", "s3a") else {}
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as exc:
        raise StorageUnavailable(url, f"cannot open filesystem: {exc}") from exc
    return fs, root.rstrip("/")


def join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p)


def sha256_stream(stream: IO[bytes], copy_to: IO[bytes] | None = None) -> tuple[str, int]:
    """(sha256 hex, size) of a stream, optionally copying it to `copy_to` on the way."""
    digest, size = hashlib.sha256(), 0
    while chunk := stream.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
        if copy_to is not None:
            copy_to.write(chunk)
    return digest.hexdigest(), size


def sha256_file(fs: AbstractFileSystem, path: str) -> tuple[str, int]:
    with fs.open(path, "rb") as f:
        return sha256_stream(f)


def walk_files(local_dir: str) -> Iterator[str]:
    """Relative paths of every file under local_dir, sorted (deterministic manifests)."""
    found = []
    for dirpath, _, names in os.walk(local_dir):
        for name in names:
            found.append(os.path.relpath(os.path.join(dirpath, name), local_dir))
    yield from sorted(found)


# A local or network filesystem that went away or read-only (NFS, a remounted disk), or an
# object store answering with a server-side error once its client's own retries are spent:
# retry later. s3fs turns HTTP 500 (InternalError) into EREMOTEIO and 503 (SlowDown,
# ServiceUnavailable) into EBUSY; S3's guidance is to retry both with backoff, and a store
# going down or coming back answers 500 for a moment. Disk full and permission errors are
# not in this list: they need a human.
UNAVAILABLE_ERRNOS = frozenset({errno.EROFS, errno.EIO, errno.ENOTCONN, errno.ESTALE,
                                errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ETIMEDOUT,
                                errno.ENODEV, errno.ENXIO, errno.EBUSY,
                                getattr(errno, "EREMOTEIO", errno.EIO)})


def is_unavailable(exc: BaseException) -> bool:
    """True for errors that mean 'the store is unreachable' rather than 'the data is wrong'."""
    return isinstance(exc, storage_errors()) or (
        isinstance(exc, OSError) and exc.errno in UNAVAILABLE_ERRNOS)


def storage_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean 'the store is unreachable' rather than 'the data is wrong'."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        import botocore.exceptions as bx

        errors += [bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError]
    except ImportError:
        pass
    try:
        import aiohttp

        errors.append(aiohttp.ClientConnectionError)
    except ImportError:
        pass
    return tuple(errors)


def is_local(fs: AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def put_new(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Create `path` with `data` whole, or raise FileExistsError: an object is never overwritten.

    S3: a conditional PUT (`If-None-Match: *`, honoured by AWS S3 and SeaweedFS ≥ 3.x; see
    docs/decisions.md). Local disk: write a temporary file, fsync, then `link()` it to the
    final name — atomic and exclusive, so a reader never sees a half-written object even if
    the writer is SIGKILLed. Other filesystems (memory://): check-then-write.
    """
    if is_local(fs):
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)  # EEXIST if someone committed first
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return
    try:
        fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        raise
    except storage_errors():
        raise
    except OSError as exc:  # s3fs turns 412 Precondition Failed into a plain OSError
        if fs.exists(path):
            raise FileExistsError(path) from exc
        raise
