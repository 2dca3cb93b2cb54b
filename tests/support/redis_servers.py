"""Fixtures of real ``redis-server`` processes, on free loopback ports.

No fakes: the Redis tier is tested against the server it will meet in
production, so timeouts, OOM replies and cluster redirections are the real
ones. The servers are ``kvstore.tiers.local_redis``'s, which the replay and
the benchmarks start too; they never outlive the session (``kvstore.processes``).

``redis_server``           session-scoped ``RedisServer``, shared by all tests.
``clean_redis``            function-scoped: the same server, restarted if a test
                           stopped it, then ``FLUSHALL``; use this one in tests.
``redis_server_factory``   function-scoped: ``make(*extra_args) -> RedisServer``
                           for a private server (``--maxmemory``, stop/start);
                           every server it made is stopped after the test.
``redis_cluster``          session-scoped ``RedisCluster`` of three masters.
``clean_redis_cluster``    function-scoped: the same cluster, stopped masters
                           restarted, after ``FLUSHALL`` on every master.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvstore.tiers.local_redis import REDIS_CLI, REDIS_SERVER, RedisCluster, RedisServer


def _require_redis() -> None:
    # A failure, not a skip: the Redis tests are the Redis tier's only proof, and a
    # machine without redis-server must not pass them silently.
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.fail("redis-server and redis-cli must be on the PATH (apt-get install redis-server)")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One standalone server for the whole session; prefer ``clean_redis`` in tests."""
    _require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def clean_redis(redis_server: RedisServer) -> RedisServer:
    """The session server, running (a test may have stopped it) and empty."""
    redis_server.start()
    redis_server.flushall()
    return redis_server


@pytest.fixture
def redis_server_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., RedisServer]]:
    """``make(*extra_args)``: a private, started server, stopped after the test."""
    _require_redis()
    made: list[RedisServer] = []

    def make(*extra_args: str) -> RedisServer:
        server = RedisServer(tmp_path_factory.mktemp("redis-private"), extra_args=extra_args)
        made.append(server)
        server.start()
        return server

    try:
        yield make
    finally:
        for server in made:
            server.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """Three masters for the whole session; prefer ``clean_redis_cluster`` in tests."""
    _require_redis()
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def clean_redis_cluster(redis_cluster: RedisCluster) -> RedisCluster:
    """The session cluster, every master running (a test may have stopped one) and flushed."""
    redis_cluster.start()
    redis_cluster.flushall()
    return redis_cluster
