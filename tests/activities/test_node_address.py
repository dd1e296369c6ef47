"""A node's default address (activities/nodes.py `default_address`): its hostname's, or,
where that resolves to loopback, the one it sends from toward the Temporal frontend."""

from __future__ import annotations

import socket

import psutil
import pytest

from activities import nodes


def local_non_loopback_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


@pytest.fixture
def hostname_on_loopback(monkeypatch):
    monkeypatch.setattr(nodes.socket, "gethostbyname", lambda name: "127.0.1.1")


def test_a_hostname_on_loopback_takes_the_address_this_host_reaches_temporal_from(
        hostname_on_loopback):
    mine = local_non_loopback_ipv4()
    if mine is None:
        pytest.skip("this machine has no non-loopback IPv4 address to route toward")
    # A frontend at one of this host's own addresses: the route's source is that address
    # (a UDP connect sends nothing).
    assert nodes.default_address(toward=f"{mine}:7233") == mine


def test_a_temporal_on_loopback_or_no_frontend_leaves_a_one_machine_cluster_on_127(
        hostname_on_loopback):
    assert nodes.default_address(toward="127.0.0.1:7233") == "127.0.0.1"
    assert nodes.default_address(toward="127.0.0.1:not-a-port") == "127.0.0.1"
    assert nodes.default_address() == "127.0.0.1"


def test_a_hostname_that_resolves_off_loopback_is_used_as_it_is(monkeypatch):
    monkeypatch.setattr(nodes.socket, "gethostbyname", lambda name: "10.1.0.7")
    assert nodes.default_address(toward="127.0.0.1:7233") == "10.1.0.7"
