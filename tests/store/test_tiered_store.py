"""Scenario tests of ``TieredStore`` over real tiers: which tier serves what, exactly."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from support import kv
from support.kv import assert_chunks_equal

from kvstore import (
    AsyncTieredStore,
    ChunkKey,
    ConfigError,
    LayoutMismatch,
    RequestTooLarge,
    TieredStore,
    TierKind,
    UnknownNamespace,
    external_keys,
)
from kvstore.local.redis_server import RedisServer
from kvstore.store.config import StoreConfig
from kvstore.tiers.dram import DRAMTier

HBM, DRAM, SSD, REDIS = TierKind.HBM, TierKind.DRAM, TierKind.SSD, TierKind.REDIS


def test_put_lookup_get_round_trip(two_level: TieredStore) -> None:
    ns = kv.namespace()
    data = kv.chunks(5)
    tokens = kv.tokens(5)
    assert two_level.put(ns, tokens, data) == 5
    # A trailing partial chunk is not keyed; the lookup still covers the 5 full ones.
    prefix = two_level.lookup(ns, np.concatenate([tokens, [1, 2, 3]]))
    assert prefix.num_tokens == 5 * kv.LAYOUT.chunk_tokens
    assert prefix.tiers == (DRAM,) * 5
    assert_chunks_equal(two_level, ns, prefix.keys, data)
    # Putting the same chunks again stores nothing new.
    assert two_level.put(ns, tokens, data) == 0


def test_put_skips_none_and_accepts_bytes_and_numpy(two_level: TieredStore) -> None:
    ns = kv.namespace()
    data = kv.chunks(3)
    as_bytes = data[1].view(torch.uint8).numpy().tobytes()
    as_numpy = data[2].numpy()
    assert two_level.put(ns, kv.tokens(3), [None, as_bytes, as_numpy]) == 2
    prefix = two_level.lookup(ns, kv.tokens(3))
    assert prefix.num_chunks == 0  # chunk 0 was never stored, so nothing is a prefix
    keys = two_level.keys_for(ns, kv.tokens(3))
    got = two_level.get(ns, keys)
    assert got[0] is None
    assert got[1] is not None and torch.equal(got[1].tensor(), data[1])
    assert got[2] is not None and torch.equal(got[2].tensor(), data[2])


def test_lookup_of_a_partially_evicted_chain(two_level: TieredStore) -> None:
    ns = kv.namespace()
    two_level.put(ns, kv.tokens(6), kv.chunks(6))
    keys = two_level.keys_for(ns, kv.tokens(6))
    assert two_level.delete(ns, [keys[3]]) == 1
    prefix = two_level.lookup(ns, kv.tokens(6))
    assert prefix.num_chunks == 3
    assert prefix.keys == tuple(keys[:3])
    assert prefix.total_chunks == 6


def test_bad_input_is_refused_and_stores_nothing(two_level: TieredStore) -> None:
    ns = kv.namespace()
    good = kv.chunks(2)
    with pytest.raises(LayoutMismatch):
        two_level.put(ns, kv.tokens(2), [good[0], good[1].float()])  # wrong dtype
    with pytest.raises(LayoutMismatch):
        two_level.put(ns, kv.tokens(2), [good[0], good[1][:, :, :8]])  # wrong shape
    with pytest.raises(LayoutMismatch):
        two_level.put(ns, kv.tokens(2), [good[0], b"short"])  # wrong byte size
    with pytest.raises(LayoutMismatch):
        two_level.put(ns, kv.tokens(1), good)  # more chunks than tokens cover
    assert two_level.lookup(ns, kv.tokens(2)).num_chunks == 0
    assert two_level.stats().chunks_stored == 0
    with pytest.raises(UnknownNamespace):
        two_level.namespace(b"\x01" * 16)
    assert two_level.namespace(ns.digest) is ns


def test_oversize_requests_are_refused(tmp_path: Path) -> None:
    """A put or get names at most ``max_batch_chunks``; a lookup, which carries no
    payload, up to ``max_lookup_chunks`` keys."""
    config = StoreConfig(tiers=(kv.dram(4),), max_batch_chunks=3, max_lookup_chunks=5)
    with TieredStore(config) as store:
        ns = kv.namespace()
        with pytest.raises(RequestTooLarge, match="the limit is 3"):
            store.put(ns, kv.tokens(4), kv.chunks(4))
        with pytest.raises(RequestTooLarge, match="the limit is 3"):
            store.get(ns, store.keys_for(ns, kv.tokens(4)))
        with pytest.raises(RequestTooLarge, match="6 keys in one lookup; the limit is 5"):
            store.lookup(ns, kv.tokens(6))
        assert store.put(ns, kv.tokens(3), kv.chunks(3)) == 3
        assert store.lookup(ns, kv.tokens(5)).num_chunks == 3
    with pytest.raises(ConfigError, match="at most max_lookup_chunks"):
        StoreConfig(tiers=(kv.dram(4),), max_batch_chunks=8, max_lookup_chunks=5)


def test_a_put_from_the_parent_on_keeps_the_whole_prefix_recent(tmp_path: Path) -> None:
    """An engine saving the blocks past its own cached prefix names only the parent of
    the first new block and the new ones (the vLLM connector does, so a put stays one
    batch long): the prefix counts as used as well, so under pressure another chain's
    tail goes, not this chain's head, and the chain stays a prefix."""
    with TieredStore(kv.config(kv.dram(8), kv.ssd(tmp_path))) as store:
        ns = kv.namespace()
        a = store.keys_for(ns, kv.tokens(5))
        b = store.keys_for(ns, kv.tokens(4, start=50_000))
        chunks = kv.chunks(5)
        assert store.put(ns, a[:4], chunks[:4]) == 4
        assert store.put(ns, b, kv.chunks(4, seed=1)) == 4  # DRAM is full
        assert store.put(ns, a[3:], [None, chunks[4]]) == 1
        dram, ssd = TierKind.DRAM, TierKind.SSD
        assert store.locate(ns, a + b) == [dram] * 5 + [dram, dram, dram, ssd]
        assert store.lookup(ns, a).num_chunks == 5
        assert all(
            got is not None and torch.equal(got.tensor(), want)
            for got, want in zip(store.get(ns, a), chunks, strict=True)
        )


def test_tenants_and_models_never_share_chunks(two_level: TieredStore) -> None:
    alice, bob = kv.namespace(salt="alice"), kv.namespace(salt="bob")
    other_model = kv.namespace(model="other-model", salt="alice")
    two_level.put(alice, kv.tokens(3), kv.chunks(3))
    assert two_level.lookup(alice, kv.tokens(3)).num_chunks == 3
    assert two_level.lookup(bob, kv.tokens(3)).num_chunks == 0
    assert two_level.lookup(other_model, kv.tokens(3)).num_chunks == 0
    # Even with alice's keys in hand, bob's namespace cannot read them.
    alice_keys = two_level.keys_for(alice, kv.tokens(3))
    assert two_level.get(bob, alice_keys) == [None, None, None]


def test_engine_hashed_keys(two_level: TieredStore) -> None:
    ns = kv.namespace()
    keys = external_keys(ns, [101, 202, 303])
    data = kv.chunks(3)
    assert two_level.put(ns, keys, data) == 3
    assert two_level.lookup(ns, keys).num_chunks == 3
    assert_chunks_equal(two_level, ns, keys, data)


def test_demotion_cascade_keeps_the_head_high(tmp_path: Path) -> None:
    """A chain longer than HBM: head in HBM, the rest spills down in order."""
    config = kv.config(kv.hbm(2), kv.dram(3), kv.ssd(tmp_path / "lmdb"))
    with TieredStore(config) as store:
        ns = kv.namespace()
        data = kv.chunks(8)
        assert store.put(ns, kv.tokens(8), data) == 8
        prefix = store.lookup(ns, kv.tokens(8))
        assert prefix.tiers == (HBM, HBM, DRAM, DRAM, DRAM, SSD, SSD, SSD)
        # A second chain takes HBM; the first chain's head is written back to DRAM,
        # pushing DRAM's least recent blocks (the first chain's tail end) to SSD.
        other = kv.chunks(2, seed=1)
        store.put(ns, kv.tokens(2, start=10_000), other)
        assert store.lookup(ns, kv.tokens(2, start=10_000)).tiers == (HBM, HBM)
        assert store.lookup(ns, kv.tokens(8)).tiers == (DRAM, DRAM, DRAM, SSD, SSD, SSD, SSD, SSD)
        stats = store.stats()
        assert stats.tiers[HBM].demotions == 2
        assert stats.tiers[DRAM].demotions == 2  # the initial spill was no demotion
        assert stats.tiers[SSD].evictions == 0
        # Reading the whole first chain promotes it; bytes are identical wherever served.
        assert_chunks_equal(store, ns, list(prefix.keys), data)


def test_eviction_takes_the_tail_before_the_head(tmp_path: Path) -> None:
    """Dropping from the last tier keeps a cached prefix a prefix."""
    with TieredStore(kv.config(kv.dram(4))) as store:
        ns = kv.namespace()
        store.put(ns, kv.tokens(4), kv.chunks(4))
        store.put(ns, kv.tokens(1, start=50_000), kv.chunks(1, seed=1))
        # Four slots, five chunks: the first chain lost its last chunk, not its first.
        assert store.lookup(ns, kv.tokens(4)).num_chunks == 3
        store.put(ns, kv.tokens(2, start=60_000), kv.chunks(2, seed=2))
        assert store.lookup(ns, kv.tokens(4)).num_chunks == 1
        assert store.stats().tiers[DRAM].evictions == 3


def test_promotion_on_hit_and_without(tmp_path: Path) -> None:
    for promote in (True, False):
        path = tmp_path / f"lmdb-{promote}"
        with TieredStore(kv.config(kv.dram(1), kv.ssd(path), promote_on_hit=promote)) as store:
            ns = kv.namespace()
            data = kv.chunks(1)
            store.put(ns, kv.tokens(1), data)
            store.put(ns, kv.tokens(1, start=9_000), kv.chunks(1, seed=1))  # pushes it to SSD
            assert store.lookup(ns, kv.tokens(1)).tiers == (SSD,)
            got = store.get(ns, store.keys_for(ns, kv.tokens(1)))
            assert got[0] is not None and got[0].tier is SSD
            assert torch.equal(got[0].tensor(), data[0])
            expected = (DRAM,) if promote else (SSD,)
            assert store.lookup(ns, kv.tokens(1)).tiers == expected
            assert store.stats().tiers[SSD].promotions == int(promote)


def test_explicit_demote_promote_pin(tmp_path: Path) -> None:
    with TieredStore(kv.config(kv.dram(4), kv.ssd(tmp_path / "lmdb"))) as store:
        ns = kv.namespace()
        data = kv.chunks(3)
        store.put(ns, kv.tokens(3), data)
        keys = store.keys_for(ns, kv.tokens(3))
        assert store.demote(ns, keys[1:]) == 2
        assert store.lookup(ns, kv.tokens(3)).tiers == (DRAM, SSD, SSD)
        assert store.promote(ns, keys) == 2
        assert store.lookup(ns, kv.tokens(3)).tiers == (DRAM, DRAM, DRAM)
        # A pinned block is never an eviction victim.
        assert store.pin(ns, keys[:1]) == 1
        store.put(ns, kv.tokens(4, start=70_000), kv.chunks(4, seed=3))
        assert store.lookup(ns, kv.tokens(1)).tiers == (DRAM,)
        assert store.demote(ns, keys[:1]) == 0
        store.unpin(ns, keys[:1])
        assert store.demote(ns, keys[:1]) == 1
        assert_chunks_equal(store, ns, keys, data)


def test_a_pinned_block_is_deleted_when_its_last_pin_goes(tmp_path: Path) -> None:
    """A reader copying a block out of shared memory holds a pin: a delete meanwhile
    must not free the extent under it (a put would reuse it), so it waits."""
    with TieredStore(kv.config(kv.dram(4), kv.ssd(tmp_path / "lmdb"))) as store:
        ns = kv.namespace()
        data = kv.chunks(2)
        store.put(ns, kv.tokens(2), data)
        store.demote(ns, store.keys_for(ns, kv.tokens(2))[1:], to=SSD)
        keys = store.keys_for(ns, kv.tokens(2))
        (shared,) = store.serving().share(ns, keys[:1])  # pinned, as a lease pins it
        assert shared is not None
        store.pin(ns, keys[:1])  # and a second reader
        assert store.delete(ns, keys) == 2
        assert store.locate(ns, keys) == [DRAM, None]  # the unpinned one went at once
        store.put(ns, kv.tokens(4, start=90_000), kv.chunks(4, seed=5))  # fills DRAM
        dram = store.tier(DRAM)
        assert isinstance(dram, DRAMTier)
        generation = dram.arena.array(dram.generation_offset(shared.offset), 1, np.uint64)
        assert generation[0] == shared.generation  # never freed, so never reused
        store.unpin(ns, keys[:1])
        assert store.locate(ns, keys[:1]) == [DRAM]  # one reader left
        store.unpin(ns, keys[:1])
        assert store.locate(ns, keys[:1]) == [None]
        assert store.get(ns, keys[:1]) == [None]


def test_a_put_calls_off_a_delete_waiting_on_pins(tmp_path: Path) -> None:
    with TieredStore(kv.config(kv.dram(4), kv.ssd(tmp_path / "lmdb"))) as store:
        ns = kv.namespace()
        data = kv.chunks(1)
        store.put(ns, kv.tokens(1), data)
        keys = store.keys_for(ns, kv.tokens(1))
        store.pin(ns, keys)
        assert store.delete(ns, keys) == 1
        assert store.put(ns, kv.tokens(1), data) == 0  # held: nothing to write
        store.unpin(ns, keys)
        assert_chunks_equal(store, ns, keys, data)


def test_concurrent_writers_and_readers(tmp_path: Path) -> None:
    config = kv.config(kv.hbm(6), kv.dram(10), kv.ssd(tmp_path / "lmdb"))
    errors: list[BaseException] = []
    with TieredStore(config) as store:
        ns = kv.namespace()

        def worker(worker_id: int) -> None:
            try:
                for round_ in range(6):
                    start = (worker_id * 100 + round_) * 1_000
                    data = kv.chunks(3, seed=worker_id * 100 + round_)
                    store.put(ns, kv.tokens(3, start=start), data)
                    keys = store.keys_for(ns, kv.tokens(3, start=start))
                    for chunk, tensor in zip(store.get(ns, keys), data, strict=True):
                        # Under pressure a chunk may have been dropped: a miss is
                        # allowed, a wrong block never.
                        assert chunk is None or torch.equal(chunk.tensor(), tensor)
            except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        # LMDB is large enough for everything: every chain is fully readable.
        for worker_id in range(4):
            for round_ in range(6):
                start = (worker_id * 100 + round_) * 1_000
                keys = store.keys_for(ns, kv.tokens(3, start=start))
                assert_chunks_equal(store, ns, keys, kv.chunks(3, seed=worker_id * 100 + round_))


def test_codec_per_tier_round_trips(tmp_path: Path) -> None:
    config = kv.config(kv.dram(2), kv.ssd(tmp_path / "lmdb", codec="zstd-byteplane:1"))
    with TieredStore(config) as store:
        ns = kv.namespace()
        data = kv.chunks(4)
        store.put(ns, kv.tokens(4), data)
        keys = store.keys_for(ns, kv.tokens(4))
        assert store.lookup(ns, kv.tokens(4)).tiers == (DRAM, DRAM, SSD, SSD)
        assert_chunks_equal(store, ns, keys, data)


def test_async_store_mirrors_the_sync_one(tmp_path: Path) -> None:
    import asyncio

    async def scenario() -> None:
        async with AsyncTieredStore(kv.config(kv.dram(8))) as store:
            ns = kv.namespace()
            data = kv.chunks(3)
            assert await store.put(ns, kv.tokens(3), data) == 3
            prefix = await store.lookup(ns, kv.tokens(3))
            assert prefix.num_chunks == 3
            got = await store.get(ns, list(prefix.keys))
            assert all(
                c is not None and torch.equal(c.tensor(), t) for c, t in zip(got, data, strict=True)
            )
            assert await store.delete(ns, [prefix.keys[2]]) == 1
            assert (await store.lookup(ns, kv.tokens(3))).num_chunks == 2
            assert (await store.stats()).puts == 1

    asyncio.run(scenario())


def test_keys_must_be_chunk_keys(two_level: TieredStore) -> None:
    ns = kv.namespace()
    with pytest.raises(LayoutMismatch):
        two_level.lookup(ns, [ChunkKey(b"\x00" * 16), b"\x01" * 16])


# The store as the daemon uses it, chunks in as bytes and arrays and out into buffers,
# in an interpreter of its own (pytest's has imported torch; ``support.kv`` does too).
WITHOUT_TENSORS = """
import sys
from pathlib import Path

import numpy as np

from kvstore.keys import KVLayout, Namespace
from kvstore.store.config import StoreConfig
from kvstore.store.tiered_store import TieredStore
from kvstore.kinds import TierKind
from kvstore.tiers.registry import TierConfig

layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=16)
ns = Namespace("no-tensors", layout)
root = Path(sys.argv[1])
tiers = (TierConfig(TierKind.DRAM, 1 << 20), TierConfig(TierKind.SSD, 64 << 20, path=root))
chunks = [bytes([i]) * layout.chunk_nbytes for i in range(4)]
tokens = np.arange(4 * layout.chunk_tokens)
with TieredStore(StoreConfig(tiers=tiers, data_dir=root)) as store:
    array = np.frombuffer(chunks[2], np.float16).reshape(layout.chunk_shape)
    store.put(ns, tokens[:32], chunks[:2])
    store.put(ns, tokens, [None, None, array, chunks[3]])
    keys = store.lookup(ns, tokens).keys
    assert store.demote(ns, keys[:2]) == 2
    out = [bytearray(layout.chunk_nbytes) for _ in keys]
    read = store.get(ns, keys, out=out)
    assert [chunk.tier.label for chunk in read] == ["ssd", "ssd", "dram", "dram"]
    assert list(map(bytes, out)) == chunks
print("torch imported:", "torch" in sys.modules)
"""


def test_a_store_handed_no_tensors_never_imports_torch(tmp_path: Path) -> None:
    """torch takes most of a second to import; the daemon's store, handed bytes off a
    socket, never needs it (``kvstore.tensors``)."""
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TENSORS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "torch imported: False\n"


@pytest.mark.parametrize("tier_name", ["hbm", "dram", "ssd", "ssd-zstd", "redis"])
def test_get_into_caller_buffers(tier_name: str, tmp_path: Path, clean_redis: RedisServer) -> None:
    tiers = {
        "hbm": kv.hbm(8),
        "dram": kv.dram(8),
        "ssd": kv.ssd(tmp_path / "lmdb"),
        "ssd-zstd": kv.ssd(tmp_path / "lmdb", codec="zstd-byteplane:1"),
        "redis": kv.redis(clean_redis.url),
    }
    with TieredStore(kv.config(tiers[tier_name])) as store:
        ns = kv.namespace()
        data = kv.chunks(4)
        store.put(ns, kv.tokens(3), data[:3])
        keys = store.keys_for(ns, kv.tokens(4, start=0))[:3] + store.keys_for(
            ns, kv.tokens(1, start=77_000)
        )
        out = [torch.empty(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in range(4)]
        got = store.get(ns, keys, out=out)
        assert [c is not None for c in got] == [True, True, True, False]
        for chunk, buffer, tensor in zip(got[:3], out, data, strict=False):
            assert chunk is not None
            assert torch.equal(buffer, tensor)  # written in place
            assert torch.equal(chunk.tensor(), tensor)
            assert chunk.tensor().data_ptr() == buffer.data_ptr()  # a view, not a copy


def test_get_into_detects_corruption(tmp_path: Path) -> None:
    import lmdb

    ns = kv.namespace()
    config = kv.config(kv.ssd(tmp_path / "lmdb"), promote_on_hit=False)
    with TieredStore(config) as store:
        store.put(ns, kv.tokens(2), kv.chunks(2))
        keys = store.keys_for(ns, kv.tokens(2))
    env = lmdb.open(str(tmp_path / "lmdb"), subdir=True)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(ns.digest + keys[1]))
        value[-1] ^= 0x01
        txn.put(ns.digest + keys[1], bytes(value))
    env.close()
    with TieredStore(config) as store:
        out = [bytearray(kv.LAYOUT.chunk_nbytes) for _ in range(2)]
        got = store.get(ns, keys, out=out)
        assert [c is not None for c in got] == [True, False]
        assert store.stats().tiers[SSD].corrupt_blocks == 1


def test_get_into_refuses_unusable_buffers(two_level: TieredStore) -> None:
    ns = kv.namespace()
    two_level.put(ns, kv.tokens(1), kv.chunks(1))
    keys = two_level.keys_for(ns, kv.tokens(1))
    shape = kv.LAYOUT.chunk_shape
    for bad in (
        torch.empty(shape, dtype=torch.float32),  # wrong dtype
        torch.empty(shape, dtype=torch.float16)[:, :, :8],  # wrong size, not contiguous
        bytes(kv.LAYOUT.chunk_nbytes),  # read-only
        bytearray(10),  # wrong size
    ):
        with pytest.raises(LayoutMismatch):
            two_level.get(ns, keys, out=[bad])
    with pytest.raises(LayoutMismatch):
        two_level.get(ns, keys, out=[])


def test_locate_reports_every_key_not_only_the_leading_run(two_level: TieredStore) -> None:
    ns = kv.namespace()
    two_level.put(ns, kv.tokens(3), kv.chunks(3))
    keys = two_level.keys_for(ns, kv.tokens(3))
    two_level.demote(ns, keys[2:])
    two_level.delete(ns, keys[:1])
    assert two_level.locate(ns, keys) == [None, DRAM, SSD]
    assert two_level.lookup(ns, keys).num_chunks == 0
    assert two_level.stats().lookups == 1  # locate is not counted as a lookup


def test_write_back_copies_down_and_keeps_the_fast_copy(tmp_path: Path) -> None:
    ns = kv.namespace()
    config = kv.config(kv.hbm(4), kv.dram(8), kv.ssd(tmp_path / "lmdb"))
    with TieredStore(config) as store:
        tokens = kv.tokens(3)
        store.put(ns, tokens, kv.chunks(3))
        keys = store.keys_for(ns, tokens)
        assert store.write_back(ns, keys, to=TierKind.DRAM) == 3
        assert store.write_back(ns, keys, to=TierKind.DRAM) == 0  # held there already
        assert store.lookup(ns, tokens).tiers == (TierKind.HBM,) * 3  # the fast copy stays
        assert store.tier(TierKind.DRAM).contains_many(ns.digest, keys) == [True] * 3
        written = store.stats().tier(TierKind.DRAM).bytes_written
        store.demote(ns, keys)  # leaving HBM now writes nothing: DRAM holds them
        assert store.stats().tier(TierKind.DRAM).bytes_written == written
        assert store.lookup(ns, tokens).tiers == (TierKind.DRAM,) * 3
