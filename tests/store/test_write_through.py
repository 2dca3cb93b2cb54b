"""Write-through to a shared tier: every put reaches Redis soon after, off the put's path,
and the servers, not the store, own that tier's capacity (``kvstore.store.write_through``).

Two ``TieredStore`` objects over one real redis-server stand for two hosts: each has
its own DRAM arena, so whatever one finds of the other's puts came through Redis.
"""

from __future__ import annotations

import logging
import time

import pytest
from support import kv

from kvstore.errors import ConfigError
from kvstore.kinds import TierKind
from kvstore.local.redis_server import RedisServer
from kvstore.store.tiered_store import TieredStore
from kvstore.tiers.registry import TierConfig, tier_config

DRAM, REDIS = TierKind.DRAM, TierKind.REDIS


def test_a_put_reaches_the_shared_tier_and_another_host_reads_it(clean_redis: RedisServer) -> None:
    ns = kv.namespace()
    data = kv.chunks(6)
    with (
        TieredStore(kv.config(kv.dram(16), kv.redis(clean_redis.url))) as host_a,
        TieredStore(kv.config(kv.dram(16), kv.redis(clean_redis.url))) as host_b,
    ):
        assert host_a.put(ns, kv.tokens(6), data) == 6
        kv.written_through(host_a)
        # Host A keeps its DRAM copies (nothing was evicted) and knows of the shared ones.
        assert host_a.lookup(ns, kv.tokens(6)).tiers == (DRAM,) * 6
        written = host_a.stats().tiers[REDIS]
        assert (written.write_through_written, written.write_through_dropped) == (6, 0)
        # Host B has never seen these keys: its lookup asks Redis, its get reads them there.
        assert host_b.lookup(ns, kv.tokens(6)).tiers == (REDIS,) * 6
        kv.assert_chunks_equal(host_b, ns, host_b.keys_for(ns, kv.tokens(6)), data)
        assert host_b.lookup(ns, kv.tokens(6)).tiers == (DRAM,) * 6  # promoted on its hit


def test_write_back_keeps_a_put_local(clean_redis: RedisServer) -> None:
    ns = kv.namespace()
    back = kv.redis(clean_redis.url, write="back")
    with (
        TieredStore(kv.config(kv.dram(16), back)) as host_a,
        TieredStore(kv.config(kv.dram(16), back)) as host_b,
    ):
        host_a.put(ns, kv.tokens(3), kv.chunks(3))
        assert host_a.drain_write_through(time.monotonic() + 10.0)  # nothing queued
        assert host_b.lookup(ns, kv.tokens(3)).num_chunks == 0


def test_a_hung_shared_tier_never_holds_up_a_put(redis_server_factory) -> None:
    server: RedisServer = redis_server_factory()
    shared = TierConfig(
        REDIS, 64 << 20, url=server.url, socket_timeout_s=2.0, connect_timeout_s=2.0
    )
    ns = kv.namespace()
    with TieredStore(kv.config(kv.dram(64), shared)) as store:
        store.put(ns, kv.tokens(1, start=90_000), kv.chunks(1))
        kv.written_through(store)
        server.pause()
        try:
            slowest = 0.0
            for round_ in range(5):
                started = time.monotonic()
                assert store.put(ns, kv.tokens(4, start=round_ * 1000), kv.chunks(4)) == 4
                slowest = max(slowest, time.monotonic() - started)
            # Each copy to the hung server waits out a 2 s socket timeout; no put did.
            assert slowest < 1.0
            assert store.lookup(ns, kv.tokens(4, start=4000)).tiers == (DRAM,) * 4
            give_up = time.monotonic() + 10.0
            while not store.stats().tiers[REDIS].write_through_failed:
                assert time.monotonic() < give_up, "the copies never timed out"
                time.sleep(0.05)
        finally:
            server.resume()
        kv.written_through(store, timeout_s=20.0)
        counters = store.stats().tiers[REDIS]
        # Copied once the server answered again, or failed (counted) while it did not.
        assert counters.write_through_written + counters.write_through_failed == 21
        assert counters.write_through_failed >= 1


def test_a_block_deleted_before_its_copy_is_skipped_and_counted(redis_server_factory) -> None:
    server: RedisServer = redis_server_factory()
    shared = TierConfig(REDIS, 64 << 20, url=server.url, socket_timeout_s=2.0)
    ns = kv.namespace()
    with TieredStore(kv.config(kv.dram(64), shared)) as store:
        store.put(ns, kv.tokens(1, start=90_000), kv.chunks(1))
        kv.written_through(store)
        server.pause()  # the worker waits on its next copy; the rest stay queued
        try:
            store.put(ns, kv.tokens(1, start=80_000), kv.chunks(1))  # the copy that waits
            time.sleep(0.2)
            keys = store.keys_for(ns, kv.tokens(6))
            store.put(ns, kv.tokens(6), kv.chunks(6))
            assert store.stats().tiers[REDIS].write_through_pending >= 6
            assert store.delete(ns, keys) == 6  # gone before their turn
        finally:
            server.resume()
        kv.written_through(store, timeout_s=20.0)
        counters = store.stats().tiers[REDIS]
        assert counters.write_through_skipped == 6 and counters.write_through_pending == 0
        assert counters.write_through_queued == (
            counters.write_through_written
            + counters.write_through_skipped
            + counters.write_through_failed
        )
        assert store.lookup(ns, kv.tokens(6)).num_chunks == 0


def test_a_full_queue_drops_copies_and_counts_them(clean_redis: RedisServer) -> None:
    shared = TierConfig(REDIS, 64 << 20, url=clean_redis.url, write_queue=4)
    ns = kv.namespace()
    with TieredStore(kv.config(kv.dram(64), shared)) as store:
        assert store.put(ns, kv.tokens(20), kv.chunks(20)) == 20  # the put itself is whole
        kv.written_through(store)
        counters = store.stats().tiers[REDIS]
        assert (counters.write_through_queued, counters.write_through_dropped) == (4, 16)
        assert counters.write_through_written == 4 and counters.write_through_pending == 0
        assert store.lookup(ns, kv.tokens(20)).tiers == (DRAM,) * 20


def test_the_servers_own_the_shared_tiers_capacity(redis_server_factory) -> None:
    server: RedisServer = redis_server_factory(
        "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"
    )
    ns = kv.namespace()
    # Far more than the configured capacity of 4 chunks: the store evicts none of it.
    shared = kv.redis(server.url, capacity=4 * kv.ARENA_SLOT)
    with TieredStore(kv.config(kv.dram(64), shared)) as store:
        store.put(ns, kv.tokens(40), kv.chunks(40))
        kv.written_through(store)
        counters = store.stats().tiers[REDIS]
        assert counters.evictions == 0 and counters.blocks == 40
        assert counters.capacity_bytes == 64 << 20  # the server's maxmemory, not ours
        assert counters.used_bytes > 40 * kv.LAYOUT.chunk_nbytes  # the server's used_memory
    with TieredStore(kv.config(kv.dram(64), shared)) as other_host:
        # It does not scan what every host wrote: it asks about the keys it is asked for.
        assert other_host.stats().tiers[REDIS].blocks == 0
        assert other_host.lookup(ns, kv.tokens(40)).tiers == (REDIS,) * 40


def test_a_server_that_will_not_evict_is_reported_at_start(
    redis_server_factory, caplog: pytest.LogCaptureFixture
) -> None:
    unlimited: RedisServer = redis_server_factory()
    evicting: RedisServer = redis_server_factory(
        "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lfu"
    )
    with caplog.at_level(logging.WARNING, logger="kvstore.store.core"):
        with TieredStore(kv.config(kv.dram(4), kv.redis(unlimited.url))):
            pass
        warned = caplog.text
        caplog.clear()
        with TieredStore(kv.config(kv.dram(4), kv.redis(evicting.url))):
            pass
    assert "maxmemory is not set" in warned and "maxmemory-policy noeviction" in warned
    assert "maxmemory" not in caplog.text
    # Write-back keeps the tier within its own capacity: nothing to check on the server.
    caplog.clear()
    back = kv.config(kv.dram(4), kv.redis(unlimited.url, write="back"))
    with caplog.at_level(logging.WARNING, logger="kvstore.store.core"), TieredStore(back):
        pass
    assert "maxmemory" not in caplog.text


def test_write_mode_settings(tmp_path) -> None:
    assert tier_config("redis", {"url": "redis://h:1"}, tmp_path).write == "through"
    assert tier_config("redis", {"url": "redis://h:1", "write": "back"}, tmp_path).write == "back"
    assert tier_config("dram", {}, tmp_path).write == "back"
    with pytest.raises(ConfigError, match="for a shared tier"):
        tier_config("dram", {"write": "through"}, tmp_path)
    with pytest.raises(ConfigError, match="write must be one of"):
        tier_config("redis", {"url": "redis://h:1", "write": "around"}, tmp_path)
    with pytest.raises(ConfigError, match="write_queue"):
        tier_config("redis", {"url": "redis://h:1", "write_queue": 0}, tmp_path)


def test_a_shared_miss_is_remembered_for_a_moment(clean_redis: RedisServer) -> None:
    ns = kv.namespace()
    config = kv.config(kv.dram(16), kv.redis(clean_redis.url))
    with TieredStore(config) as host_a, TieredStore(config) as host_b:
        tier = host_b.tier(REDIS)
        asked = []
        contains = tier.contains_many

        def counted(namespace: bytes, keys: list) -> list[bool]:
            asked.append(len(keys))
            return contains(namespace, keys)

        tier.contains_many = counted  # type: ignore[method-assign]
        assert host_b.lookup(ns, kv.tokens(4)).num_chunks == 0
        assert host_b.lookup(ns, kv.tokens(4)).num_chunks == 0
        assert asked == [4]  # the second lookup knew the answer
        host_a.put(ns, kv.tokens(4), kv.chunks(4))
        kv.written_through(host_a)
        time.sleep(host_b.config.shared_miss_ttl_s)
        assert host_b.lookup(ns, kv.tokens(4)).tiers == (REDIS,) * 4
        assert asked == [4, 4]
        # Its own put is never hidden by what it remembered.
        host_b.lookup(ns, kv.tokens(2, start=500))
        host_b.put(ns, kv.tokens(2, start=500), kv.chunks(2))
        assert host_b.lookup(ns, kv.tokens(2, start=500)).tiers == (DRAM,) * 2
