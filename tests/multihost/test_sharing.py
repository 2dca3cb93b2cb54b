"""Hosts share one cache through the Redis Cluster: what one host puts another reads,
byte for byte, within a bound; a tenant's salt keeps its chunks to that tenant on
every host; and one host filling the cluster leaves another reading right or
missing, never wrong and never failing.

Each daemon runs in a network namespace of its own (``support/netns.py``) and
reaches the cluster only across the bridge (``support/hosts.py``).
"""

from __future__ import annotations

import time

import pytest
from support.daemon import Daemon
from support.hosts import (
    CHAIN_CHUNKS,
    LAYOUT,
    VISIBLE_WITHIN_S,
    ReadLoop,
    all_keys,
    connected,
    degraded_calls,
    make_chains,
    put_chains,
    reading,
    shared_chains,
    wait_visible,
    wrong_chunks,
)

from kvstore.client.failures import ClientStats
from kvstore.keys import KVLayout, Namespace
from kvstore.kinds import TierKind
from kvstore.local.redis_cluster import RedisCluster

pytestmark = pytest.mark.cluster

# 32 KiB chunks, so that filling the cluster takes a few hundred of them.
FILL_LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", chunk_tokens=16)
HEADROOM_BYTES = 1 << 20  # each master's maxmemory: what it uses empty, and this
FILL_CHAINS = 200  # x 4 x 32 KiB = 25 MiB, about eight times what the masters take
FILL_WITHIN_S = 30.0


def test_what_one_host_puts_another_reads_byte_for_byte(
    hosts: list[Daemon], namespace: Namespace
) -> None:
    chains = make_chains(namespace, 8, seed=1)
    with connected(*hosts[:2]) as (on_a, on_b):
        put_chains(on_a, namespace, chains)
        seconds = wait_visible(on_b, namespace, chains)
        print(f"\nA's puts read back on B after {seconds:.3f} s")
        assert seconds < VISIBLE_WITHIN_S
        for chain in chains:
            prefix = on_b.lookup(namespace, chain.tokens)
            assert prefix.num_chunks == CHAIN_CHUNKS
            assert set(prefix.tiers) == {TierKind.REDIS}  # B holds none of it itself
        got = on_b.get(namespace, all_keys(chains))
        assert wrong_chunks(chains, got) == 0
        assert {chunk.tier for chunk in got if chunk is not None} == {TierKind.REDIS}
        assert on_b.client_stats() == on_a.client_stats() == ClientStats()  # none degraded


def test_a_tenant_salt_keeps_chunks_to_its_tenant_on_every_host(
    hosts: list[Daemon], request: pytest.FixtureRequest
) -> None:
    """A and B serve tenant X, C tenant Y; all three see the same tokens. B finds what A
    put; C finds none of it, not even by A's keys, and its own puts of the same tokens
    are chunks of its own that X never reads."""
    tenant_x = Namespace("multihost", LAYOUT, tenant_salt=f"{request.node.name}-x")
    tenant_y = Namespace("multihost", LAYOUT, tenant_salt=f"{request.node.name}-y")
    y_chains = make_chains(tenant_y, 6, seed=2, payload_seed=3)  # X's tokens, other bytes
    with connected(*hosts) as (on_a, on_b, on_c):
        # The same salt on another host: shared.
        x_chains = shared_chains(on_a, on_b, tenant_x, 6, seed=2)
        for chain in x_chains:
            assert on_c.lookup(tenant_y, chain.tokens).num_chunks == 0
        assert on_c.get(tenant_y, all_keys(x_chains)) == [None] * len(all_keys(x_chains))
        put_chains(on_c, tenant_y, y_chains)
        wait_visible(on_a, tenant_y, y_chains)  # Y's own chunks, as C put them...
        got = on_b.get(tenant_x, all_keys(x_chains))  # ...and X still reads X's
        assert all(chunk is not None for chunk in got)
        assert wrong_chunks(x_chains, got) == 0


def _fill_limits(cluster: RedisCluster) -> None:
    """Each master's ``maxmemory``: what it uses now and ``HEADROOM_BYTES`` more."""
    for master in cluster.masters():
        info = master.command("INFO", "memory").decode()
        used = int(info.split("used_memory:")[1].split()[0])
        reply = master.command("CONFIG", "SET", "maxmemory", str(used + HEADROOM_BYTES))
        assert reply.startswith(b"+OK"), reply


def _evicted(cluster: RedisCluster) -> int:
    info = [m.command("INFO", "stats").decode() for m in cluster.masters()]
    return sum(int(text.split("evicted_keys:")[1].split()[0]) for text in info)


def test_one_host_filling_the_cluster_leaves_another_reading_right_or_miss(
    hosts: list[Daemon], shared_cluster: RedisCluster, request: pytest.FixtureRequest
) -> None:
    """The masters hold about 3 MiB between them (``allkeys-lru``); A puts 25 MiB while
    B reads chains A put before. Every chunk B reads is right or a miss; no call on
    either host fails; Redis evicted, it never refused."""
    namespace = Namespace("multihost-fill", FILL_LAYOUT, tenant_salt=request.node.name)
    flood = make_chains(namespace, FILL_CHAINS, seed=5)
    with connected(*hosts[:2]) as (on_a, on_b):
        early = shared_chains(on_a, on_b, namespace, 8, seed=4)
        _fill_limits(shared_cluster)
        started = time.monotonic()
        with reading(ReadLoop(on_b, namespace, early, max_s=FILL_WITHIN_S)) as loop:
            put_chains(on_a, namespace, flood)
            # The write-through goes in order and LRU keeps the newest: once B reads
            # the last chain, A's copies to Redis are all made.
            wait_visible(on_b, namespace, flood[-1:], timeout_s=FILL_WITHIN_S)
        filled_s = time.monotonic() - started
        reads = loop.reads
        flood_got = on_b.get(namespace, all_keys(flood))
        assert degraded_calls(on_a) == degraded_calls(on_b) == 0
        lost = on_b.client_stats().corrupt_blocks
    evicted = _evicted(shared_cluster)
    misses = sum(chunk is None for chunk in flood_got)
    print(
        f"\n{len(flood) * CHAIN_CHUNKS} chunks put and written through in {filled_s:.1f} s, "
        f"Redis evicted {evicted} keys; B: {len(reads)} reads of the early chains meanwhile, "
        f"{sum(r.missed for r in reads)} chunk misses, {lost} blocks evicted between "
        f"B's lookup and its read; of the flood, {misses} misses"
    )
    assert evicted > 0
    assert len(reads) > 1 and not any(read.raised for read in reads)
    assert sum(read.wrong for read in reads) == 0
    assert wrong_chunks(flood, flood_got) == 0
    assert misses > 0  # it did not all fit
