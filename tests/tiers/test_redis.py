"""RedisTier against real redis-server processes (no fakes, no mocks).

Standalone tests share the session server (flushed per test, ``clean_redis``);
tests that stop, pause or fill Redis get a private server of their own.
Cluster tests run against three local masters (``clean_redis_cluster``).
Credentials and TLS are ``test_redis_access.py``'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from support.redis_tiers import CAPACITY, NS, OTHER_NS, MakeTier, make_blocks, redis_key

from kvstore.block import Block, check_identity, verify_block
from kvstore.errors import ConfigError, TierFull, TierRefused, TierUnavailable
from kvstore.keys import ChunkKey, KVLayout, Namespace
from kvstore.kinds import TierKind
from kvstore.local.processes import free_port
from kvstore.local.redis_cluster import RedisCluster
from kvstore.local.redis_server import RedisServer
from kvstore.tiers.base import Buffer, Tier
from kvstore.tiers.redis_tier import RedisTier


def integer_reply(reply: bytes) -> int:
    assert reply.startswith(b":"), reply
    return int(reply[1:].strip())


# ------------------------------------------------------------------ standalone


def test_is_a_tier(clean_redis: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(clean_redis.url)
    assert isinstance(tier, Tier)
    assert tier.kind is TierKind.REDIS
    assert tier.verifies_reads is True
    assert tier.capacity_bytes() == CAPACITY


def test_batch_round_trip_is_bit_for_bit(clean_redis: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(clean_redis.url)
    items = make_blocks(NS, 32)
    tier.put_many(NS.digest, items)

    values = tier.get_many(NS.digest, [key for key, _ in items])

    assert len(values) == len(items)
    for (key, block), value in zip(items, values, strict=True):
        assert value is not None
        assert bytes(value) == block.to_bytes()
        check_identity(verify_block(value), NS, key)


def test_misses_are_none_and_aligned(clean_redis: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(clean_redis.url)
    items = make_blocks(NS, 6)
    stored = items[::2]
    tier.put_many(NS.digest, stored)

    values = tier.get_many(NS.digest, [key for key, _ in items])

    assert [value is not None for value in values] == [True, False] * 3
    assert tier.get_many(NS.digest, []) == []
    assert tier.contains_many(NS.digest, []) == []
    assert tier.delete_many(NS.digest, []) == 0
    tier.put_many(NS.digest, [])


def test_contains_delete_and_accounting(clean_redis: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(clean_redis.url)
    items = make_blocks(NS, 10)
    keys = [key for key, _ in items]
    block_bytes = items[0][1].nbytes
    assert tier.used_bytes() == 0

    tier.put_many(NS.digest, items)
    tier.put_many(NS.digest, items[:3])  # rewriting the same blocks is not double counted
    assert tier.used_bytes() == 10 * block_bytes
    assert tier.contains_many(NS.digest, keys) == [True] * 10

    assert tier.delete_many(NS.digest, keys[:4]) == 4
    assert tier.delete_many(NS.digest, keys[:4]) == 0
    assert tier.contains_many(NS.digest, keys) == [False] * 4 + [True] * 6
    assert tier.used_bytes() == 6 * block_bytes

    # The server dropped a key behind our back (eviction, TTL, another process):
    # the next miss on it corrects the accounting.
    clean_redis.command("DEL", redis_key(NS, keys[4]))
    assert tier.get_many(NS.digest, [keys[4]]) == [None]
    assert tier.used_bytes() == 5 * block_bytes


def test_namespaces_are_scoped(clean_redis: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(clean_redis.url)
    items = make_blocks(NS, 4)
    keys = [key for key, _ in items]
    tier.put_many(NS.digest, items)

    # The same chunk keys under another namespace digest are other Redis keys.
    assert tier.get_many(OTHER_NS.digest, keys) == [None] * 4
    assert tier.contains_many(OTHER_NS.digest, keys) == [False] * 4
    assert tier.delete_many(OTHER_NS.digest, keys) == 0
    assert tier.contains_many(NS.digest, keys) == [True] * 4
    assert integer_reply(clean_redis.command("EXISTS", redis_key(NS, keys[0]))) == 1


def test_ttl_is_set_when_configured(clean_redis: RedisServer, make_tier: MakeTier) -> None:
    with_ttl = make_tier(clean_redis.url, ttl_s=60)
    without_ttl = make_tier(clean_redis.url, key_prefix="plain")
    (key, block), (key2, block2) = make_blocks(NS, 2)
    with_ttl.put_many(NS.digest, [(key, block)])
    without_ttl.put_many(NS.digest, [(key2, block2)])

    assert 0 < integer_reply(clean_redis.command("PTTL", redis_key(NS, key))) <= 60_000
    assert integer_reply(clean_redis.command("PTTL", redis_key(NS, key2, "plain"))) == -1


def test_scan_finds_what_was_put(clean_redis: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(clean_redis.url)
    mine = make_blocks(NS, 300)  # more than one SCAN/pipeline batch
    theirs = make_blocks(OTHER_NS, 5, seed=1)
    tier.put_many(NS.digest, mine)
    tier.put_many(OTHER_NS.digest, theirs)
    clean_redis.command("SET", "kvs:not-a-block", "x")  # under our prefix, not our shape
    clean_redis.command("SET", "elsewhere:key", "x")  # another application's key

    found = {(info.namespace, info.key): info for info in tier.scan()}

    expected = [(NS.digest, k, b) for k, b in mine] + [(OTHER_NS.digest, k, b) for k, b in theirs]
    assert set(found) == {(ns, key) for ns, key, _ in expected}
    for ns, key, block in expected:
        assert found[(ns, key)].nbytes == block.nbytes
        assert found[(ns, key)].header == block.header

    # A fresh process rebuilds its accounting by scanning.
    fresh = make_tier(clean_redis.url)
    assert fresh.used_bytes() == 0
    assert len(list(fresh.scan())) == len(expected)
    assert fresh.used_bytes() == tier.used_bytes() == sum(b.nbytes for _, _, b in expected)


def test_foreign_value_type_is_a_miss(clean_redis: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(clean_redis.url)
    (key, block), (key2, _) = make_blocks(NS, 2)
    tier.put_many(NS.digest, [(key, block)])
    clean_redis.command("HSET", redis_key(NS, key2), "field", "value")

    values = tier.get_many(NS.digest, [key, key2])

    assert values[0] == block.to_bytes()
    assert values[1] is None


def test_concurrent_threads_share_one_tier(clean_redis: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(clean_redis.url, max_connections=4)
    batches = [make_blocks(NS, 8, seed=seed) for seed in range(8)]
    errors: list[BaseException] = []

    def worker(items: list[tuple[ChunkKey, Block]]) -> None:
        try:
            for _ in range(5):
                tier.put_many(NS.digest, items)
                values = tier.get_many(NS.digest, [key for key, _ in items])
                assert [bytes(v) for v in values if v is not None] == [
                    b.to_bytes() for _, b in items
                ]
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(batch,)) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert tier.used_bytes() == sum(b.nbytes for batch in batches for _, b in batch)


def test_close_is_idempotent(clean_redis: RedisServer) -> None:
    tier = RedisTier(clean_redis.url, CAPACITY)
    tier.put_many(NS.digest, make_blocks(NS, 1))
    tier.close()
    tier.close()
    with pytest.raises(TierUnavailable):
        tier.get_many(NS.digest, [make_blocks(NS, 1)[0][0]])


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError):
        RedisTier("redis://127.0.0.1:1/0", 0)
    with pytest.raises(ConfigError):
        RedisTier(["127.0.0.1:1", "127.0.0.1:2"], CAPACITY)
    with pytest.raises(ConfigError):
        RedisTier("redis://127.0.0.1:1/0", CAPACITY, key_prefix="a*")
    with pytest.raises(ConfigError):
        RedisTier("redis://127.0.0.1:1/0", CAPACITY, ttl_s=0)


TIMEOUT_S = 0.5
BOUND_S = TIMEOUT_S + TIMEOUT_S + 1.0  # connect + socket timeout + margin


def assert_unavailable_quickly(call: Callable[[], object]) -> None:
    start = time.monotonic()
    with pytest.raises(TierUnavailable):
        call()
    assert time.monotonic() - start < BOUND_S


def test_redis_stopped_mid_test_then_back(
    redis_server_factory: Callable[..., RedisServer], make_tier: MakeTier
) -> None:
    server = redis_server_factory()
    tier = make_tier(server.url, socket_timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S)
    items = make_blocks(NS, 4)
    keys = [key for key, _ in items]
    tier.put_many(NS.digest, items)  # the pool now holds a live connection

    server.stop()
    assert_unavailable_quickly(lambda: tier.get_many(NS.digest, keys))
    assert_unavailable_quickly(lambda: tier.put_many(NS.digest, items))
    assert_unavailable_quickly(lambda: tier.contains_many(NS.digest, keys))
    assert_unavailable_quickly(lambda: tier.delete_many(NS.digest, keys))

    server.start()  # same port, empty (no persistence)
    assert tier.get_many(NS.digest, keys) == [None] * 4
    tier.put_many(NS.digest, items)
    assert [bytes(v) for v in tier.get_many(NS.digest, keys) if v is not None] == [
        b.to_bytes() for _, b in items
    ]


def test_hung_redis_times_out_then_recovers(
    redis_server_factory: Callable[..., RedisServer], make_tier: MakeTier
) -> None:
    server = redis_server_factory()
    tier = make_tier(server.url, socket_timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S)
    items = make_blocks(NS, 4)
    keys = [key for key, _ in items]
    tier.put_many(NS.digest, items)

    server.pause()  # accepts connections, never answers
    try:
        assert_unavailable_quickly(lambda: tier.get_many(NS.digest, keys))
        assert_unavailable_quickly(lambda: tier.put_many(NS.digest, items))
    finally:
        server.resume()

    assert tier.contains_many(NS.digest, keys) == [True] * 4


def test_oom_under_noeviction_is_tier_full(
    redis_server_factory: Callable[..., RedisServer], make_tier: MakeTier
) -> None:
    server = redis_server_factory("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    tier = make_tier(server.url)
    big = Namespace("big-model", KVLayout(4, 8, 128, dtype="float16", chunk_tokens=16))
    items = make_blocks(big, 24)  # 256 KiB blocks, 6 MiB in all
    keys = [key for key, _ in items]

    with pytest.raises(TierFull):
        for start in range(0, len(items), 4):
            tier.put_many(big.digest, items[start : start + 4])

    # Reads still work under OOM, and only the accepted blocks are accounted.
    present = tier.contains_many(big.digest, keys)
    assert 0 < sum(present) < len(items)
    assert tier.used_bytes() == sum(b.nbytes for (_, b), p in zip(items, present, strict=True) if p)
    first = tier.get_many(big.digest, keys[:1])[0]
    assert first is not None and bytes(first) == items[0][1].to_bytes()


def test_unreachable_cluster_is_unavailable_not_a_failed_start() -> None:
    port = free_port(cluster_bus=True)
    tier = RedisTier([f"127.0.0.1:{port}"], CAPACITY, cluster=True)  # connects lazily
    try:
        assert_unavailable_quickly(lambda: tier.get_many(NS.digest, [ChunkKey(bytes(16))]))
    finally:
        tier.close()


# ------------------------------------------------------------------ cluster


@pytest.mark.cluster
def test_cluster_round_trip_spreads_over_masters(
    clean_redis_cluster: RedisCluster, make_tier: MakeTier
) -> None:
    tier = make_tier(clean_redis_cluster.startup_nodes, cluster=True)
    items = make_blocks(NS, 48)
    keys = [key for key, _ in items]

    tier.put_many(NS.digest, items)

    owners = {clean_redis_cluster.port_for_key(redis_key(NS, key)) for key in keys}
    assert owners == set(clean_redis_cluster.ports)
    for node in clean_redis_cluster.nodes:
        assert integer_reply(node.command("DBSIZE")) > 0
    values = tier.get_many(NS.digest, keys)
    for (key, block), value in zip(items, values, strict=True):
        assert value is not None and bytes(value) == block.to_bytes()
        check_identity(verify_block(value), NS, key)
    assert tier.get_many(OTHER_NS.digest, keys[:3]) == [None] * 3


@pytest.mark.cluster
def test_cluster_contains_delete_scan(
    clean_redis_cluster: RedisCluster, make_tier: MakeTier
) -> None:
    tier = make_tier(clean_redis_cluster.startup_nodes, cluster=True, ttl_s=300)
    items = make_blocks(NS, 40, seed=3)
    keys = [key for key, _ in items]
    tier.put_many(NS.digest, items)

    assert tier.contains_many(NS.digest, keys) == [True] * 40
    found = {info.key: info for info in tier.scan()}
    assert set(found) == set(keys)
    assert all(found[k].header == b.header and found[k].nbytes == b.nbytes for k, b in items)

    assert tier.delete_many(NS.digest, keys[:25]) == 25
    assert tier.contains_many(NS.digest, keys) == [False] * 25 + [True] * 15
    assert {info.key for info in tier.scan()} == set(keys[25:])
    assert tier.used_bytes() == sum(b.nbytes for _, b in items[25:])


def served_exactly(
    values: list[Buffer | None], items: list[tuple[ChunkKey, Block]], lost: list[bool]
) -> bool:
    """Every key on a lost master is a miss; every other one is its block, byte for byte."""
    expected = [None if gone else b.to_bytes() for (_, b), gone in zip(items, lost, strict=True)]
    return [None if v is None else bytes(v) for v in values] == expected


@pytest.mark.cluster
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_cluster_batch_degrades_per_master(
    clean_redis_cluster: RedisCluster,
    make_tier: MakeTier,
    caplog: pytest.LogCaptureFixture,
    fault: str,
) -> None:
    """A batch touching one dead (SIGKILL) or hung (SIGSTOP) master still serves the
    healthy masters' keys. The first failure opens that master's breaker: later batches
    skip it without a round trip, so only the first pays a timeout; it is logged once
    when it fails and once when it is back."""
    tier = make_tier(
        clean_redis_cluster.startup_nodes,
        cluster=True,
        socket_timeout_s=TIMEOUT_S,
        connect_timeout_s=TIMEOUT_S,
    )
    items = make_blocks(NS, 30, seed=4)
    keys = [key for key, _ in items]
    tier.put_many(NS.digest, items)
    victim = clean_redis_cluster.nodes[1]
    victim_name = f"127.0.0.1:{victim.port}"
    lost = [clean_redis_cluster.port_for_key(redis_key(NS, k)) == victim.port for k in keys]
    assert 3 < sum(lost) < len(keys) - 3
    fresh = make_blocks(NS, 30, seed=40)
    fresh_lost = [
        clean_redis_cluster.port_for_key(redis_key(NS, k)) == victim.port for k, _ in fresh
    ]
    victim_only = [key for key, gone in zip(keys, lost, strict=True) if gone]

    batches = 3  # a bounded fault loop
    victim.kill() if fault == "killed" else victim.pause()
    try:
        with caplog.at_level("INFO", logger="kvstore.breaker"):
            took = []
            for _ in range(batches):
                start = time.monotonic()
                assert served_exactly(tier.get_many(NS.digest, keys), items, lost)
                took.append(time.monotonic() - start)
            assert took[0] < BOUND_S and max(took[1:]) < 0.25  # the breaker answers for it
            assert tier.contains_many(NS.digest, keys) == [not gone for gone in lost]
            with pytest.raises(TierRefused, match=victim_name):
                tier.put_many(NS.digest, fresh)  # ...but the healthy masters took theirs
            assert served_exactly(
                tier.get_many(NS.digest, [k for k, _ in fresh]), fresh, fresh_lost
            )
            # A batch on the lost master alone: misses, the others being up.
            assert tier.get_many(NS.digest, victim_only) == [None] * len(victim_only)
            assert tier.unreachable_nodes() == {victim_name}
            assert tier.node_failures == 1
            warnings = [r for r in caplog.records if r.levelname == "WARNING"]
            assert len(warnings) == 1 and victim_name in warnings[0].getMessage()
    finally:
        victim.resume() if fault == "hung" else clean_redis_cluster.start()

    # Back: a killed master rejoins empty (no persistence), a resumed one as it was.
    with caplog.at_level("INFO", logger="kvstore.breaker"):
        deadline = time.monotonic() + 15
        while tier.unreachable_nodes() and time.monotonic() < deadline:
            time.sleep(0.05)  # the breaker's probe finds it back
        values = tier.get_many(NS.digest, keys)
    assert served_exactly(values, items, lost if fault == "killed" else [False] * len(keys))
    assert tier.unreachable_nodes() == frozenset()
    assert any("answers again" in r.getMessage() for r in caplog.records)
    tier.put_many(NS.digest, items)
    assert served_exactly(tier.get_many(NS.digest, keys), items, [False] * len(keys))


@pytest.mark.cluster
def test_cluster_serves_a_dead_masters_slots_from_its_promoted_replica(
    tmp_path, make_tier: MakeTier
) -> None:
    """A master's breaker, open since it died, must find its replica promoted: the
    probe reads the slot map again, and the keys it held (replicated before the kill)
    are served by their new master. Without that nothing would send a batch there to
    be answered MOVED, and the keys would stay misses until the dead address came back."""
    with RedisCluster(
        tmp_path / "cluster",
        replicas=1,
        node_timeout_ms=1000,
        extra_args=("--cluster-require-full-coverage", "no"),
    ) as cluster:  # fmt: skip
        tier = make_tier(
            cluster.startup_nodes,
            cluster=True,
            socket_timeout_s=TIMEOUT_S,
            connect_timeout_s=TIMEOUT_S,
        )
        items = make_blocks(NS, 30, seed=6)
        keys = [key for key, _ in items]
        tier.put_many(NS.digest, items)
        victim = cluster.masters()[0]
        held = [cluster.port_for_key(redis_key(NS, k)) == victim.port for k in keys]
        assert any(held)
        cluster.wait_replicated(victim)  # what the kill must not lose
        killed = time.monotonic()
        cluster.fail_over(victim)
        first = tier.get_many(NS.digest, keys)  # the dead address fails: its breaker opens
        expected = [b.to_bytes() for _, b in items]
        assert all(v is None or bytes(v) == e for v, e in zip(first, expected, strict=True))
        assert all(v is not None for v, gone in zip(first, held, strict=True) if not gone)
        deadline = killed + 30
        while [None if v is None else bytes(v) for v in tier.get_many(NS.digest, keys)] != expected:
            assert time.monotonic() < deadline, "the promoted replica's keys never came back"
            time.sleep(0.1)
        assert tier.contains_many(NS.digest, keys) == [True] * len(keys)


@pytest.mark.cluster
def test_local_cluster_waits_until_the_replica_has_the_writes(tmp_path) -> None:
    """The failover tests kill a master only once its replica holds what it wrote;
    ``WAIT`` on a fresh connection would have answered at once, replica stopped or not."""
    with RedisCluster(tmp_path / "cluster", replicas=1) as cluster:
        master = cluster.masters()[0]
        replica = cluster.replica_of(master)
        key = next(
            k
            for k in (f"k{i}".encode() for i in range(1000))
            if cluster.port_for_key(k) == master.port
        )
        replica.pause()
        try:
            assert master.command("SET", key, "1").startswith(b"+OK")
            assert master.command("WAIT", "1", "100").strip() == b":1"  # says nothing
            with pytest.raises(TierUnavailable, match="fell behind"):
                cluster.wait_replicated(master, timeout_s=1.5)
        finally:
            replica.resume()
        cluster.wait_replicated(master)
        assert replica.command("DBSIZE").strip() == b":1"


@pytest.mark.cluster
def test_cluster_follows_ask_and_moved_during_resharding(
    clean_redis_cluster: RedisCluster, make_tier: MakeTier
) -> None:
    tier = make_tier(clean_redis_cluster.startup_nodes, cluster=True)
    items = make_blocks(NS, 12, seed=5)
    keys = [key for key, _ in items]
    tier.put_many(NS.digest, items)
    expected = [b.to_bytes() for _, b in items]
    moving = redis_key(NS, keys[0])
    slot = clean_redis_cluster.keyslot(moving)
    in_slot = [
        redis_key(NS, k) for k in keys if clean_redis_cluster.keyslot(redis_key(NS, k)) == slot
    ]
    source = clean_redis_cluster.port_for_key(moving)
    target = next(port for port in clean_redis_cluster.ports if port != source)

    finish = clean_redis_cluster.migrate_slot(slot, in_slot, target)
    try:
        # Keys migrated, slot still owned by the source: it answers ASK.
        assert [bytes(v) for v in tier.get_many(NS.digest, keys) if v is not None] == expected
    finally:
        finish()
    # Slot reassigned, the client's map is stale: the source answers MOVED.
    assert clean_redis_cluster.port_for_key(moving) == target
    assert [bytes(v) for v in tier.get_many(NS.digest, keys) if v is not None] == expected
    assert tier.contains_many(NS.digest, keys) == [True] * 12
    assert tier.delete_many(NS.digest, keys) == 12


def test_after_a_half_open_link_the_next_call_opens_a_fresh_connection(
    clean_redis: RedisServer, make_tier: MakeTier
) -> None:
    """Every pooled socket that a half-open link black-holed is dropped at the first
    timeout, so once the network is back each call is answered at once, rather than one
    timeout per dead socket still in the pool (a real redis-server behind the project's
    fault proxy)."""
    from faults.proxy import Fault, FaultProxy

    with FaultProxy(clean_redis.port) as proxy:
        tier = make_tier(
            f"redis://127.0.0.1:{proxy.port}", socket_timeout_s=0.5, connect_timeout_s=0.5
        )
        items = make_blocks(NS, 4, seed=9)
        tier.put_many(NS.digest, items)
        keys = [key for key, _ in items]
        expected = [block.to_bytes() for _, block in items]

        def read_at_once(readers: int) -> list[tuple[bool, float]]:
            """``readers`` gets at the same moment (each on a pooled socket of its own):
            whether each was right, and how long it took."""
            gate = threading.Barrier(readers)
            done: list[tuple[bool, float]] = []

            def read() -> None:
                gate.wait()
                started = time.monotonic()
                try:
                    right = tier.get_many(NS.digest, keys) == expected
                except TierUnavailable:
                    right = False
                done.append((right, time.monotonic() - started))

            threads = [threading.Thread(target=read) for _ in range(readers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            return done

        assert all(right for right, _ in read_at_once(4))  # four sockets in the pool
        proxy.set(Fault.HALF_OPEN)  # every one of them is now a dead link
        with pytest.raises(TierUnavailable):
            tier.get_many(NS.digest, keys)
        proxy.clear()
        after = read_at_once(4)
        assert all(right for right, _ in after), after
        assert max(took for _, took in after) < 0.3, after
