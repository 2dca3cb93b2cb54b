"""Scrub and flush (``kvstore.store.maintenance``) over real tiers."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from support import kv
from support.kv import assert_chunks_equal

from kvstore import TieredStore, TierKind
from kvstore.store.config import StoreConfig

DRAM, SSD = TierKind.DRAM, TierKind.SSD


def test_scrub_finds_memory_corrupted_in_place() -> None:
    from multiprocessing import shared_memory

    from kvstore.tiers.dram import DRAMTier

    with TieredStore(kv.config(kv.dram(4))) as store:
        ns = kv.namespace()
        data = kv.chunks(3)
        store.put(ns, kv.tokens(3), data)
        assert store.scrub() == 0
        tier = store.tier(DRAM)
        assert isinstance(tier, DRAMTier)
        # Another process with the arena mapped scribbles over one payload byte.
        foreign = shared_memory.SharedMemory(name=tier.arena.name)
        try:
            foreign.buf[4096 + 500] ^= 0xFF  # the second block's payload
        finally:
            foreign.close()
        assert store.scrub() == 1
        assert store.stats().tiers[DRAM].corrupt_blocks == 1
        got = store.get(ns, store.keys_for(ns, kv.tokens(3)))
        assert [c is not None for c in got] == [True, False, True]
        assert got[0] is not None and torch.equal(got[0].tensor(), data[0])


def test_background_scrub_runs_and_stops_on_close() -> None:
    from multiprocessing import shared_memory

    config = StoreConfig(tiers=(kv.dram(4),), scrub_interval_s=0.01)
    store = TieredStore(config)
    ns = kv.namespace()
    store.put(ns, kv.tokens(2), kv.chunks(2))
    foreign = shared_memory.SharedMemory(name=store.tier(DRAM).arena.name)  # type: ignore[attr-defined]
    try:
        foreign.buf[500] ^= 0xFF  # the first block's payload
    finally:
        foreign.close()
    deadline = time.monotonic() + 10
    while store.stats().tiers[DRAM].corrupt_blocks == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.stats().tiers[DRAM].corrupt_blocks == 1
    assert store.lookup(ns, kv.tokens(2)).num_chunks == 0  # the head is gone
    assert store._maintenance.scrubbing
    store.close()
    assert not store._maintenance.scrubbing


def test_flush_copies_what_only_dram_holds_down_and_survives_reopen(tmp_path: Path) -> None:
    ns = kv.namespace()
    data = kv.chunks(4)
    config = kv.config(kv.dram(64), kv.ssd(tmp_path / "lmdb"))
    with TieredStore(config) as store:
        store.put(ns, kv.tokens(4), data)
        keys = store.keys_for(ns, kv.tokens(4))
        store.demote(ns, keys[:1])  # already in LMDB: not written again
        assert store.flush(deadline=time.monotonic() - 1) == 0  # past its deadline: stops
        assert store.flush() == 3
        assert store.flush() == 0
        assert store.lookup(ns, keys).tiers == (SSD, DRAM, DRAM, DRAM)  # DRAM copies stay
    with TieredStore(config) as store:
        assert store.lookup(ns, keys).tiers == (SSD,) * 4
        assert_chunks_equal(store, ns, keys, data)
