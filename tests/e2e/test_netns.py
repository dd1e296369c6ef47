"""The multi-host harness (tests/e2e/netns.py): "hosts" in Linux network namespaces on one
bridge. Each host reaches the others and the bridge address, and nothing else; ranks in two
namespaces rendezvous (c10d) and all-reduce over gloo; a trainer worker in each namespace
polls a Temporal dev server bound to the bridge address; the namespaces and the bridge are
gone after the test, also when it fails or its process is terminated. Skipped, with the
reason, where namespaces cannot be created (not root, no iproute2, no bridge support)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.e2e.netns import NetnsCluster, netns_unavailable
from tests.e2e.runs import wait_for

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# TEST-NET-2 and -3 (RFC 5737): never anyone's address; a harness bug could not reach them.
OUTSIDE = ("198.51.100.1", "203.0.113.1")

LISTEN = r"""
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    c, peer = s.accept()
    c.sendall(f"{sys.argv[1]} sees {peer[0]}".encode())
    c.close()
"""

# Connects to each host:port argument; prints {target: [errno name or "ok", detail, seconds]}.
PROBE = r"""
import errno, json, socket, sys, time
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    t0 = time.monotonic()
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, int(port)))
        out[target] = ["ok", s.recv(100).decode(), time.monotonic() - t0]
    except OSError as exc:
        out[target] = [errno.errorcode.get(exc.errno, "timeout"), str(exc), time.monotonic() - t0]
    finally:
        s.close()
print(json.dumps(out))
"""

ALL_REDUCE = r"""
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item():g}", flush=True)
assert dist.get_world_size() == 2 and t.item() == 3, t
dist.destroy_process_group()
"""


@pytest.fixture(autouse=True)
def _needs_netns():
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def gone(cluster: NetnsCluster) -> None:
    """Nothing of `cluster` is left: no namespace, no bridge, no veth end."""
    namespaces = ip("netns", "list")
    links = ip("-o", "link", "show")
    assert f"ms-{cluster.tag}-" not in namespaces, namespaces
    assert cluster.bridge not in links and f"msv{cluster.tag}" not in links, links


def root_addresses(cluster: NetnsCluster) -> list[str]:
    """The root namespace's own IPv4 addresses, loopback and the bridge excepted."""
    out = []
    for line in ip("-4", "-o", "addr", "show").splitlines():
        fields = line.split()
        if fields[1] not in ("lo", cluster.bridge):
            out.append(fields[3].split("/")[0])
    return out


def gateway_listener(address: str) -> tuple[socket.socket, int]:
    server = socket.create_server((address, 0))

    def serve() -> None:
        while True:
            try:
                conn, peer = server.accept()
            except OSError:
                return  # closed
            conn.sendall(f"{address} sees {peer[0]}".encode())
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def test_multinode_namespace_hosts_reach_each_other_and_the_gateway_but_nothing_else():
    with NetnsCluster(n_hosts=2) as cluster:
        h0, h1 = cluster.hosts
        assert h0.address != h1.address and {h0.ifname, h1.ifname} == {"eth0"}
        listeners = [h.popen([sys.executable, "-c", LISTEN, h.address, "5000"],
                             stdout=subprocess.PIPE, text=True) for h in cluster.hosts]
        for proc in listeners:
            assert proc.stdout.readline().strip() == "listening"
        server, gw_port = gateway_listener(cluster.gateway)
        outside = [*OUTSIDE, *root_addresses(cluster)]
        try:
            for me, peer in ((h0, h1), (h1, h0)):
                targets = [f"{peer.address}:5000", f"{cluster.gateway}:{gw_port}",
                           *(f"{a}:80" for a in outside)]
                res = me.run([sys.executable, "-c", PROBE, *targets], capture_output=True,
                             text=True, timeout=30, check=True)
                got = json.loads(res.stdout)
                # the other host and the gateway answer, and see this host's own address
                assert got[targets[0]][:2] == ["ok", f"{peer.address} sees {me.address}"], got
                assert got[targets[1]][:2] == ["ok", f"{cluster.gateway} sees {me.address}"], got
                # anything else has no route: refused by the kernel before a packet is sent
                for target in targets[2:]:
                    kind, detail, seconds = got[target]
                    assert kind == errno.errorcode[errno.ENETUNREACH], (target, detail)
                    assert seconds < 0.5, (target, seconds)

                routes = me.run(["ip", "route", "show", "table", "all"], capture_output=True,
                                text=True, check=True).stdout
                assert "default" not in routes, routes
                v4 = me.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
                assert v4.split()[:3] == [str(cluster.subnet), "dev", "eth0"], v4
                assert len(v4.strip().splitlines()) == 1, v4
        finally:
            server.close()
            for proc in listeners:
                proc.kill()
                proc.wait()
    gone(cluster)


def test_multinode_gloo_all_reduce_runs_across_two_namespace_hosts_with_c10d_rendezvous(
        tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    with NetnsCluster(n_hosts=2) as cluster:
        endpoint = f"{cluster.hosts[0].address}:29400"
        # gloo advertises the address its hostname resolves to unless told an interface;
        # on a machine whose name is 127.0.0.1 in /etc/hosts the peer would dial loopback.
        env = {**os.environ, "PYTHONPATH": ROOT, "GLOO_SOCKET_IFNAME": "eth0",
               "OMP_NUM_THREADS": "1"}
        procs, logs = [], []
        for i, host in enumerate(cluster.hosts):
            logs.append(tmp_path / f"host{i}.log")
            # is_host: c10d guesses the store host from the machine's hostname, which every
            # namespace shares (and which resolves to none of their addresses)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", "1", "--node-rank", str(i), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", endpoint, "--rdzv-id", f"netns-{cluster.tag}",
                   "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", host.address,
                   "--max-restarts", "0", str(script)]
            # output to files, not pipes: the ranks outlive a killed torchrun otherwise
            procs.append(host.popen(cmd, stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT,
                                    env=env))
        deadline = time.monotonic() + 60
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    gone(cluster)  # the ranks of a run that hung were killed with the namespaces
    out = [p.read_text() for p in logs]
    assert codes == [0, 0], out
    lines = sorted(line for text in out for line in text.splitlines() if line.startswith("rank="))
    assert lines == ["rank=0 world=2 sum=3", "rank=1 world=2 sum=3"], out


def test_multinode_cluster_is_removed_after_the_test_even_when_it_fails():
    cluster = NetnsCluster(n_hosts=3)
    with pytest.raises(RuntimeError, match="the test failed"):
        with cluster:
            assert len(cluster.hosts) == 3
            assert all(f"ms-{cluster.tag}-h{i}" in ip("netns", "list") for i in range(3))
            assert cluster.bridge in ip("link", "show", "type", "bridge")
            # a process still running inside a namespace does not keep it alive
            cluster.hosts[1].popen(["sleep", "600"])
            raise RuntimeError("the test failed")
    gone(cluster)
    cluster.close()  # idempotent


def test_multinode_cluster_is_removed_when_its_process_is_terminated(tmp_path):
    code = ("import sys, time\n"
            f"sys.path.insert(0, {ROOT!r})\n"
            "from tests.e2e.netns import NetnsCluster\n"
            "with NetnsCluster(n_hosts=2) as c:\n"
            "    c.hosts[0].popen(['sleep', '600'])\n"
            "    print('CLUSTER', c.tag, c.bridge, flush=True)\n"
            "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("CLUSTER "):  # structlog writes to stdout too
            line = proc.stdout.readline()
            assert line, "the child exited before it made its cluster"
        _, tag, bridge = line.split()
        assert f"ms-{tag}-h0" in ip("netns", "list")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert f"ms-{tag}-" not in ip("netns", "list")
    links = ip("-o", "link", "show")
    assert bridge not in links and f"msv{tag}" not in links, links


def test_multinode_trainer_workers_in_two_namespace_hosts_poll_a_loopback_temporal_server_through_the_gateway(
        tmp_path):
    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

    from activities.contracts import TRAINER_QUEUE
    from common.procs import WorkerFleet
    from ops.client import connect
    from ops.services import TemporalDevServer, free_port

    async def pollers(address: str) -> set[str]:
        client = await connect(address)
        resp = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
            namespace="default", task_queue=TaskQueue(name=TRAINER_QUEUE),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY))
        return {p.identity for p in resp.pollers}

    with NetnsCluster(n_hosts=2) as cluster:
        # On loopback, as everywhere else: `start-dev --ip <bridge address>` binds its
        # internal services there but dials them on 127.0.0.1 (see NetnsCluster.forward).
        server = TemporalDevServer(str(tmp_path / "temporal"), port=free_port(),
                                   headless=True)
        assert server.address == f"127.0.0.1:{server.port}"
        assert server.command()[server.command().index("--ip") + 1] == "127.0.0.1"
        server.start()
        via_gateway = cluster.forward(server.port)
        assert via_gateway == f"{cluster.gateway}:{server.port}"
        fleets = []
        try:
            for i, host in enumerate(cluster.hosts):
                fleets.append(WorkerFleet(via_gateway, roles=("trainer",),
                                          log_dir=str(tmp_path / f"logs-h{i}"), restart=False,
                                          wrap=tuple(host.argv([]))).start())
            pids = [f.procs["trainer"].pid for f in fleets]
            for pid, host in zip(pids, cluster.hosts):
                # `ip netns exec` enters the namespace, then execs the worker: Popen's pid
                # becomes the worker, inside that namespace
                wait_for(lambda pid=pid: open(f"/proc/{pid}/cmdline").read().split("\0")[0]
                         == sys.executable, 10, f"pid {pid} to exec the worker", every_s=0.05)
                assert os.stat(f"/proc/{pid}/ns/net").st_ino == \
                    os.stat(f"/run/netns/{host.name}").st_ino
            # the SDK's identity is pid@hostname: each worker polls, over its own veth
            wait_for(lambda: all(any(s.startswith(f"{pid}@") for s in
                                     asyncio.run(pollers(server.address))) for pid in pids),
                     45, f"workers {pids} polling {TRAINER_QUEUE}")
        finally:
            t0 = time.monotonic()
            for fleet in fleets:
                fleet.stop()  # os.killpg(worker pid): the worker leads its own session
            stop_s = time.monotonic() - t0
            server.stop()
        codes = [f.procs["trainer"].returncode for f in fleets]
        assert all(code is not None for code in codes) and stop_s < 15, (codes, stop_s)
    gone(cluster)
