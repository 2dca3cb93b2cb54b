"""What the daemon asks of the store: received blocks stored as they came
(``put_blocks``), bytes gets served from where blocks lie (``SharedServing``),
lookups answered from memory alone (``lookup_nowait``), and HBM blocks leased to a
client that copies device memory."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
from support import kv
from support.kv import assert_chunks_equal

from kvstore import (
    LayoutMismatch,
    TieredStore,
    TierKind,
)
from kvstore.block import (
    HEADER_BYTES,
    Block,
    Codec,
    encode_block,
    frame_block,
    parse_header,
    stored_block,
)
from kvstore.errors import CorruptBlock
from kvstore.local.redis_server import RedisServer
from kvstore.server.leases import LeaseTable
from kvstore.store.chunk import chunk_bytes

DRAM, SSD = TierKind.DRAM, TierKind.SSD


def _received(ns, keys, data) -> list[Block]:
    """Blocks as a client frames them (parent: the previous key), as the daemon
    receives them: one buffer each, split back into header and payload."""
    return [
        stored_block(
            encode_block(
                ns, key, keys[i - 1] if i else None, chunk_bytes(chunk, ns.layout)
            ).to_bytes()
        )
        for i, (key, chunk) in enumerate(zip(keys, data, strict=True))
    ]


def test_put_blocks_stores_received_blocks_bit_for_bit(two_level: TieredStore) -> None:
    ns = kv.namespace()
    data = kv.chunks(4)
    keys = two_level.keys_for(ns, kv.tokens(4))
    blocks = _received(ns, keys, data)
    # The head is already cached elsewhere (None); the rest is new.
    serving = two_level.serving()
    assert serving.put_blocks(ns, keys, [None, *blocks[1:]], session="agent-1") == 3
    assert serving.put_blocks(ns, keys, blocks) == 1  # only the head was missing
    assert two_level.lookup(ns, keys).tiers == (DRAM,) * 4
    got = two_level.get(ns, keys)
    assert [bytes(chunk.block) for chunk in got if chunk is not None and chunk.block] == [
        block.to_bytes() for block in blocks
    ]  # the very bytes received, header (parent, checksum) included
    assert_chunks_equal(two_level, ns, keys, data)


def test_put_blocks_re_encodes_for_a_compressed_fastest_tier(tmp_path: Path) -> None:
    with TieredStore(kv.config(kv.ssd(tmp_path / "lmdb", codec="zstd"))) as store:
        ns = kv.namespace()
        data = kv.chunks(3)
        keys = store.keys_for(ns, kv.tokens(3))
        assert store.serving().put_blocks(ns, keys, _received(ns, keys, data)) == 3
        stored = store.tier(SSD).get_many(ns.digest, keys)
        assert all(parse_header(block).codec is Codec.ZSTD for block in stored if block)
        assert_chunks_equal(store, ns, keys, data)


def test_put_blocks_refuses_a_block_that_is_not_what_it_claims(two_level: TieredStore) -> None:
    ns = kv.namespace()
    data = kv.chunks(2)
    keys = two_level.keys_for(ns, kv.tokens(2))
    good = _received(ns, keys, data)
    header = parse_header(good[1].header)
    other_layout = frame_block(dataclasses.replace(header, num_layers=3), good[1].payload)
    foreign = _received(kv.namespace(salt="another tenant"), keys, data)
    cases: list[tuple[list[Block], type[Exception]]] = [
        ([good[0], good[0]], CorruptBlock),  # block 1 carries key 0
        ([good[0], foreign[1]], CorruptBlock),  # right key, other namespace
        ([good[0], other_layout], LayoutMismatch),
        ([good[0], Block(good[1].header, good[1].payload[:-2])], CorruptBlock),  # cut short
        ([good[0], Block(good[1].header + b"\0", good[1].payload)], CorruptBlock),
    ]
    for blocks, error in cases:
        with pytest.raises(error):
            two_level.serving().put_blocks(ns, keys, blocks)
    # All or nothing: the good block 0 was never stored either.
    assert two_level.locate(ns, keys) == [None, None]
    assert two_level.stats().puts == 0


def test_serve_pins_what_it_will_send_until_released(tmp_path: Path) -> None:
    config = kv.config(kv.dram(4), kv.ssd(tmp_path / "lmdb"), promote_on_hit=False)
    with TieredStore(config) as store:
        ns = kv.namespace()
        store.put(ns, kv.tokens(6), kv.chunks(6))  # the head in DRAM, the tail spills
        keys = store.keys_for(ns, kv.tokens(6))
        unknown = store.keys_for(ns, kv.tokens(1, start=10_000))
        expected = [bytes(chunk.block) for chunk in store.get(ns, keys) if chunk and chunk.block]
        serving = store.serving()
        served = serving.serve(ns, [*keys, *unknown])
        assert served.tiers == [DRAM] * 4 + [SSD] * 2 + [None]
        framed = HEADER_BYTES + ns.layout.chunk_nbytes
        assert served.lengths == [framed] * 6 + [None]
        shared = [block for block in served.shared if block is not None]
        assert [bytes(serving.arena_view(block)) for block in shared] == expected[:4]
        # Lost from its tier between serve and its turn (a store.delete would wait for
        # the pin): what a wiped disk or a Redis restart does.
        store.tier(SSD).delete_many(ns.digest, keys[5:])
        below = serving.read_served(served, [4, 5])
        assert below[1] is None and below[0] is not None and bytes(below[0]) == expected[4]
        # Pinned: a chain that needs all of DRAM evicts around them.
        store.put(ns, kv.tokens(4, start=20_000), kv.chunks(4, seed=1))
        assert store.locate(ns, keys[:4]) == [DRAM] * 4
        serving.release_served(served)
        store.put(ns, kv.tokens(4, start=30_000), kv.chunks(4, seed=2))
        assert store.locate(ns, keys[:5]) == [SSD] * 5  # evictable again: written back
        stats = store.stats()
        assert stats.gets == 2 and stats.get_misses == 2  # the unknown key and the lost one
        assert stats.tier(DRAM).hits == 4 + 4 and stats.tier(SSD).hits == 2 + 1


def test_lookup_nowait_answers_from_the_index_without_the_store_lock(
    tmp_path: Path, clean_redis: RedisServer
) -> None:
    """What the predictor, an eviction or a long put holds the store's lock for is no
    reason for a lookup to wait: it reads the index without it."""
    ns = kv.namespace()
    with TieredStore(kv.config(kv.dram(8), kv.ssd(tmp_path / "lmdb"))) as store:
        store.put(ns, kv.tokens(2), kv.chunks(2))
        assert store.lookup_nowait(ns, kv.tokens(2)) == store.lookup(ns, kv.tokens(2))
        held = threading.Event()
        release = threading.Event()

        def hold_the_lock() -> None:
            with store.locked():
                held.set()
                release.wait(10.0)

        holder = threading.Thread(target=hold_the_lock)
        holder.start()
        held.wait()
        try:
            answer = store.lookup_nowait(ns, kv.tokens(2))
            assert answer is not None and answer.num_chunks == 2
            assert answer.tiers == (TierKind.DRAM, TierKind.DRAM)
        finally:
            release.set()
            holder.join()
        assert store.stats().lookups == 3  # counted without the store's lock too
        # A namespace not registered yet needs the lock to register: not answered here.
        assert store.lookup_nowait(kv.namespace(salt="new"), kv.tokens(2)) is None
    with TieredStore(kv.config(kv.dram(8), kv.redis(clean_redis.url))) as store:
        assert store.lookup_nowait(ns, kv.tokens(2)) is None  # Redis must be asked


def test_a_lease_pins_hbm_blocks_for_a_device_client_and_its_release_unpins_them() -> None:
    """A store of a shared HBM arena over DRAM: a device client's lease shows HBM
    blocks from HBM (pinned, with their counters in the HBM generations segment),
    one without device memory is shown only DRAM's; releasing unpins either."""
    ns = kv.namespace()
    with TieredStore(kv.config(kv.hbm(4), kv.dram(4))) as store:
        keys = store.keys_for(ns, kv.tokens(3))
        store.put(ns, kv.tokens(3), kv.chunks(3))
        assert store.lookup(ns, keys).tiers == (TierKind.HBM,) * 3
        serving = store.serving()
        assert serving.hbm_handle is not None
        table = LeaseTable(serving, ttl_s=5.0, max_leases=4)
        lease, shared = table.grant(ns, keys, hbm=True)
        assert [block.tier for block in shared if block is not None] == [TierKind.HBM] * 3
        for block in shared:
            assert block is not None
            assert serving.generation_offset(block) == 8 * (block.offset // 4096)
        assert store.demote(ns, keys) == 0  # pinned: nothing moves
        assert store.stats().tiers[TierKind.HBM].hits == 3
        _, without = table.grant(ns, keys)
        assert without == [None] * 3  # held in HBM only, so nothing to map
        assert table.release(lease.id) == 3
        assert store.demote(ns, keys) == 3  # unpinned: all three move
