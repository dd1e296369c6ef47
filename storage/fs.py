"""fsspec filesystems by URL: local paths, file://, s3:// (any S3-compatible store), memory://.

S3 endpoint and credentials come from the environment, as with the AWS CLI:
`MAINSPRING_S3_ENDPOINT`, else `AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL` (botocore's
order: the service's own variable before the global one), `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`.
Listing caches are off: several processes write the same prefixes and must see each
other's commits at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import IO
from uuid import uuid4

import fsspec
import structlog
from fsspec.spec import AbstractFileSystem

from common.errors import BadConfig

log = structlog.get_logger(__name__)

CHUNK = 8 << 20


ENDPOINT_VARS = ("MAINSPRING_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def s3_endpoint() -> str:
    """The S3 endpoint the environment names, '' for AWS's own."""
    return next((os.environ[k] for k in ENDPOINT_VARS if os.environ.get(k)), "")


def s3_options() -> dict:
    endpoint = s3_endpoint()
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


# One S3 filesystem per process, endpoint and credentials, shared by its threads. A new
# s3fs instance is a new botocore session and client: 0.15-0.5 s before its first answer
# (the service model loaded, credentials resolved), where the shared one answers in 10 ms;
# the restart path and each segment boundary resolved a store a dozen times.
# s3fs runs every call on fsspec's one IO loop, so any thread may use it; after a fork the
# child (a rank, the checkpoint writer) makes its own: the key holds the process id.
_SHARED: dict[tuple, AbstractFileSystem] = {}
_SHARED_LOCK = threading.Lock()


def shared_key(protocol: str, options: dict) -> tuple:
    """Pure but for the environment: what makes two S3 filesystems interchangeable."""
    env = tuple(os.environ.get(k, "") for k in (
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION",
        "AWS_PROFILE"))
    return (os.getpid(), protocol, repr(sorted(options.items())), env)


def resolve(url: str) -> tuple[AbstractFileSystem, str]:
    """(filesystem, root path without protocol) for a URL or local path."""
    url = normalize_url(url)
    protocol = url.split("://", 1)[0]
    if protocol not in ("s3", "s3a"):
        return _resolve(url, protocol, {})
    options = s3_options()
    key = shared_key(protocol, options)
    fs = _SHARED.get(key)
    if fs is not None:
        return fs, fs._strip_protocol(url).rstrip("/")
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = _resolve(url, protocol, options)[0]
        fs = _SHARED[key]
    return fs, fs._strip_protocol(url).rstrip("/")


def _resolve(url: str, protocol: str, options: dict) -> tuple[AbstractFileSystem, str]:
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ValueError as exc:  # an unknown protocol or a malformed URL: retrying cannot help
        raise BadConfig(url, f"unknown or malformed storage URL ({exc})",
                        "use a local path, file:///abs/path, s3://bucket/prefix or memory://name"
                        ) from None
    except ImportError as exc:  # a known protocol whose package this worker lacks
        raise BadConfig(url, f"this worker cannot open {protocol}:// ({exc})",
                        "install the filesystem's package (s3fs for s3://) on every worker"
                        ) from None
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
    the writer is SIGKILLed — and fsync the directory, so the name survives a power cut.
    Other filesystems (memory://): check-then-write.
    """
    if is_local(fs):
        write_local_durable(path, lambda f: f.write(data), exclusive=True)
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


# ---- durable writes --------------------------------------------------------------------------
# On local disk or NFS, a file copied with fs.put_file lives only in the page cache until
# the kernel writes it back, and a rename/link lives in its directory's data: a power cut
# after the manifest landed could leave a "committed" checkpoint with empty or missing data
# files. Each helper below writes a temporary name in the same directory, fsyncs it,
# renames it into place and fsyncs the directory. On an object store one PUT is already
# atomic and durable when it returns, so they are a plain PUT/copy there.


def fsync_dir(path: str) -> None:
    """fsync a directory, making the names created or renamed in it durable (POSIX keeps a
    name in its directory's own data). A filesystem that cannot (EINVAL) is let be."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def temp_name(path: str) -> str:
    """A hidden, per-writer name next to `path` (readers skip dot-files; rename stays in one
    directory, so on one filesystem, so atomic)."""
    return os.path.join(os.path.dirname(path),
                        f".{os.path.basename(path)}.{os.getpid()}.{uuid4().hex[:12]}.tmp")


def write_local_durable(path: str, write: Callable[[IO[bytes]], None], *,
                        exclusive: bool = False) -> None:
    """Local disk: `write(f)` into a temporary file, fsync, rename over `path` — or, with
    `exclusive`, link() it there (FileExistsError if `path` exists: put_new) — and fsync
    the directory. A crash at any point leaves the old file or the new one whole, never a
    torn or empty one (a leftover temporary name is all it can leave)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, path)  # EEXIST if someone committed first
        else:
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(directory)


def put_file_durable(fs: AbstractFileSystem, local: str, dest: str) -> None:
    """Upload a local file to `dest`: crash-safe on local disk (see above), one PUT elsewhere."""
    if not is_local(fs):
        fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(local, dest)
        return
    _copy_local_durable(local, dest)


def copy_durable(fs: AbstractFileSystem, src: str, dest: str) -> None:
    """Copy within one filesystem: crash-safe on local disk, a server-side copy elsewhere."""
    if not is_local(fs):
        fs.copy(src, dest)
        return
    _copy_local_durable(src, dest)


def _copy_local_durable(src: str, dest: str) -> None:
    with open(src, "rb") as f:
        write_local_durable(dest, lambda out: shutil.copyfileobj(f, out, CHUNK))


def pipe_durable(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Write `data` to `path` whole (replacing it): crash-safe on local disk, one PUT elsewhere."""
    if not is_local(fs):
        fs.pipe_file(path, data)
        return
    write_local_durable(path, lambda out: out.write(data))


@contextlib.contextmanager
def commit_lock(fs: AbstractFileSystem, directory: str) -> Iterator[None]:
    """Local disk/NFS: an exclusive flock on `directory/.commit.lock` for a commit's whole
    check-upload-manifest sequence, so a second writer of the same step cannot slip its
    files in between another's check and manifest (NFS serves flock as a POSIX lock via
    NLM/NFSv4; the kernel drops it if the holder dies). No-op elsewhere: S3 has no locks
    (docs/decisions.md, "A second writer of a committed step")."""
    if not is_local(fs):
        yield
        return
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, ".commit.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def read_cached(cache_dir: str, name: str) -> bytes | None:
    """A local cache's copy of `name` (storage/dataset.py, storage/events.py); None if absent."""
    try:
        with open(os.path.join(cache_dir, name), "rb") as f:
            return f.read()
    except OSError:
        return None


def keep_cached(cache_dir: str, name: str, data: bytes) -> None:
    """Keep `data` as `name` in a local cache, whole or absent (a name of its own, then a
    rename). Best effort: a full local disk only costs the next fetch."""
    final = os.path.join(cache_dir, name)
    tmp = f"{final}.{os.getpid()}.tmp"
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, final)
    except OSError as exc:
        log.warning("local_cache_skipped", dir=cache_dir, error=repr(exc)[:200])
        with contextlib.suppress(OSError):
            os.unlink(tmp)
