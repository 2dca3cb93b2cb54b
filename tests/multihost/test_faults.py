"""The shared cluster fails under a host that reads from it: a master killed (its
replica takes over), slots migrated between masters, the host's own link cut.

In each, host A put chains that host B then reads in a loop (``ReadLoop``: per
pass, a lookup of one chain and a get of every chain, every byte compared with
what was put) while the fault happens. A miss is allowed where the fault
explains it; a wrong chunk never is, nor a call that raises or that the daemon
failed to answer. The failover and the cut measure how long B's reads took to
hit again after them, and print it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from support.daemon import Daemon
from support.hosts import (
    CONNECT_TIMEOUT_S,
    SOCKET_TIMEOUT_S,
    Read,
    ReadLoop,
    all_keys,
    connected,
    degraded_calls,
    keys_on,
    make_chains,
    put_chains,
    reading,
    recovered_at,
    shared_chains,
    wait_visible,
)
from support.netns import Network

from kvstore.keys import Namespace
from kvstore.local.redis_cluster import RedisCluster

pytestmark = pytest.mark.cluster

CHAINS = 24  # x 4 chunks: some on every master
BASELINE_READS = 5
# A killed master: ~2 s until it is failed, ~1 s until its replica is elected, then the
# per-master breaker's probe finds the new master (0.5 s, doubling: at most 10 s).
FAILOVER_RECOVERY_LIMIT_S = 15.0
# A cut link: each master's share costs its timeouts once, then the breakers answer.
DEGRADE_LIMIT_S = 3 * (SOCKET_TIMEOUT_S + CONNECT_TIMEOUT_S) + 1.0
CUT_S = 4.0
LINK_RECOVERY_LIMIT_S = 15.0
STABLE_S = 1.0  # reads must keep hitting this long to count as recovered
MIGRATED_SLOTS = 1000  # of a master's ~5461: a few of its keys, a few seconds


def _stably_recovered(since: float) -> Callable[[list[Read]], bool]:
    def done(reads: list[Read]) -> bool:
        at = recovered_at(reads, since)
        return at is not None and reads[-1].at - at >= STABLE_S

    return done


def _assert_never_wrong(reads: list[Read]) -> None:
    assert reads, "the read loop read nothing"
    assert sum(read.wrong for read in reads) == 0
    assert not any(read.raised for read in reads)


def test_a_master_killed_under_load_costs_its_keys_misses_never_a_wrong_block(
    own_hosts: list[Daemon], shared_cluster: RedisCluster, namespace: Namespace
) -> None:
    victim = shared_cluster.masters()[0]
    with connected(*own_hosts) as (on_a, on_b):
        chains = shared_chains(on_a, on_b, namespace, CHAINS, seed=10)
        watched = keys_on(shared_cluster, namespace, victim.port, chains)
        assert watched
        loop = ReadLoop(on_b, namespace, chains, watched, max_s=FAILOVER_RECOVERY_LIMIT_S + 15)
        with reading(loop):
            assert loop.wait_for(lambda reads: len(reads) >= BASELINE_READS, 10)
            shared_cluster.wait_replicated(victim)  # the promoted replica has the keys
            killed_at = time.monotonic()
            shared_cluster.fail_over(victim)
            promoted_s = time.monotonic() - killed_at
            loop.wait_for(_stably_recovered(killed_at), FAILOVER_RECOVERY_LIMIT_S)
        assert degraded_calls(on_b) == 0
    reads = loop.reads
    _assert_never_wrong(reads)
    assert all(read.missed == 0 for read in reads if read.at + read.seconds < killed_at)
    # Only the killed master's keys were ever missed: the other masters served throughout.
    assert all(read.missed == read.watched_missed for read in reads)
    recovered = recovered_at(reads, killed_at)
    assert recovered is not None, "the killed master's keys never hit again"
    print(
        f"\nmaster killed: replica promoted after {promoted_s:.2f} s; B reads its "
        f"{len(watched)} chunks again after {recovered - killed_at:.2f} s "
        f"({sum(r.watched_missed > 0 for r in reads)} of {len(reads)} reads missed some)"
    )
    assert recovered - killed_at <= FAILOVER_RECOVERY_LIMIT_S


def test_a_slot_migration_under_load_is_followed_never_a_miss(
    hosts: list[Daemon], shared_cluster: RedisCluster, namespace: Namespace
) -> None:
    """``redis-cli --cluster reshard`` moves slots, with their keys, while B reads and A
    writes: the old owner answers ``ASK`` for a key already moved and ``MOVED`` once
    the slot is gone, and the tier follows both."""
    fresh = make_chains(namespace, CHAINS, seed=12)
    source, target = shared_cluster.masters()[:2]
    with connected(*hosts[:2]) as (on_a, on_b):
        chains = shared_chains(on_a, on_b, namespace, CHAINS, seed=11)
        moving = keys_on(shared_cluster, namespace, source.port, chains)
        loop = ReadLoop(on_b, namespace, chains, max_s=60)
        reshard = threading.Thread(
            target=shared_cluster.reshard, args=(source, target, MIGRATED_SLOTS)
        )
        with reading(loop):
            assert loop.wait_for(lambda reads: len(reads) >= BASELINE_READS, 10)
            started = time.monotonic()
            reshard.start()
            put_chains(on_a, namespace, fresh)  # written through during the move
            reshard.join(timeout=60)
            migrated_s = time.monotonic() - started
            assert not reshard.is_alive()
            loop.wait_for(lambda reads: reads[-1].at > time.monotonic() - 0.5, 5)
        assert degraded_calls(on_a) == degraded_calls(on_b) == 0
        moved = moving - keys_on(shared_cluster, namespace, source.port, chains)
        assert moved <= keys_on(shared_cluster, namespace, target.port, chains)
        wait_visible(on_b, namespace, fresh)
    reads = loop.reads
    during = [read for read in reads if started <= read.at <= started + migrated_s]
    print(
        f"\n{MIGRATED_SLOTS} slots moved in {migrated_s:.2f} s, {len(moved)} of B's "
        f"{len(all_keys(chains))} chunks with them; {len(during)} reads during the move"
    )
    assert moved and during
    _assert_never_wrong(reads)
    assert sum(read.missed for read in reads) == 0


def test_a_host_cut_off_degrades_to_misses_and_recovers(
    hosts: list[Daemon], netns_network: Network, namespace: Namespace
) -> None:
    """B's link is down for ``CUT_S``: its reads turn into misses within a bound (each
    master's timeouts once, then the breakers answer at once), the daemon answers every
    call, and once the link is back the reads hit again within a bound."""
    with connected(*hosts[:2]) as (on_a, on_b):
        chains = shared_chains(on_a, on_b, namespace, CHAINS, seed=13)
        every_key = frozenset(all_keys(chains))
        loop = ReadLoop(on_b, namespace, chains, every_key, max_s=CUT_S + 30)
        with reading(loop):
            assert loop.wait_for(lambda reads: len(reads) >= BASELINE_READS, 10)
            cut_at = time.monotonic()
            with netns_network.hosts[1].cut_off():
                time.sleep(CUT_S)
            restored_at = time.monotonic()
            loop.wait_for(_stably_recovered(restored_at), LINK_RECOVERY_LIMIT_S)
        assert degraded_calls(on_b) == 0  # the daemon answered every call in time
    reads = loop.reads
    _assert_never_wrong(reads)
    # Every read that overlapped the cut, the one it caught in flight included.
    cut = [read for read in reads if read.at + read.seconds > cut_at and read.at < restored_at]
    missed_all = [read for read in cut if read.missed == len(every_key) and read.found == 0]
    assert missed_all, "no lookup and get during the cut missed everything"
    degraded_s = missed_all[0].at + missed_all[0].seconds - cut_at
    recovered = recovered_at(reads, restored_at)
    assert recovered is not None, "B's reads never hit again after the link came back"
    slowest = max(read.seconds for read in cut)
    print(
        f"\nlink cut: B's reads all missed {degraded_s:.2f} s after the cut (slowest read "
        f"{slowest:.2f} s, {len(cut)} reads during the cut); hits again "
        f"{recovered - restored_at:.2f} s after the link came back"
    )
    assert degraded_s <= DEGRADE_LIMIT_S
    assert slowest <= DEGRADE_LIMIT_S
    assert recovered - restored_at <= LINK_RECOVERY_LIMIT_S
