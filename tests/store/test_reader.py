"""``BlockReader``: verified reads out of one tier, windowed on LMDB, straight into caller buffers.

A read that hands back a wrong byte corrupts a generation, so every refusal and fallback is exact.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from support import kv

import kvstore.store.reader as reader_module
from kvstore.block import HEADER_BYTES, Block, Codec, encode_block, frame_block, parse_header
from kvstore.codec import encode_payload
from kvstore.keys import ChunkKey, chunk_keys
from kvstore.kinds import TierKind
from kvstore.store.chunk import chunk_bytes
from kvstore.store.guarded import GuardedTier
from kvstore.store.reader import BlockReader, ReadOutcome, check_window
from kvstore.store.stats import StoreStats
from kvstore.tiers.dram import DRAMTier
from kvstore.tiers.lmdb_tier import LMDBTier

NS = kv.namespace()
OTHER = kv.namespace(salt="other-tenant")
KEYS = chunk_keys(NS, kv.tokens(6))
RAW = [bytes(chunk_bytes(tensor, kv.LAYOUT)) for tensor in kv.chunks(6)]
CHUNK = kv.LAYOUT.chunk_nbytes
BLOCK_BYTES = HEADER_BYTES + CHUNK


def block(i: int, codec: Codec = Codec.NONE) -> Block:
    payload = memoryview(encode_payload(memoryview(RAW[i]), kv.LAYOUT.dtype, codec))
    parent = KEYS[i - 1] if i else None
    return encode_block(NS, KEYS[i], parent, payload, codec=codec, raw_len=CHUNK)


def flipped(original: Block) -> Block:
    """``original`` with one payload bit flipped and its checksum left as it was."""
    payload = bytearray(original.payload)
    payload[777] ^= 0x10
    return Block(original.header, memoryview(bytes(payload)))


def exact_size_zstd(data: bytes) -> bytes:
    """A valid zstd frame of exactly ``len(data)`` bytes (a raw block, then an RLE block of
    the last 14 bytes, which must all be equal): a compressed block one chunk long."""
    rle = 14
    assert len(set(data[-rle:])) == 1

    def block_header(size: int, kind: int, last: int) -> bytes:
        return ((size << 3) | (kind << 1) | last).to_bytes(3, "little")

    head = b"\x28\xb5\x2f\xfd" + bytes([0x60]) + (len(data) - 256).to_bytes(2, "little")
    body = block_header(len(data) - rle, 0, 0) + data[:-rle] + block_header(rle, 1, 1)
    frame = head + body + data[-1:]
    assert len(frame) == len(data)
    return frame


@pytest.fixture
def reader() -> Iterator[BlockReader]:
    reader = BlockReader()
    yield reader
    reader.close()


@pytest.fixture
def stats() -> StoreStats:
    return StoreStats()


@pytest.fixture
def dram(stats: StoreStats) -> Iterator[GuardedTier]:
    tier = DRAMTier(8 * kv.ARENA_SLOT)
    yield GuardedTier(tier, stats.tier(TierKind.DRAM), threading.RLock())
    tier.close()


@pytest.fixture
def ssd(tmp_path: Path, stats: StoreStats) -> Iterator[GuardedTier]:
    tier = LMDBTier(tmp_path / "lmdb", 1 << 20, sync=False)
    yield GuardedTier(tier, stats.tier(TierKind.SSD), threading.RLock())
    tier.close()


@pytest.fixture
def windows_of_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """LMDB reads go in windows of two blocks, checked on the worker thread."""
    monkeypatch.setattr(reader_module, "VERIFY_WINDOW_BYTES", 2 * BLOCK_BYTES)


def store(tier: GuardedTier, *items: tuple[ChunkKey, Block]) -> None:
    assert tier.put_many(NS.digest, list(items))


def payloads_of(outcome: ReadOutcome) -> list[tuple[int, bytes]]:
    return [(index, bytes(chunk.payload)) for index, chunk in outcome.chunks]


def test_read_returns_the_asked_indices_with_tier_and_whole_block(
    reader: BlockReader, dram: GuardedTier
) -> None:
    store(dram, *[(KEYS[i], block(i)) for i in range(4)])
    outcome = reader.read(dram, NS, KEYS, [3, 0, 2])
    assert payloads_of(outcome) == [(3, RAW[3]), (0, RAW[0]), (2, RAW[2])]
    assert [chunk.key for _, chunk in outcome.chunks] == [KEYS[3], KEYS[0], KEYS[2]]
    assert {chunk.tier for _, chunk in outcome.chunks} == {TierKind.DRAM}
    first = outcome.chunks[0][1]
    assert first.block is not None and bytes(first.block) == block(3).to_bytes()
    assert (outcome.bad, outcome.absent, outcome.failed) == ([], [], False)
    assert outcome.bytes_read == 3 * BLOCK_BYTES


def test_misses_are_absent_in_the_order_asked(reader: BlockReader, ssd: GuardedTier) -> None:
    store(ssd, (KEYS[1], block(1)))
    outcome = reader.read(ssd, NS, KEYS, [4, 1, 0])
    assert payloads_of(outcome) == [(1, RAW[1])]
    assert outcome.absent == [KEYS[4], KEYS[0]]
    assert outcome.bytes_read == BLOCK_BYTES


def test_the_checksum_is_checked_only_where_reads_cross_a_trust_boundary(
    reader: BlockReader, dram: GuardedTier, ssd: GuardedTier
) -> None:
    damaged = flipped(block(0))
    store(dram, (KEYS[0], damaged))
    store(ssd, (KEYS[0], damaged))
    # DRAM is the store's own memory, verified on the way in: the payload is not rehashed.
    assert payloads_of(reader.read(dram, NS, KEYS, [0])) == [(0, bytes(damaged.payload))]
    from_ssd = reader.read(ssd, NS, KEYS, [0])
    assert (from_ssd.chunks, from_ssd.bad, from_ssd.bytes_read) == ([], [KEYS[0]], 0)


def test_key_namespace_and_layout_are_checked_on_every_tier(
    reader: BlockReader, dram: GuardedTier
) -> None:
    other_ns = encode_block(OTHER, KEYS[1], None, memoryview(RAW[1]))
    wider = dataclasses.replace(parse_header(block(2).header), num_layers=4)
    store(
        dram,
        (KEYS[0], block(3)),  # another key's block
        (KEYS[1], other_ns),  # another namespace's block
        (KEYS[2], frame_block(wider, memoryview(RAW[2]))),  # another layout's block
        (KEYS[3], block(3)),
    )
    outcome = reader.read(dram, NS, KEYS, [0, 1, 2, 3])
    assert outcome.bad == [KEYS[0], KEYS[1], KEYS[2]]
    assert payloads_of(outcome) == [(3, RAW[3])]


def test_a_block_that_is_not_one_chunk_of_the_layout_is_bad_not_served(
    reader: BlockReader, dram: GuardedTier
) -> None:
    # Sealed, under the right key, namespace and layout fields, but half a chunk of KV.
    half = encode_block(NS, KEYS[0], None, memoryview(RAW[0][: CHUNK // 2]))
    store(dram, (KEYS[0], half), (KEYS[1], block(1)))
    outcome = reader.read(dram, NS, KEYS, [0, 1])
    assert (outcome.bad, payloads_of(outcome)) == ([KEYS[0]], [(1, RAW[1])])
    targets = [np.zeros(CHUNK, dtype=np.uint8) for _ in range(2)]
    into = reader.read_into(dram, NS, KEYS, [0, 1], targets)
    assert (into.bad, payloads_of(into)) == ([KEYS[0]], [(1, RAW[1])])


def test_check_window_refuses_a_truncated_buffer_and_passes_misses_through(
    ssd: GuardedTier,
) -> None:
    whole = block(1).to_bytes()
    outcome = check_window(ssd, NS, KEYS, [0, 1, 2], [whole[:-1], whole, None])
    assert (outcome.bad, outcome.absent) == ([KEYS[0]], [KEYS[2]])
    assert payloads_of(outcome) == [(1, RAW[1])]


def test_a_compressed_block_is_decoded_and_has_no_forwardable_block(
    reader: BlockReader, ssd: GuardedTier
) -> None:
    compressed = block(0, Codec.ZSTD_BYTEPLANE)
    assert compressed.nbytes != BLOCK_BYTES
    store(ssd, (KEYS[0], compressed))
    outcome = reader.read(ssd, NS, KEYS, [0])
    assert payloads_of(outcome) == [(0, RAW[0])]
    assert outcome.chunks[0][1].block is None
    assert outcome.bytes_read == compressed.nbytes


def test_windowed_lmdb_read_merges_every_window_in_order(
    reader: BlockReader, ssd: GuardedTier, windows_of_two: None
) -> None:
    store(ssd, (KEYS[0], block(0)), (KEYS[1], flipped(block(1))), (KEYS[2], block(2)))
    store(ssd, (KEYS[4], block(4)), (KEYS[5], block(5)))
    outcome = reader.read(ssd, NS, KEYS, [0, 1, 2, 3, 4])
    assert payloads_of(outcome) == [(0, RAW[0]), (2, RAW[2]), (4, RAW[4])]
    assert (outcome.bad, outcome.absent, outcome.failed) == ([KEYS[1]], [KEYS[3]], False)
    assert outcome.bytes_read == 3 * BLOCK_BYTES


@pytest.mark.parametrize("windowed", [False, True])
def test_a_stopped_tier_reads_as_failed_the_first_failure_counts_one_error(
    reader: BlockReader,
    ssd: GuardedTier,
    stats: StoreStats,
    monkeypatch: pytest.MonkeyPatch,
    windowed: bool,
) -> None:
    if windowed:
        monkeypatch.setattr(reader_module, "VERIFY_WINDOW_BYTES", 2 * BLOCK_BYTES)
    store(ssd, *[(KEYS[i], block(i)) for i in range(4)])
    ssd.tier.close()
    outcome = reader.read(ssd, NS, KEYS, [0, 1, 2, 3])
    assert (outcome.failed, outcome.chunks, outcome.bad, outcome.absent) == (True, [], [], [])
    into = reader.read_into(ssd, NS, KEYS, [0], [np.zeros(CHUNK, dtype=np.uint8)])
    assert (into.failed, into.chunks) == (True, [])
    counters = stats.tier(TierKind.SSD)
    assert (counters.errors, counters.calls_refused) == (1, 1)  # then the breaker answers


def test_read_into_fills_the_callers_buffers_in_place(
    reader: BlockReader, dram: GuardedTier
) -> None:
    store(dram, (KEYS[0], block(0)), (KEYS[2], block(2)))
    targets = [np.zeros(CHUNK, dtype=np.uint8) for _ in range(3)]
    outcome = reader.read_into(dram, NS, KEYS, [2, 1, 0], targets)
    assert payloads_of(outcome) == [(2, RAW[2]), (0, RAW[0])]
    assert outcome.absent == [KEYS[1]]
    assert (targets[0].tobytes(), targets[2].tobytes()) == (RAW[2], RAW[0])
    for (_, chunk), target in zip(outcome.chunks, (targets[0], targets[2]), strict=True):
        assert np.shares_memory(np.frombuffer(chunk.payload, dtype=np.uint8), target)
    assert outcome.bytes_read == 2 * BLOCK_BYTES


def test_read_into_decodes_a_block_of_another_size_into_place(
    reader: BlockReader, ssd: GuardedTier
) -> None:
    compressed = block(0, Codec.ZSTD)
    assert compressed.nbytes != BLOCK_BYTES
    store(ssd, (KEYS[0], compressed), (KEYS[1], block(1)))
    targets = [np.zeros(CHUNK, dtype=np.uint8) for _ in range(3)]
    outcome = reader.read_into(ssd, NS, KEYS, [0, 1, 3], targets)
    assert sorted(payloads_of(outcome)) == [(0, RAW[0]), (1, RAW[1])]
    assert outcome.absent == [KEYS[3]]
    assert [target.tobytes() for target in targets[:2]] == [RAW[0], RAW[1]]
    placed = dict(outcome.chunks)[0]
    assert np.shares_memory(np.frombuffer(placed.payload, dtype=np.uint8), targets[0])
    assert outcome.bytes_read == compressed.nbytes + BLOCK_BYTES


def test_read_into_decodes_a_compressed_block_exactly_one_chunk_long_where_it_landed(
    reader: BlockReader, dram: GuardedTier
) -> None:
    data = RAW[0][:-14] + bytes(14)
    frame = exact_size_zstd(data)
    store(dram, (KEYS[0], encode_block(NS, KEYS[0], None, memoryview(frame), codec=Codec.ZSTD)))
    target = np.zeros(CHUNK, dtype=np.uint8)
    outcome = reader.read_into(dram, NS, KEYS, [0], [target])
    assert target.tobytes() == data
    assert payloads_of(outcome) == [(0, data)]
    assert outcome.bytes_read == BLOCK_BYTES


def test_windowed_read_into_refuses_a_damaged_block_and_places_the_rest(
    reader: BlockReader, ssd: GuardedTier, windows_of_two: None
) -> None:
    store(ssd, *[(KEYS[i], flipped(block(i)) if i == 2 else block(i)) for i in range(5)])
    targets = [np.zeros(CHUNK, dtype=np.uint8) for _ in range(5)]
    outcome = reader.read_into(ssd, NS, KEYS, [0, 1, 2, 3, 4], targets)
    assert payloads_of(outcome) == [(0, RAW[0]), (1, RAW[1]), (3, RAW[3]), (4, RAW[4])]
    assert (outcome.bad, outcome.absent, outcome.failed) == ([KEYS[2]], [], False)
    assert outcome.bytes_read == 4 * BLOCK_BYTES


def test_chunks_read_stay_valid_after_the_tier_reuses_their_memory(
    reader: BlockReader, dram: GuardedTier
) -> None:
    store(dram, (KEYS[0], block(0)))
    outcome = reader.read(dram, NS, KEYS, [0])
    assert dram.delete_many(NS.digest, [KEYS[0]]) == 1
    store(dram, (KEYS[1], block(1)))  # best fit reuses the freed extent
    assert payloads_of(outcome) == [(0, RAW[0])]
