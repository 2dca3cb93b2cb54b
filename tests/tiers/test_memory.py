"""The memory tiers (DRAM shared memory, HBM tensor on CPU or CUDA) against the Tier protocol."""

from __future__ import annotations

import gc
import os
import secrets
import sys
import threading
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from kvstore.block import HEADER_BYTES, Block, encode_block, verify_block
from kvstore.errors import TierFull, TierUnavailable
from kvstore.keys import ChunkKey, KVLayout, Namespace, chunk_keys
from kvstore.kinds import TierKind
from kvstore.tiers.arena_tier import ArenaTier
from kvstore.tiers.base import StoredBlockInfo, Tier
from kvstore.tiers.dram import DRAMTier
from kvstore.tiers.extents import PAGE_BYTES
from kvstore.tiers.hbm import HBMTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=16)
NS = Namespace("test-model", LAYOUT)
OTHER_NS = Namespace("test-model", LAYOUT, tenant_salt="other-tenant")
PAYLOAD = LAYOUT.chunk_nbytes  # 2048 bytes
SLOT = PAGE_BYTES  # header + one chunk fits one page
assert HEADER_BYTES + PAYLOAD <= SLOT
KEYS = chunk_keys(NS, np.arange(8 * LAYOUT.chunk_tokens))

TierFactory = Callable[[int], ArenaTier]


def make_block(key: ChunkKey, seed: int, nbytes: int = PAYLOAD, namespace: Namespace = NS) -> Block:
    payload = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    return encode_block(namespace, key, None, memoryview(payload))


def synthetic_key(thread: int, index: int) -> ChunkKey:
    return ChunkKey(thread.to_bytes(8, "big") + index.to_bytes(8, "big"))


@pytest.fixture(params=["dram", "hbm-cpu"])
def make_tier(request: pytest.FixtureRequest) -> Iterator[TierFactory]:
    created: list[ArenaTier] = []

    def factory(capacity: int) -> ArenaTier:
        tier: ArenaTier = (
            DRAMTier(capacity) if request.param == "dram" else HBMTier(capacity, device="cpu")
        )
        created.append(tier)
        return tier

    yield factory
    for tier in created:
        tier.close()


@pytest.fixture
def tier(make_tier: TierFactory) -> ArenaTier:
    return make_tier(8 * SLOT)


# --- protocol and basic operations -------------------------------------------------------


def test_implements_the_tier_protocol(tier: ArenaTier) -> None:
    assert isinstance(tier, Tier)
    assert tier.kind in (TierKind.DRAM, TierKind.HBM)
    assert tier.kind is (TierKind.DRAM if isinstance(tier, DRAMTier) else TierKind.HBM)
    assert tier.verifies_reads is False
    assert tier.capacity_bytes() == 8 * SLOT
    assert tier.used_bytes() == 0
    assert list(tier.scan()) == []


def test_put_then_get_is_bit_for_bit(tier: ArenaTier) -> None:
    blocks = [make_block(KEYS[i], seed=i) for i in range(3)]
    tier.put_many(NS.digest, list(zip(KEYS[:3], blocks, strict=True)))
    found = tier.get_many(NS.digest, [KEYS[2], KEYS[0], KEYS[1]])
    assert [bytes(value) for value in found] == [  # type: ignore[arg-type]
        blocks[2].to_bytes(),
        blocks[0].to_bytes(),
        blocks[1].to_bytes(),
    ]
    for value, key in zip(found, [KEYS[2], KEYS[0], KEYS[1]], strict=True):
        assert value is not None
        assert verify_block(value).key == key
    assert tier.used_bytes() == 3 * SLOT


def test_blocks_of_various_sizes(make_tier: TierFactory) -> None:
    tier = make_tier(16 * SLOT)
    sizes = [0, 1, SLOT - HEADER_BYTES, SLOT - HEADER_BYTES + 1, 3 * SLOT + 5]
    items = [(KEYS[i], make_block(KEYS[i], seed=i, nbytes=n)) for i, n in enumerate(sizes)]
    tier.put_many(NS.digest, items)
    assert tier.used_bytes() == (1 + 1 + 1 + 2 + 4) * SLOT
    found = tier.get_many(NS.digest, [key for key, _ in items])
    for value, (_, block) in zip(found, items, strict=True):
        assert value is not None
        assert bytes(value) == block.to_bytes()
        assert len(value) == block.nbytes


def test_misses_are_none(tier: ArenaTier) -> None:
    block = make_block(KEYS[0], seed=0)
    tier.put_many(NS.digest, [(KEYS[0], block)])
    found = tier.get_many(NS.digest, [KEYS[1], KEYS[0], KEYS[2]])
    assert found[0] is None and found[2] is None
    assert bytes(found[1]) == block.to_bytes()  # type: ignore[arg-type]
    assert tier.get_many(NS.digest, []) == []
    assert tier.contains_many(NS.digest, []) == []


def test_get_returns_owned_copies(tier: ArenaTier) -> None:
    block = make_block(KEYS[0], seed=0)
    tier.put_many(NS.digest, [(KEYS[0], block)])
    first = tier.get_many(NS.digest, [KEYS[0]])[0]
    assert first is not None
    writable = memoryview(first).cast("B")
    writable[HEADER_BYTES] ^= 0xFF  # scribbling on a returned buffer ...
    assert bytes(tier.get_many(NS.digest, [KEYS[0]])[0]) == block.to_bytes()  # type: ignore[arg-type]
    # ... and the returned buffer outlives the stored block and its reuse.
    second = tier.get_many(NS.digest, [KEYS[0]])[0]
    tier.delete_many(NS.digest, [KEYS[0]])
    tier.put_many(NS.digest, [(KEYS[1], make_block(KEYS[1], seed=99))])
    assert bytes(second) == block.to_bytes()  # type: ignore[arg-type]


def test_put_does_not_keep_a_reference_to_the_callers_payload(tier: ArenaTier) -> None:
    backing = bytearray(b"\x11" * PAYLOAD)
    block = encode_block(NS, KEYS[0], None, memoryview(backing))
    expected = block.to_bytes()
    tier.put_many(NS.digest, [(KEYS[0], block)])
    backing[:] = b"\x22" * PAYLOAD
    assert bytes(tier.get_many(NS.digest, [KEYS[0]])[0]) == expected  # type: ignore[arg-type]


def test_contains_and_delete(tier: ArenaTier) -> None:
    items = [(KEYS[i], make_block(KEYS[i], seed=i)) for i in range(3)]
    tier.put_many(NS.digest, items)
    assert tier.contains_many(NS.digest, KEYS[:4]) == [True, True, True, False]
    assert tier.delete_many(NS.digest, [KEYS[1], KEYS[3], KEYS[1]]) == 1
    assert tier.contains_many(NS.digest, KEYS[:3]) == [True, False, True]
    assert tier.get_many(NS.digest, [KEYS[1]]) == [None]
    assert tier.used_bytes() == 2 * SLOT
    assert tier.delete_many(NS.digest, [KEYS[0], KEYS[2]]) == 2
    assert tier.delete_many(NS.digest, [KEYS[0], KEYS[2]]) == 0
    assert tier.used_bytes() == 0
    assert tier.contains_many(NS.digest, KEYS[:3]) == [False, False, False]


def test_namespace_scoping(tier: ArenaTier) -> None:
    block = make_block(KEYS[0], seed=0)
    tier.put_many(NS.digest, [(KEYS[0], block)])
    assert tier.get_many(OTHER_NS.digest, [KEYS[0]]) == [None]
    assert tier.contains_many(OTHER_NS.digest, [KEYS[0]]) == [False]
    assert tier.delete_many(OTHER_NS.digest, [KEYS[0]]) == 0
    # The block is untouched by the other namespace's calls.
    assert tier.contains_many(NS.digest, [KEYS[0]]) == [True]
    assert bytes(tier.get_many(NS.digest, [KEYS[0]])[0]) == block.to_bytes()  # type: ignore[arg-type]
    assert tier.used_bytes() == SLOT


def test_replacing_a_key_frees_the_old_extent(make_tier: TierFactory) -> None:
    tier = make_tier(2 * SLOT)
    tier.put_many(NS.digest, [(KEYS[0], make_block(KEYS[0], seed=0))])
    for seed in range(1, 10):
        replacement = make_block(KEYS[0], seed=seed)
        tier.put_many(NS.digest, [(KEYS[0], replacement)])  # would be TierFull on a leak
        assert tier.used_bytes() == SLOT
        assert bytes(tier.get_many(NS.digest, [KEYS[0]])[0]) == replacement.to_bytes()  # type: ignore[arg-type]
    assert len(list(tier.scan())) == 1
    assert tier.delete_many(NS.digest, [KEYS[0]]) == 1
    assert tier.used_bytes() == 0


def test_replacing_with_a_larger_block(make_tier: TierFactory) -> None:
    tier = make_tier(4 * SLOT)
    tier.put_many(NS.digest, [(KEYS[0], make_block(KEYS[0], seed=0))])
    bigger = make_block(KEYS[0], seed=1, nbytes=2 * SLOT)
    tier.put_many(NS.digest, [(KEYS[0], bigger)])
    assert tier.used_bytes() == 3 * SLOT
    assert bytes(tier.get_many(NS.digest, [KEYS[0]])[0]) == bigger.to_bytes()  # type: ignore[arg-type]


def test_duplicate_key_in_one_batch_keeps_the_last(tier: ArenaTier) -> None:
    first, last = make_block(KEYS[0], seed=1), make_block(KEYS[0], seed=2)
    tier.put_many(NS.digest, [(KEYS[0], first), (KEYS[0], last)])
    assert bytes(tier.get_many(NS.digest, [KEYS[0]])[0]) == last.to_bytes()  # type: ignore[arg-type]
    assert tier.used_bytes() == SLOT


# --- capacity ----------------------------------------------------------------------------


def test_batch_that_does_not_fit_changes_nothing(make_tier: TierFactory) -> None:
    tier = make_tier(4 * SLOT)
    resident = make_block(KEYS[0], seed=0)
    tier.put_many(NS.digest, [(KEYS[0], resident)])
    batch = [(KEYS[i], make_block(KEYS[i], seed=i)) for i in range(1, 5)]
    with pytest.raises(TierFull) as excinfo:
        tier.put_many(NS.digest, batch)
    assert excinfo.value.tier == tier.kind.label
    assert tier.contains_many(NS.digest, [key for key, _ in batch]) == [False] * 4
    assert tier.get_many(NS.digest, [key for key, _ in batch]) == [None] * 4
    assert tier.used_bytes() == SLOT
    assert bytes(tier.get_many(NS.digest, [KEYS[0]])[0]) == resident.to_bytes()  # type: ignore[arg-type]
    assert [info.key for info in tier.scan()] == [KEYS[0]]
    # The extents the failed batch had taken were all given back.
    tier.put_many(NS.digest, batch[:3])
    assert tier.used_bytes() == 4 * SLOT
    assert tier.contains_many(NS.digest, KEYS[:5]) == [True, True, True, True, False]


def test_batch_that_does_not_fit_does_not_replace_existing_keys(make_tier: TierFactory) -> None:
    tier = make_tier(2 * SLOT)
    old = make_block(KEYS[0], seed=0)
    tier.put_many(NS.digest, [(KEYS[0], old)])
    batch = [(KEYS[0], make_block(KEYS[0], seed=1)), (KEYS[1], make_block(KEYS[1], seed=2))]
    with pytest.raises(TierFull):
        tier.put_many(NS.digest, batch)
    assert bytes(tier.get_many(NS.digest, [KEYS[0]])[0]) == old.to_bytes()  # type: ignore[arg-type]
    assert tier.contains_many(NS.digest, [KEYS[1]]) == [False]
    assert tier.used_bytes() == SLOT


def test_single_block_larger_than_the_tier(tier: ArenaTier) -> None:
    with pytest.raises(TierFull):
        tier.put_many(NS.digest, [(KEYS[0], make_block(KEYS[0], seed=0, nbytes=8 * SLOT))])
    assert tier.used_bytes() == 0


def test_fill_exactly_to_capacity(tier: ArenaTier) -> None:
    items = [(synthetic_key(0, i), make_block(synthetic_key(0, i), seed=i)) for i in range(8)]
    tier.put_many(NS.digest, items)
    assert tier.used_bytes() == tier.capacity_bytes()
    with pytest.raises(TierFull):
        tier.put_many(NS.digest, [(KEYS[0], make_block(KEYS[0], seed=0, nbytes=0))])
    assert tier.delete_many(NS.digest, [items[3][0]]) == 1
    tier.put_many(NS.digest, [(KEYS[0], make_block(KEYS[0], seed=0))])
    found = tier.get_many(NS.digest, [key for key, _ in items])
    assert [value is None for value in found] == [i == 3 for i in range(8)]
    for value, (_, block) in zip(found, items, strict=True):
        if value is not None:
            assert bytes(value) == block.to_bytes()


# --- scan and close ----------------------------------------------------------------------


def test_scan_yields_headers(tier: ArenaTier) -> None:
    blocks = {KEYS[i]: make_block(KEYS[i], seed=i, nbytes=100 * i) for i in range(3)}
    other = make_block(KEYS[5], seed=5, namespace=OTHER_NS)
    tier.put_many(NS.digest, list(blocks.items()))
    tier.put_many(OTHER_NS.digest, [(KEYS[5], other)])
    infos = {info.key: info for info in tier.scan()}
    assert set(infos) == {*blocks, KEYS[5]}
    for key, block in blocks.items():
        assert infos[key] == StoredBlockInfo(NS.digest, key, block.nbytes, block.header)
    assert infos[KEYS[5]] == StoredBlockInfo(OTHER_NS.digest, KEYS[5], other.nbytes, other.header)
    assert all(len(info.header) == HEADER_BYTES for info in infos.values())


def test_closed_tier_raises_tier_unavailable(tier: ArenaTier) -> None:
    tier.put_many(NS.digest, [(KEYS[0], make_block(KEYS[0], seed=0))])
    tier.close()
    with pytest.raises(TierUnavailable) as excinfo:
        tier.get_many(NS.digest, [KEYS[0]])
    assert excinfo.value.tier == tier.kind.label
    with pytest.raises(TierUnavailable):
        tier.put_many(NS.digest, [(KEYS[1], make_block(KEYS[1], seed=1))])
    tier.close()  # idempotent


@pytest.mark.parametrize("method", ["contains_many", "delete_many", "scan", "used_bytes"])
def test_every_method_of_a_closed_tier_raises(tier: ArenaTier, method: str) -> None:
    tier.put_many(NS.digest, [(KEYS[0], make_block(KEYS[0], seed=0))])
    tier.close()
    calls: dict[str, Callable[[], object]] = {
        "contains_many": lambda: tier.contains_many(NS.digest, [KEYS[0]]),
        "delete_many": lambda: tier.delete_many(NS.digest, [KEYS[0]]),
        "scan": lambda: list(tier.scan()),
        "used_bytes": tier.used_bytes,
    }
    try:
        calls[method]()
    except TierUnavailable:
        return
    raise AssertionError(f"{method} on a closed tier did not raise TierUnavailable")


# --- DRAM: real named shared memory ------------------------------------------------------


def test_dram_arena_is_named_shared_memory() -> None:
    tier = DRAMTier(4 * SLOT)
    try:
        block = make_block(KEYS[0], seed=0)
        tier.put_many(NS.digest, [(KEYS[0], block)])  # first allocation lands at offset 0
        handle = shared_memory.SharedMemory(name=tier.arena.name)
        try:
            assert handle.size >= 4 * SLOT
            assert bytes(handle.buf[: block.nbytes]) == block.to_bytes()
            # Writes through the segment are visible to the tier: it is one mapping.
            handle.buf[HEADER_BYTES] ^= 0xFF
            stored = tier.get_many(NS.digest, [KEYS[0]])[0]
            assert stored is not None
            assert bytes(stored)[HEADER_BYTES] == block.to_bytes()[HEADER_BYTES] ^ 0xFF
        finally:
            handle.close()
    finally:
        tier.close()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=tier.arena.name)


def test_dram_shm_name_can_be_chosen() -> None:
    name = f"kvstore-test-{secrets.token_hex(4)}"
    tier = DRAMTier(SLOT, shm_name=name)
    try:
        assert tier.arena.name == name
        assert tier.arena.pinned is torch.cuda.is_available()
    finally:
        tier.close()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)


def _resident_bytes(name: str) -> int:
    """Bytes of pages the tmpfs holds for segment ``name``."""
    return os.stat(f"/dev/shm/{name}").st_blocks * 512


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/shm and madvise: Linux")
def test_a_prefaulted_arena_is_populated_in_the_background_without_touching_blocks() -> None:
    capacity = 64 << 20
    tier = DRAMTier(capacity, prefault=True)
    try:
        prefault = tier.arena.prefault
        assert prefault is not None
        block = make_block(KEYS[0], seed=0)
        tier.put_many(NS.digest, [(KEYS[0], block)])  # while the pages are being populated
        assert prefault.wait(30)
        assert prefault.populated_bytes == tier.arena.nbytes
        assert _resident_bytes(tier.arena.name) >= tier.arena.nbytes
        stored = tier.get_many(NS.digest, [KEYS[0]])[0]
        assert stored is not None and bytes(stored) == block.to_bytes()
    finally:
        tier.close()


def test_an_arena_reserves_its_pages_at_creation_and_maps_them_only_when_asked() -> None:
    """The tmpfs allocates every page at once (a shortfall is an error now, never a
    SIGBUS on a later write); populating the process's page tables is ``prefault``'s."""
    tier = DRAMTier(64 << 20)
    try:
        assert tier.arena.prefault is None
        assert _resident_bytes(tier.arena.name) >= 64 << 20
    finally:
        tier.close()


def test_closing_a_prefaulting_arena_stops_its_thread_first() -> None:
    tier = DRAMTier(1 << 30, prefault=True)
    prefault = tier.arena.prefault
    assert prefault is not None
    tier.close()
    assert prefault.done  # stopped between two steps, before the segment was unmapped
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=tier.arena.name)


def test_dram_segment_is_unlinked_when_the_tier_is_collected() -> None:
    tier = DRAMTier(SLOT)
    name = tier.arena.name
    del tier
    gc.collect()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)


# --- concurrency -------------------------------------------------------------------------


def test_concurrent_put_and_get_of_distinct_keys(make_tier: TierFactory) -> None:
    threads_n, per_thread, rounds = 4, 16, 3
    tier = make_tier(threads_n * per_thread * SLOT)
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads_n)

    def worker(thread: int) -> None:
        try:
            barrier.wait()
            for round_ in range(rounds):
                items = []
                for index in range(per_thread):
                    key = synthetic_key(thread, index)
                    seed = thread * 10_000 + round_ * 100 + index
                    items.append((key, make_block(key, seed=seed, nbytes=500 + 37 * index)))
                for start in range(0, per_thread, 4):
                    tier.put_many(NS.digest, items[start : start + 4])
                found = tier.get_many(NS.digest, [key for key, _ in items])
                for value, (_, block) in zip(found, items, strict=True):
                    assert value is not None
                    assert bytes(value) == block.to_bytes()
                    verify_block(value)
                if round_ < rounds - 1:
                    assert tier.delete_many(NS.digest, [key for key, _ in items]) == per_thread
        except BaseException as error:  # surfaced in the main thread below
            errors.append(error)

    workers = [threading.Thread(target=worker, args=(n,)) for n in range(threads_n)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in workers)
    assert errors == []
    assert tier.used_bytes() == threads_n * per_thread * SLOT
    assert len(list(tier.scan())) == threads_n * per_thread


# --- CUDA --------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hbm_on_cuda_round_trip_and_capacity() -> None:
    tier = HBMTier(4 * SLOT, device="cuda")
    try:
        assert tier.arena.device.type == "cuda"
        blocks = [make_block(KEYS[i], seed=i, nbytes=PAYLOAD + i * 700) for i in range(3)]
        tier.put_many(NS.digest, list(zip(KEYS[:3], blocks, strict=True)))
        found = tier.get_many(NS.digest, [KEYS[1], KEYS[0], KEYS[2], KEYS[3]])
        assert found[3] is None
        for value, block in zip(found[:3], [blocks[1], blocks[0], blocks[2]], strict=True):
            assert value is not None
            assert bytes(value) == block.to_bytes()
        with pytest.raises(TierFull):
            tier.put_many(NS.digest, [(KEYS[4], make_block(KEYS[4], seed=4, nbytes=2 * SLOT))])
        assert tier.contains_many(NS.digest, [KEYS[4]]) == [False]
        assert tier.delete_many(NS.digest, KEYS[:3]) == 3
        assert tier.used_bytes() == 0
    finally:
        tier.close()
    with pytest.raises(TierUnavailable):
        tier.get_many(NS.digest, [KEYS[0]])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dram_arena_is_pinned_on_cuda_hosts() -> None:
    tier = DRAMTier(4 * SLOT)
    try:
        assert tier.arena.pinned is True
        block = make_block(KEYS[0], seed=0)
        tier.put_many(NS.digest, [(KEYS[0], block)])
        assert bytes(tier.get_many(NS.digest, [KEYS[0]])[0]) == block.to_bytes()  # type: ignore[arg-type]
    finally:
        tier.close()
    assert tier.arena.pinned is False


# --- extent generations (the shared-memory readers' seqlock) ----------------------------


def test_freeing_an_extent_bumps_its_generation_in_shared_memory() -> None:
    """Delete and replace both free an extent: its counter, which clients read in the
    segment at ``generation_offset``, grows before the extent can be reused."""
    tier = DRAMTier(4 * SLOT)
    try:
        mapped = shared_memory.SharedMemory(name=tier.arena.name)
        try:

            def counter_of(offset: int) -> int:
                at = tier.generation_offset(offset)
                assert at % 8 == 0 and 4 * SLOT <= at < 4 * SLOT + 32
                return int.from_bytes(bytes(mapped.buf[at : at + 8]), sys.byteorder)

            tier.put_many(NS.digest, [(KEYS[0], make_block(KEYS[0], seed=0))])
            first = tier.extent_of(NS.digest, KEYS[0])
            assert first is not None and first.generation == counter_of(first.offset) == 0
            tier.put_many(NS.digest, [(KEYS[0], make_block(KEYS[0], seed=1))])  # replaced
            assert counter_of(first.offset) == 1
            second = tier.extent_of(NS.digest, KEYS[0])
            assert second is not None and second.generation == counter_of(second.offset)
            tier.delete_many(NS.digest, [KEYS[0]])
            assert counter_of(second.offset) == second.generation + 1
            tier.put_many(NS.digest, [(KEYS[1], make_block(KEYS[1], seed=2))])
            third = tier.extent_of(NS.digest, KEYS[1])
            assert third is not None and third.offset in (first.offset, second.offset)
            assert third.generation == counter_of(third.offset) >= 1
            assert tier.capacity_bytes() == 4 * SLOT  # the counters are not arena space
        finally:
            mapped.close()
    finally:
        tier.close()


# --- reservations (blocks written in place, kvstore.server.landing) -----------------------------


def test_a_reserved_extent_counts_but_is_found_only_once_published() -> None:
    with_tier = DRAMTier(4 * SLOT)
    try:
        block = make_block(KEYS[0], seed=7)
        offset = with_tier.reserve(block.nbytes)
        assert offset is not None and with_tier.used_bytes() == SLOT
        with_tier.arena.writable(offset, block.nbytes)[:] = block.to_bytes()
        assert with_tier.get_many(NS.digest, [KEYS[0]]) == [None]
        with_tier.publish(NS.digest, [(KEYS[0], offset, block.nbytes)])
        got = with_tier.get_many(NS.digest, [KEYS[0]])[0]
        assert got is not None and bytes(got) == block.to_bytes()
    finally:
        with_tier.close()


def test_an_unreserved_extent_is_free_again_with_its_generation_bumped() -> None:
    with_tier = DRAMTier(2 * SLOT)
    try:
        offsets = [with_tier.reserve(SLOT), with_tier.reserve(SLOT)]
        assert None not in offsets and with_tier.reserve(SLOT) is None  # full
        with_tier.unreserve([offset for offset in offsets if offset is not None])
        assert with_tier.used_bytes() == 0
        generations = [
            int.from_bytes(
                with_tier.arena.view(with_tier.generation_offset(offset), 8), sys.byteorder
            )
            for offset in offsets
            if offset is not None
        ]
        assert generations == [1, 1]
    finally:
        with_tier.close()
