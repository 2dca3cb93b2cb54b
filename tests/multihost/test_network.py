"""The hosts' network itself (``support/netns.py``): a host reaches the cluster on the
gateway across its veth pair and nowhere else, and a cut link drops its packets (a
connect times out) instead of refusing them, as a lost link does."""

from __future__ import annotations

import sys

import pytest
from support.netns import Host, Network

from kvstore.local.redis_cluster import RedisCluster

pytestmark = pytest.mark.cluster

_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    print("connected")
except OSError as error:
    print(type(error).__name__)
"""


def _connect(host: Host, address: str, port: int, timeout_s: float = 1.0) -> str:
    """What a TCP connect from inside ``host`` to ``address:port`` came to."""
    done = host.run(sys.executable, "-c", _CONNECT, address, str(port), str(timeout_s))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_host_reaches_the_cluster_until_its_link_is_cut(
    netns_network: Network, shared_cluster: RedisCluster
) -> None:
    host, port = netns_network.hosts[2], shared_cluster.nodes[0].port
    assert _connect(host, netns_network.gateway, port) == "connected"
    # The host's loopback is its own: the cluster is not there.
    assert _connect(host, "127.0.0.1", port) == "ConnectionRefusedError"
    with host.cut_off():
        assert _connect(host, netns_network.gateway, port, timeout_s=0.5) == "TimeoutError"
    assert _connect(host, netns_network.gateway, port) == "connected"
