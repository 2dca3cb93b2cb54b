"""Fixtures of the multi-host tests: a Redis Cluster on the bridge, a daemon on each
host (``support/hosts.py`` draws the set-up; ``support/netns.py`` makes the hosts).

``bridge_cluster``  session-scoped ``RedisCluster``: three masters and three
                    replicas bound to the network's gateway, so every host
                    reaches every node. ``cluster-node-timeout`` is 2 s (a
                    killed master's replica takes over in about 4 s); full
                    coverage is not required (the other masters serve while
                    one is failed); ``allkeys-lru``, for when a test sets a
                    ``maxmemory``.
``shared_cluster``  function-scoped: the same cluster, every node running (a
                    master a test killed rejoins as its replica's replica),
                    without ``maxmemory``, flushed.
``hosts``           function-scoped: the three hosts' daemons, shared by the
                    session (each start costs seconds of imports), over
                    ``shared_cluster``, running (started again if a test stopped
                    one). Their tiers hold what earlier tests put: use a
                    namespace of your own (a tenant salt named after the test).
``namespace``       function-scoped: a namespace of the test's own (its name is
                    the tenant salt), in ``support.hosts.LAYOUT``.
``own_hosts``       function-scoped: daemons of the test's own on the first two
                    hosts, stopped after it, for a test whose fault may leave
                    a daemon's view of the cluster behind (a killed master):
                    whatever it leaves does not reach the next test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
from support.daemon import Daemon, socket_dir, start_all
from support.hosts import LAYOUT, daemon_config
from support.netns import Network
from support.redis_servers import require_redis

from kvstore.keys import Namespace
from kvstore.local.redis_cluster import RedisCluster

NODE_TIMEOUT_MS = 2000


@pytest.fixture(scope="session")
def bridge_cluster(
    netns_network: Network, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisCluster]:
    require_redis()
    with RedisCluster(
        tmp_path_factory.mktemp("bridge-cluster"),
        replicas=1,
        host=netns_network.gateway,
        node_timeout_ms=NODE_TIMEOUT_MS,
        extra_args=(
            "--cluster-require-full-coverage", "no",
            "--maxmemory-policy", "allkeys-lru",
        ),
    ) as cluster:  # fmt: skip
        yield cluster


@pytest.fixture
def shared_cluster(bridge_cluster: RedisCluster) -> RedisCluster:
    bridge_cluster.start()
    for node in bridge_cluster.nodes:
        node.command("CONFIG", "SET", "maxmemory", "0")
    bridge_cluster.flushall()
    return bridge_cluster


@pytest.fixture(scope="session")
def _host_daemons(
    netns_network: Network,
    bridge_cluster: RedisCluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[Daemon]]:
    with contextlib.ExitStack() as stack:
        sockets = stack.enter_context(socket_dir())
        daemons = []
        for host in netns_network.hosts:
            (sockets / host.name).mkdir(mode=0o700)
            daemon = Daemon(
                tmp_path_factory.mktemp(host.name),
                sockets / host.name,
                config_text=daemon_config(bridge_cluster),
                launcher=host.launcher,
            )
            stack.callback(daemon.close)
            daemons.append(daemon)
        start_all(daemons)
        yield daemons


@pytest.fixture
def hosts(_host_daemons: list[Daemon], shared_cluster: RedisCluster) -> list[Daemon]:
    start_all(_host_daemons)
    return _host_daemons


@pytest.fixture
def own_hosts(
    netns_network: Network,
    shared_cluster: RedisCluster,
    daemon_factory: Callable[..., Daemon],
) -> list[Daemon]:
    daemons = [
        daemon_factory(daemon_config(shared_cluster), launcher=host.launcher, start=False)
        for host in netns_network.hosts[:2]
    ]
    start_all(daemons)
    return daemons


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> Namespace:
    return Namespace("multihost", LAYOUT, tenant_salt=request.node.name)
