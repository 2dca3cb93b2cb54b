"""Blocks landing straight in reservations of the DRAM arena (kvstore/server/landing.py):
published only on commit, given back on abort or corruption, room made by eviction, and
a buffer of their own, verified the same way, when no reservation is to be had."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import kv

from kvstore import TieredStore
from kvstore.block import HEADER_BYTES, Block, encode_block
from kvstore.errors import CorruptBlock, PutAborted
from kvstore.keys import ChunkKey, Namespace
from kvstore.kinds import TierKind
from kvstore.server.landing import Landing
from kvstore.store.chunk import chunk_bytes
from kvstore.store.reservation import Filled

DRAM = TierKind.DRAM
SSD = TierKind.SSD


@pytest.fixture
def store(tmp_path: Path):
    with TieredStore(kv.config(kv.dram(4), kv.ssd(tmp_path / "lmdb"))) as opened:
        yield opened


def _land(
    landing: Landing, index: int, keys: list[ChunkKey], data: bytes, cut: int = 1000
) -> Block | Filled:
    """Land block ``index`` as the daemon does: its header read first, then its
    payload read off a socket in pieces of at most ``cut`` bytes."""
    parent = keys[index - 1] if index else None
    fill = kv.socket_reads(data[HEADER_BYTES:], cut)
    return landing.land(index, keys[index], parent, data[:HEADER_BYTES], len(data), fill)


def _blocks(ns: Namespace, keys: list[ChunkKey], seed: int = 0) -> list[Block]:
    return [
        encode_block(ns, key, keys[i - 1] if i else None, chunk_bytes(chunk, ns.layout))
        for i, (key, chunk) in enumerate(zip(keys, kv.chunks(len(keys), seed=seed), strict=True))
    ]


def _land_all(landing: Landing, keys: list[ChunkKey], blocks: list[Block]) -> list[Filled]:
    landed = []
    for index, block in enumerate(blocks):
        filled = _land(landing, index, keys, block.to_bytes())
        assert isinstance(filled, Filled)
        landed.append(filled)
    return landed


def test_landed_blocks_are_invisible_until_commit_then_served_bit_for_bit(
    store: TieredStore,
) -> None:
    ns = kv.namespace()
    store.register(ns)
    keys = store.keys_for(ns, kv.tokens(3))
    blocks = _blocks(ns, keys)
    landing = Landing(store.serving(), ns, keys)
    landed = _land_all(landing, keys, blocks)
    assert store.tier(DRAM).used_bytes() == 3 * 4096  # reserved: counted against capacity
    assert store.lookup(ns, keys).num_chunks == 0  # but nobody can find them
    assert landing.commit(keys, landed, "agent-1") == 3
    assert store.lookup(ns, keys).tiers == (DRAM,) * 3
    got = store.get(ns, keys)
    assert [bytes(chunk.block) for chunk in got if chunk is not None and chunk.block] == [
        block.to_bytes() for block in blocks
    ]


def test_an_aborted_put_leaves_free_space_and_index_as_before(store: TieredStore) -> None:
    ns = kv.namespace()
    keys = store.keys_for(ns, kv.tokens(3))
    blocks = _blocks(ns, keys)
    store.serving().put_blocks(ns, keys[:1], blocks[:1])
    before = (store.tier(DRAM).used_bytes(), store.lookup(ns, keys).tiers)
    landing = Landing(store.serving(), ns, keys)
    _land_all(landing, keys[1:], blocks[1:])
    assert store.tier(DRAM).used_bytes() == 3 * 4096
    landing.abort()
    assert (store.tier(DRAM).used_bytes(), store.lookup(ns, keys).tiers) == before
    with pytest.raises(PutAborted):  # a block landing after the put failed is given back
        _land(landing, 2, keys, blocks[2].to_bytes())
    assert store.tier(DRAM).used_bytes() == before[0]


@pytest.mark.parametrize("dram", [True, False], ids=["reserved", "own buffer"])
def test_a_corrupt_block_is_refused_and_gives_its_reservation_back(
    tmp_path: Path, dram: bool
) -> None:
    tiers = [kv.dram(4)] if dram else []
    with TieredStore(kv.config(*tiers, kv.ssd(tmp_path / "lmdb"))) as store:
        ns = kv.namespace()
        keys = store.keys_for(ns, kv.tokens(1))
        data = bytearray(_blocks(ns, keys)[0].to_bytes())
        data[-1] ^= 0x01
        landing = Landing(store.serving(), ns, keys)
        with pytest.raises(CorruptBlock, match="block 0: checksum mismatch"):
            _land(landing, 0, keys, bytes(data))
        assert not dram or store.tier(DRAM).used_bytes() == 0
        assert store.lookup(ns, keys).num_chunks == 0


def test_a_put_larger_than_free_space_evicts_for_its_reservations(store: TieredStore) -> None:
    ns = kv.namespace()
    old_keys = store.keys_for(ns, kv.tokens(4, start=10_000))
    store.serving().put_blocks(ns, old_keys, _blocks(ns, old_keys, seed=1))
    assert store.tier(DRAM).used_bytes() == 4 * 4096  # DRAM full
    keys = store.keys_for(ns, kv.tokens(3))
    blocks = _blocks(ns, keys)
    landing = Landing(store.serving(), ns, keys)
    landed = _land_all(landing, keys, blocks)
    assert landing.commit(keys, landed, None) == 3
    assert store.lookup(ns, keys).tiers == (DRAM,) * 3
    # Three old blocks were written back to LMDB, not lost: the chain's tail
    # first, so what DRAM keeps of it is still a prefix.
    assert store.lookup(ns, old_keys).tiers == (DRAM, SSD, SSD, SSD)
    assert store.tier(DRAM).used_bytes() == 4 * 4096


def test_a_block_with_no_reservation_to_be_had_lands_in_a_buffer_then_a_normal_admission(
    tmp_path: Path,
) -> None:
    with TieredStore(kv.config(kv.ssd(tmp_path / "lmdb"))) as no_dram:
        ns = kv.namespace()
        keys = no_dram.keys_for(ns, kv.tokens(2))
        blocks = _blocks(ns, keys)
        landing = Landing(no_dram.serving(), ns, keys)
        landed = [_land(landing, i, keys, block.to_bytes()) for i, block in enumerate(blocks)]
        assert [bytes(block.to_bytes()) for block in landed if isinstance(block, Block)] == [
            block.to_bytes() for block in blocks
        ]
        assert landing.commit(keys, landed, None) == 2
        assert no_dram.lookup(ns, keys).tiers == (SSD, SSD)


def test_a_key_already_held_gives_its_reservation_back_on_commit(store: TieredStore) -> None:
    ns = kv.namespace()
    keys = store.keys_for(ns, kv.tokens(2))
    blocks = _blocks(ns, keys)
    store.serving().put_blocks(ns, keys[:1], blocks[:1])
    landing = Landing(store.serving(), ns, keys)
    landed = _land_all(landing, keys, blocks)
    assert landing.commit(keys, landed, None) == 1  # only the new one
    assert store.tier(DRAM).used_bytes() == 2 * 4096
    assert store.lookup(ns, keys).tiers == (DRAM, DRAM)


def test_with_no_tier_below_dram_a_landing_never_evicts() -> None:
    """An unverified block may only demote others, never drop them: a DRAM-only
    store that is full admits the block the usual way, after verification."""
    with TieredStore(kv.config(kv.dram(2))) as dram_only:
        ns = kv.namespace()
        old_keys = dram_only.keys_for(ns, kv.tokens(2, start=10_000))
        dram_only.serving().put_blocks(ns, old_keys, _blocks(ns, old_keys, seed=1))
        keys = dram_only.keys_for(ns, kv.tokens(1))
        block = _blocks(ns, keys)[0]
        landing = Landing(dram_only.serving(), ns, keys)
        landed = _land(landing, 0, keys, block.to_bytes())
        assert isinstance(landed, Block)  # in a buffer of its own: no room was made
        assert dram_only.lookup(ns, old_keys).tiers == (DRAM, DRAM)
        assert landing.commit(keys, [landed], None) == 1
        assert dram_only.lookup(ns, keys).tiers == (DRAM,)
