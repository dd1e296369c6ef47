"""Several "hosts" on one machine: Linux network namespaces joined by a bridge (as root).

`NetnsCluster(n_hosts)` creates, in the root namespace, a Linux bridge with address
10.a.b.1/24 (a /24 picked at random among those this machine does not use) and, per host,
a namespace `ms-<tag>-h<i>` whose `eth0` is one end of a veth pair (the other end is a
port of the bridge) with address 10.a.b.(i+2)/24, and `lo` up. No namespace has a default
route, so from inside one only the /24 and loopback are reachable: a connect to any other
address fails at once with ENETUNREACH, before a packet is sent. IPv6 address generation is
off on every link we create (no link-local chatter). No sysctl, iptables rule or other
global setting is touched. The bridge address (`gateway`) is reachable from every namespace
and from the root namespace; `forward(port)` relays gateway:port to a loopback service of
the root namespace (the Temporal dev server, which cannot bind the gateway: see there).

Teardown kills what still runs inside the namespaces (torchrun's ranks run in sessions of
their own: killing a process group does not reach them), then deletes the namespaces, the
veth pairs and the bridge; it runs on `__exit__` (also after an exception), when the cluster
is garbage-collected and at interpreter exit, and only once. While a cluster exists, a
SIGTERM to a process that had the default disposition raises KeyboardInterrupt in the main
thread (as Ctrl-C does: pytest stops and tears down), so `kill <pid>` leaves nothing behind
either; only SIGKILL does.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)

IP = "ip"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`ip ARGS…`; raises RuntimeError with ip's message when `check` and it fails."""
    proc = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


@functools.cache
def netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can.

    Probes for real, once per process: creates and deletes a throwaway namespace, a bridge
    and a veth pair with one end in the namespace.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"network namespaces need root (euid {os.geteuid()})"
    if shutil.which(IP) is None:
        return "no `ip` binary (iproute2) on PATH"
    tag = secrets.token_hex(3)
    ns, bridge, veth = f"ms-{tag}-probe", f"msb{tag}", f"msv{tag}p"
    try:
        if (r := _ip("netns", "add", ns, check=False)).returncode:
            return f"`ip netns add` failed: {r.stderr.strip()}"
        if (r := _ip("link", "add", bridge, "type", "bridge", check=False)).returncode:
            return f"no bridge support: {r.stderr.strip()}"
        r = _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns,
                check=False)
        if r.returncode:
            return f"no veth support: {r.stderr.strip()}"
        return None
    finally:
        _remove([ns], [veth], bridge)


def _remove(namespaces: Sequence[str], veths: Sequence[str], bridge: str) -> None:
    """Kill what runs in `namespaces`, delete them, the root ends of `veths` and `bridge`.
    What is already gone is skipped; a failure is logged, never raised (this runs in
    teardown and at exit)."""
    existing = set(_ip("netns", "list", check=False).stdout.split())
    for ns in namespaces:
        if ns not in existing:
            continue
        # A namespace outlives `ip netns del` while a process is inside it (with its veth).
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        if (r := _ip("netns", "del", ns, check=False)).returncode:
            log.warning("netns_delete_failed", namespace=ns, error=r.stderr.strip())
    for link in [*veths, bridge]:
        if _ip("link", "show", "dev", link, check=False).returncode == 0:
            if (r := _ip("link", "del", "dev", link, check=False)).returncode:
                log.warning("netns_link_delete_failed", link=link, error=r.stderr.strip())


_guards = 0  # clusters that hold the SIGTERM guard


def _interrupt_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum} while a NetnsCluster exists")


def _guard_sigterm(take: bool) -> bool:
    """Take (True) or drop (False) a hold on the SIGTERM -> KeyboardInterrupt handler; it is
    installed by the first hold, only over the default disposition and from the main
    thread, and removed with the last. Returns whether the caller now holds one."""
    global _guards
    main = threading.current_thread() is threading.main_thread()
    current = signal.getsignal(signal.SIGTERM)
    if take:
        if not main or current not in (signal.SIG_DFL, _interrupt_on_sigterm):
            return False  # signals are the main thread's; someone else's handler stays
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
        _guards += 1
        return True
    _guards -= 1
    if _guards == 0 and main and current is _interrupt_on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return False


def _used_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks this machine's root namespace uses: its addresses, its routes (all
    tables) and its DNS servers. A bridge on one of them would capture that traffic."""
    nets = []
    for line in _ip("-4", "-o", "addr", "show", check=False).stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            nets.append(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest[:1].isdigit():
            nets.append(ipaddress.ip_network(dest, strict=False))
    try:
        with open("/etc/resolv.conf") as f:
            for line in f:
                if line.split()[:1] == ["nameserver"]:
                    try:
                        nets.append(ipaddress.ip_network(line.split()[1]))
                    except ValueError:  # an IPv6 server
                        pass
    except OSError:
        pass
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network)]


def _pick_subnet() -> ipaddress.IPv4Network:
    """A random 10.a.b.0/24 that overlaps nothing this machine uses (parallel runs pick
    different ones with high probability)."""
    used = _used_networks()
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{random.randint(16, 239)}.{random.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 found for the namespace bridge")


@dataclass(frozen=True)
class NetnsHost:
    """One "host": a network namespace with `ifname` at `address` on the cluster's /24."""

    name: str
    address: str
    ifname: str = "eth0"

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` run inside this host's namespace (`ip netns exec` execs it: same pid)."""
        return [IP, "netns", "exec", self.name, *cmd]

    def run(self, cmd: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        """subprocess.run of `cmd` inside this host's namespace."""
        return subprocess.run(self.argv(cmd), **kw)

    def popen(self, cmd: Sequence[str], **kw: Any) -> subprocess.Popen:
        """subprocess.Popen of `cmd` inside this host's namespace."""
        return subprocess.Popen(self.argv(cmd), **kw)


class NetnsCluster:
    """`n_hosts` namespaces on one bridge; see the module docstring. Use as a context
    manager; `hosts`, `gateway` and `subnet` are set on entry."""

    def __init__(self, n_hosts: int = 2) -> None:
        if not 1 <= n_hosts <= 200:
            raise ValueError(f"n_hosts must be in 1..200, not {n_hosts}")
        self.n_hosts = n_hosts
        self.tag = secrets.token_hex(3)
        self.bridge = f"msb{self.tag}"  # ≤ 15 characters (IFNAMSIZ)
        self.hosts: list[NetnsHost] = []
        self.gateway = ""
        self.subnet: ipaddress.IPv4Network | None = None
        names = [f"ms-{self.tag}-h{i}" for i in range(n_hosts)]
        veths = [f"msv{self.tag}h{i}" for i in range(n_hosts)]
        self._names, self._veths = names, veths
        # Registered before anything exists; runs once: from close(), on GC or at exit.
        self._finalizer = weakref.finalize(self, _remove, names, veths, self.bridge)
        self._sigterm_guard = False
        self._relays: list[TcpRelay] = []

    def __enter__(self) -> NetnsCluster:
        reason = netns_unavailable()
        if reason:
            raise RuntimeError(f"network namespaces unavailable: {reason}")
        self._sigterm_guard = _guard_sigterm(True)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def forward(self, target_port: int, target_host: str = "127.0.0.1",
                port: int | None = None) -> str:
        """Make `target_host:target_port` in the root namespace (a loopback service) reachable
        from the hosts at the returned `gateway:port` (`port` defaults to `target_port`): a
        TCP relay in this process, closed with the cluster.

        Needed for the Temporal dev server: `start-dev --ip <address>` binds its internal
        services to that address but dials them on 127.0.0.1 (temporal CLI 1.9.1), so it
        works on loopback or 0.0.0.0 only, and 0.0.0.0 would listen on every interface."""
        relay = TcpRelay((self.gateway, target_port if port is None else port),
                         (target_host, target_port))
        self._relays.append(relay)
        return relay.address

    def close(self) -> None:
        """Remove the namespaces (and what runs in them), veth pairs and bridge. Idempotent."""
        for relay in self._relays:
            relay.close()
        if self._finalizer.alive:
            self._finalizer()
            log.info("netns_cluster_removed", bridge=self.bridge, hosts=self._names)
        if self._sigterm_guard:
            self._sigterm_guard = _guard_sigterm(False)

    def _create(self) -> None:
        t0 = time.monotonic()
        self.subnet = net = _pick_subnet()
        prefix = net.prefixlen
        self.gateway = str(net[1])
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", "dev", self.bridge, "addrgenmode", "none")
        _ip("addr", "add", f"{self.gateway}/{prefix}", "dev", self.bridge)
        _ip("link", "set", "dev", self.bridge, "up")
        for i, (name, veth) in enumerate(zip(self._names, self._veths)):
            host = NetnsHost(name=name, address=str(net[i + 2]))
            _ip("netns", "add", name)
            _ip("link", "add", veth, "type", "veth", "peer", "name", host.ifname, "netns", name)
            _ip("link", "set", "dev", veth, "addrgenmode", "none")
            _ip("link", "set", "dev", veth, "master", self.bridge, "up")
            _ip("-n", name, "link", "set", "dev", host.ifname, "addrgenmode", "none")
            _ip("-n", name, "addr", "add", f"{host.address}/{prefix}", "dev", host.ifname)
            _ip("-n", name, "link", "set", "dev", host.ifname, "up")
            _ip("-n", name, "link", "set", "dev", "lo", "up")
            self.hosts.append(host)
        log.info("netns_cluster_created", bridge=self.bridge, gateway=self.gateway,
                 hosts=[(h.name, h.address) for h in self.hosts],
                 seconds=round(time.monotonic() - t0, 2))


class TcpRelay:
    """Accepts on `listen` and copies bytes both ways to a fresh connection to `target`, one
    thread per direction: enough for a few gRPC channels of test workers."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.target = target
        self._server = socket.create_server(listen)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        host, port = self._server.getsockname()[:2]
        self.address = f"{host}:{port}"
        threading.Thread(target=self._accept, daemon=True, name=f"relay-{port}").start()

    def close(self) -> None:
        _hang_up(self._server)
        with self._lock:
            conns, self._open = list(self._open), set()
        for conn in conns:
            _hang_up(conn)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError as exc:
                log.warning("relay_connect_failed", target=self.target, error=str(exc))
                client.close()
                continue
            with self._lock:
                self._open |= {client, upstream}
            ends = [0]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst, ends), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, ends: list[int]) -> None:
        broken = False
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)  # pass the half-close on
        except OSError:
            broken = True  # reset, or closed by close(): end the other direction too
        with self._lock:
            ends[0] += 1
            done = broken or ends[0] == 2
            if done:
                self._open -= {src, dst}
        if done:
            _hang_up(src)
            _hang_up(dst)


def _hang_up(sock: socket.socket) -> None:
    """Close `sock`, waking a thread blocked on it (close alone does not on Linux)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected, or already shut
    sock.close()
