"""``GuardedTier``: a failing tier must read as a miss and be counted, while ``TierFull``
still reaches admission (which answers it by evicting)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from support import kv

from kvstore.block import HEADER_BYTES, Block, encode_block
from kvstore.errors import TierFull
from kvstore.keys import ChunkKey, chunk_keys
from kvstore.kinds import TierKind
from kvstore.store.guarded import GuardedTier
from kvstore.store.stats import StoreStats
from kvstore.tiers.base import BlockDestination, StoredBlockInfo
from kvstore.tiers.dram import DRAMTier
from kvstore.tiers.lmdb_tier import LMDBTier

NS = kv.namespace()
KEYS = chunk_keys(NS, kv.tokens(4))
BLOCK_BYTES = HEADER_BYTES + kv.LAYOUT.chunk_nbytes


def block(index: int) -> Block:
    payload = bytes([index + 1]) * kv.LAYOUT.chunk_nbytes
    parent = KEYS[index - 1] if index else None
    return encode_block(NS, KEYS[index], parent, memoryview(payload))


@pytest.fixture
def stats() -> StoreStats:
    return StoreStats()


@pytest.fixture
def ssd(tmp_path: Path, stats: StoreStats) -> Iterator[GuardedTier]:
    tier = LMDBTier(tmp_path / "lmdb", 1 << 20, sync=False)
    yield GuardedTier(tier, stats.tier(TierKind.SSD), threading.RLock())
    tier.close()


@pytest.fixture
def dram(stats: StoreStats) -> Iterator[GuardedTier]:
    tier = DRAMTier(2 * kv.ARENA_SLOT)
    yield GuardedTier(tier, stats.tier(TierKind.DRAM), threading.RLock())
    tier.close()


def test_mirrors_the_tier_it_wraps(ssd: GuardedTier, dram: GuardedTier) -> None:
    assert (ssd.kind, ssd.verifies_reads) == (TierKind.SSD, True)
    assert (dram.kind, dram.verifies_reads) == (TierKind.DRAM, False)
    assert ssd.capacity_bytes() == 1 << 20
    assert dram.capacity_bytes() == 2 * kv.ARENA_SLOT


def test_a_healthy_tier_answers_through_the_guard(ssd: GuardedTier, stats: StoreStats) -> None:
    assert ssd.put_many(NS.digest, [(KEYS[0], block(0)), (KEYS[1], block(1))]) is True
    found = ssd.get_many(NS.digest, [KEYS[0], KEYS[2], KEYS[1]])
    assert found == [block(0).to_bytes(), None, block(1).to_bytes()]
    assert ssd.contains_many(NS.digest, KEYS[:3]) == [True, True, False]
    assert ssd.used_bytes() == 2 * BLOCK_BYTES
    assert ssd.delete_many(NS.digest, [KEYS[0], KEYS[3]]) == 1
    assert ssd.contains_many(NS.digest, KEYS[:2]) == [False, True]
    assert stats.tier(TierKind.SSD).errors == 0


def test_scan_is_materialised_as_a_list(ssd: GuardedTier) -> None:
    ssd.put_many(NS.digest, [(KEYS[2], block(2))])
    infos = ssd.scan()
    assert isinstance(infos, list)
    assert infos == [StoredBlockInfo(NS.digest, KEYS[2], BLOCK_BYTES, block(2).header)]


def test_get_many_into_copies_into_the_callers_buffers(dram: GuardedTier) -> None:
    dram.put_many(NS.digest, [(KEYS[0], block(0))])
    headers = np.zeros((2, HEADER_BYTES), dtype=np.uint8)
    payloads = np.zeros((2, kv.LAYOUT.chunk_nbytes), dtype=np.uint8)
    destinations = [BlockDestination(headers[i], payloads[i]) for i in range(2)]
    assert dram.get_many_into(NS.digest, [KEYS[0], KEYS[1]], destinations) == [True, False]
    assert headers[0].tobytes() == block(0).header
    assert payloads[0].tobytes() == bytes([1]) * kv.LAYOUT.chunk_nbytes


def test_a_stopped_backend_is_nothing_its_first_failure_trips_the_breaker(
    ssd: GuardedTier, stats: StoreStats
) -> None:
    """One call pays for learning that the backend is down; the breaker answers the
    rest without it."""
    ssd.put_many(NS.digest, [(KEYS[0], block(0))])
    ssd.tier.close()  # the LMDB environment is gone: every call raises TierUnavailable
    destination = BlockDestination(
        np.zeros(HEADER_BYTES, dtype=np.uint8), np.zeros(kv.LAYOUT.chunk_nbytes, dtype=np.uint8)
    )
    assert ssd.get_many(NS.digest, [KEYS[0]]) is None
    assert ssd.get_many_into(NS.digest, [KEYS[0]], [destination]) is None
    assert ssd.contains_many(NS.digest, [KEYS[0]]) is None
    assert ssd.scan() is None
    assert ssd.delete_many(NS.digest, [KEYS[0]]) == 0
    assert ssd.used_bytes() == 0
    assert ssd.put_many(NS.digest, [(KEYS[1], block(1))]) is False
    counters = stats.tier(TierKind.SSD)
    assert (counters.errors, counters.calls_refused, ssd.breaker.trips) == (1, 6, 1)
    assert ssd.capacity_bytes() == 1 << 20  # answered without the backend, not an error
    assert (counters.errors, counters.calls_refused) == (1, 6)


def test_errors_count_against_the_wrapped_tier_only(
    ssd: GuardedTier, dram: GuardedTier, stats: StoreStats
) -> None:
    dram.close()
    assert dram.get_many(NS.digest, [KEYS[0]]) is None
    assert dram.contains_many(NS.digest, [KEYS[0]]) is None
    assert (stats.tier(TierKind.DRAM).errors, stats.tier(TierKind.SSD).errors) == (2, 0)


def test_a_failure_while_the_caller_holds_the_store_lock_is_counted(stats: StoreStats) -> None:
    lock = threading.RLock()
    tier = DRAMTier(kv.ARENA_SLOT)
    guarded = GuardedTier(tier, stats.tier(TierKind.DRAM), lock)
    tier.close()
    with lock:  # the store calls tiers with its lock held; counting must not deadlock
        assert guarded.put_many(NS.digest, [(KEYS[0], block(0))]) is False
    assert stats.tier(TierKind.DRAM).errors == 1


def test_tier_full_propagates_uncounted_and_stores_nothing(
    dram: GuardedTier, stats: StoreStats
) -> None:
    assert dram.put_many(NS.digest, [(KEYS[0], block(0)), (KEYS[1], block(1))]) is True
    with pytest.raises(TierFull):
        dram.put_many(NS.digest, [(KEYS[2], block(2))])
    assert dram.delete_many(NS.digest, [KEYS[0]]) == 1
    with pytest.raises(TierFull):  # all or nothing: a batch too big stores none of it
        dram.put_many(NS.digest, [(KEYS[2], block(2)), (KEYS[3], block(3))])
    assert dram.contains_many(NS.digest, KEYS) == [False, True, False, False]
    assert dram.used_bytes() == kv.ARENA_SLOT
    assert stats.tier(TierKind.DRAM).errors == 0


def test_a_bug_is_not_swallowed_as_a_tier_failure(ssd: GuardedTier, stats: StoreStats) -> None:
    short_key = ChunkKey(b"short")  # LMDB refuses it with ValueError, not a TierError
    with pytest.raises(ValueError):
        ssd.get_many(NS.digest, [short_key])
    with pytest.raises(ValueError):
        ssd.put_many(NS.digest, [(short_key, block(0))])
    assert stats.tier(TierKind.SSD).errors == 0


def test_close_closes_the_tier_so_later_calls_are_counted_failures(
    dram: GuardedTier, stats: StoreStats
) -> None:
    dram.put_many(NS.digest, [(KEYS[0], block(0))])
    dram.close()
    dram.close()  # idempotent, as the protocol requires
    assert dram.get_many(NS.digest, [KEYS[0]]) is None
    assert stats.tier(TierKind.DRAM).errors == 1
