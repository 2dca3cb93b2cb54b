"""``TieredStore`` over a real Redis, a real Redis Cluster (with a password and TLS too),
and shared between processes: what is served when a server stops, hangs or loses a
master, and what a reopened store knows."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from support import kv
from support.kv import assert_chunks_equal
from support.redis_servers import CLUSTER_PASSWORD
from support.redis_tiers import redis_key

from kvstore import TieredStore, TierKind
from kvstore.local.redis_server import RedisServer

DRAM, REDIS = TierKind.DRAM, TierKind.REDIS


def test_redis_stopped_mid_test_degrades_to_misses(redis_server_factory) -> None:
    server: RedisServer = redis_server_factory()
    with TieredStore(kv.config(kv.dram(2), kv.redis(server.url, write="back"))) as store:
        ns = kv.namespace()
        data = kv.chunks(5)
        store.put(ns, kv.tokens(5), data)
        assert store.lookup(ns, kv.tokens(5)).tiers == (DRAM, DRAM, REDIS, REDIS, REDIS)
        keys = store.keys_for(ns, kv.tokens(5))
        server.stop()
        started = time.monotonic()
        # DRAM still serves its part; the Redis part is a miss, not an exception.
        assert store.lookup(ns, kv.tokens(5)).tiers == (DRAM, DRAM)
        got = store.get(ns, keys)
        assert [chunk is not None for chunk in got] == [True, True, False, False, False]
        assert all(torch.equal(c.tensor(), t) for c, t in zip(got[:2], data[:2], strict=True))
        # A put that needs DRAM's room is refused: the victims' write-back cannot reach
        # Redis, and DRAM keeps the blocks it acknowledged.
        assert store.put(ns, kv.tokens(2, start=5_000), kv.chunks(2, seed=9)) == 0
        assert time.monotonic() - started < 6.0  # bounded by the timeouts, never a hang
        redis = store.stats().tiers[REDIS]
        assert redis.errors >= 1 and redis.errors + redis.calls_refused >= 3
        assert redis.down  # the breaker answers for it until a probe finds it back
        server.start()
        kv.wait_until_up(store, REDIS)
        # The same store reconnects once Redis is back (empty: it keeps nothing on disk);
        # DRAM still holds the head it kept through the outage.
        assert store.lookup(ns, kv.tokens(5)).tiers == (DRAM, DRAM)
        fresh = kv.chunks(4, seed=11)
        store.put(ns, kv.tokens(4, start=20_000), fresh)
        prefix = store.lookup(ns, kv.tokens(4, start=20_000))
        assert prefix.tiers == (DRAM, DRAM, REDIS, REDIS)
        assert_chunks_equal(store, ns, list(prefix.keys), fresh)


@pytest.mark.cluster
def test_store_over_a_redis_cluster(clean_redis_cluster) -> None:
    cluster_tier = kv.redis("unused")
    cluster_tier = type(cluster_tier)(
        kind=REDIS,
        capacity_bytes=64 << 20,
        nodes=tuple(clean_redis_cluster.startup_nodes),
        cluster=True,
        socket_timeout_s=1.0,
        connect_timeout_s=1.0,
    )
    with TieredStore(kv.config(kv.dram(2), cluster_tier)) as store:
        ns = kv.namespace()
        data = kv.chunks(12)
        store.put(ns, kv.tokens(12), data)
        prefix = store.lookup(ns, kv.tokens(12))
        assert prefix.tiers == (DRAM, DRAM) + (REDIS,) * 10
        assert_chunks_equal(store, ns, list(prefix.keys), data)


@pytest.mark.cluster
def test_store_over_a_redis_cluster_with_a_dead_master(clean_redis_cluster) -> None:
    """Chunks on the healthy masters are still served when one master is killed."""
    cluster_tier = dataclasses.replace(
        kv.redis("unused"), url=None, nodes=tuple(clean_redis_cluster.startup_nodes), cluster=True
    )
    with TieredStore(kv.config(cluster_tier)) as store:
        ns = kv.namespace()
        data = kv.chunks(12)
        store.put(ns, kv.tokens(12), data)
        keys = store.keys_for(ns, kv.tokens(12))
        victim = clean_redis_cluster.nodes[0]
        owners = [clean_redis_cluster.port_for_key(redis_key(ns, key)) for key in keys]
        assert 0 < owners.count(victim.port) < len(keys)
        victim.kill()
        try:
            got = store.get(ns, keys)
        finally:
            clean_redis_cluster.start()
        assert [chunk is not None for chunk in got] == [port != victim.port for port in owners]
        for chunk, tensor in zip(got, data, strict=True):
            assert chunk is None or torch.equal(chunk.tensor(), tensor)


@pytest.mark.cluster
def test_store_over_a_cluster_with_a_password_and_tls(secure_redis_cluster, tls_files) -> None:
    cluster_tier = dataclasses.replace(
        kv.redis("unused"),
        url=None,
        nodes=tuple(
            f"rediss://:{CLUSTER_PASSWORD}@{node}" for node in secure_redis_cluster.startup_nodes
        ),
        cluster=True,
        tls_ca_file=tls_files.ca,
    )
    with TieredStore(kv.config(kv.dram(2), cluster_tier)) as store:
        ns = kv.namespace()
        data = kv.chunks(8)
        store.put(ns, kv.tokens(8), data)
        prefix = store.lookup(ns, kv.tokens(8))
        assert prefix.tiers == (DRAM, DRAM) + (REDIS,) * 6
        assert_chunks_equal(store, ns, list(prefix.keys), data)


def test_a_second_process_sees_blocks_put_in_shared_redis(clean_redis: RedisServer) -> None:
    ns = kv.namespace()
    data = kv.chunks(3)
    config = kv.config(kv.dram(8), kv.redis(clean_redis.url))
    with TieredStore(config) as writer, TieredStore(config) as reader:
        writer.put(ns, kv.tokens(3), data)
        kv.written_through(writer)
        writer.demote(ns, writer.keys_for(ns, kv.tokens(3)))  # DRAM -> Redis
        prefix = reader.lookup(ns, kv.tokens(3))
        assert prefix.tiers == (REDIS,) * 3
        assert_chunks_equal(reader, ns, list(prefix.keys), data)
        assert reader.lookup(ns, kv.tokens(3)).tiers == (DRAM,) * 3  # promoted locally


def test_a_slow_redis_is_a_bounded_miss(redis_server_factory) -> None:
    server: RedisServer = redis_server_factory()
    with TieredStore(kv.config(kv.dram(1), kv.redis(server.url))) as store:
        ns = kv.namespace()
        data = kv.chunks(3)
        store.put(ns, kv.tokens(3), data)
        keys = store.keys_for(ns, kv.tokens(3))
        server.pause()  # SIGSTOP: connections open, nothing answers
        try:
            started = time.monotonic()
            assert store.lookup(ns, kv.tokens(3)).tiers == (DRAM,)
            got = store.get(ns, keys)
            assert time.monotonic() - started < 4.0  # two socket timeouts of 0.5 s, and slack
            assert [c is not None for c in got] == [True, False, False]
        finally:
            server.resume()
        kv.wait_until_up(store, REDIS)
        assert_chunks_equal(store, ns, keys, data)


def test_reopen_over_redis_restores_its_accounting(clean_redis: RedisServer) -> None:
    ns = kv.namespace()
    # Write-back: the store keeps the tier within its capacity by its own account.
    config = kv.config(kv.dram(1), kv.redis(clean_redis.url, write="back"))
    with TieredStore(config) as store:
        store.put(ns, kv.tokens(4), kv.chunks(4))
        store.demote(ns, store.keys_for(ns, kv.tokens(1)))  # the head leaves DRAM too
        held = store.stats().tiers[REDIS]
        assert held.blocks == 4
    with TieredStore(config) as reopened:
        stats = reopened.stats().tiers[REDIS]
        assert (stats.blocks, stats.used_bytes) == (4, held.used_bytes)
        assert reopened.lookup(ns, kv.tokens(4)).tiers == (REDIS,) * 4
