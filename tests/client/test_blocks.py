"""The client's handling of received blocks without a daemon: frames fed tampered
bytes, copies out of a shared-memory arena (fast and full verification), and the
buffer pool."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from support import kv
from support.client_data import (
    BLOCKS,
    CHUNKS,
    KEYS,
    NS,
    block_bytes,
    expected,
    feed_in_pieces,
    flip,
    frames,
    leased,
    mapped_blocks,
    payload_of,
)

from kvstore import (
    CorruptBlock,
    TierKind,
    TierUnavailable,
    chunk_keys,
)
from kvstore.block import HEADER_BYTES, Codec, encode_block, stored_block
from kvstore.client import blocks as client_blocks
from kvstore.client.blocks import FramesSink, LeasedBlock, Verify, copy_leased, tier_of
from kvstore.client.buffers import BufferPool
from kvstore.client.get_body import SocketBody
from kvstore.client.protocol import ClientProtocol
from kvstore.client.shm import SharedArena
from kvstore.client.transports import BodyStream
from kvstore.codec import encode_payload
from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey
from kvstore.store.chunk import ChunkPages, chunk_bytes
from kvstore.tiers.dram import DRAMTier

# -- received blocks -------------------------------------------------------------------


@pytest.fixture(params=["inline", "on-a-worker"])
def verifier(request: pytest.FixtureRequest) -> Iterator[ThreadPoolExecutor | None]:
    """Verification in the feeding thread, or overlapped on a worker as the client does."""
    if request.param == "inline":
        yield None
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier") as executor:
        yield executor


def one_of_each_miss(keys: list[ChunkKey]) -> list[bytes | None]:
    """A good block for ``keys[0]``, then one of each way a block is a miss, for
    ``keys[1:5]``."""
    other = kv.namespace(salt="another tenant")
    return [
        BLOCKS[0],  # good
        flip(BLOCKS[1], 1000),  # a payload bit flipped in transit
        BLOCKS[0],  # a good block, but of another key
        block_bytes(other, keys[3], CHUNKS[0]),  # the right key, another namespace
        None,  # not cached
    ]


def test_frames_sink_turns_every_bad_block_into_a_counted_miss(
    verifier: ThreadPoolExecutor | None,
) -> None:
    keys = [*KEYS, *chunk_keys(NS, kv.tokens(2, start=10_000))]
    blocks = one_of_each_miss(keys)
    sink = FramesSink(NS, keys, None, BufferPool(1 << 20), verifier)
    feed_in_pieces(sink, frames(blocks, keys))
    assert [chunk is not None for chunk in sink.received.chunks] == [
        True,
        False,
        False,
        False,
        False,
    ]
    assert sink.received.corrupt == 3
    first = sink.received.chunks[0]
    assert first is not None and first.tier is TierKind.DRAM and first.key == KEYS[0]
    assert payload_of(first) == expected(0)
    assert torch.equal(first.tensor(), CHUNKS[0])


def test_frames_sink_writes_payloads_into_out_buffers(verifier: ThreadPoolExecutor | None) -> None:
    out = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in KEYS]
    destinations = [buffer.view(torch.uint8).reshape(-1).numpy() for buffer in out]
    sink = FramesSink(NS, KEYS, destinations, BufferPool(1 << 20), verifier)
    feed_in_pieces(sink, frames([BLOCKS[0], None, BLOCKS[2]]), size=100)
    assert torch.equal(out[0], CHUNKS[0]) and torch.equal(out[2], CHUNKS[2])
    chunk = sink.received.chunks[2]
    assert chunk is not None
    assert np.shares_memory(np.frombuffer(chunk.payload, dtype=np.uint8), destinations[2])


def test_frames_sink_decodes_a_compressed_block_into_out_buffers(
    verifier: ThreadPoolExecutor | None,
) -> None:
    raw = chunk_bytes(CHUNKS[1], NS.layout)
    packed = memoryview(encode_payload(raw, "float16", Codec.ZSTD))
    compressed = encode_block(NS, KEYS[1], None, packed, codec=Codec.ZSTD, raw_len=raw.nbytes)
    assert compressed.nbytes != len(BLOCKS[1])
    out = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in KEYS]
    destinations = [buffer.view(torch.uint8).reshape(-1).numpy() for buffer in out]
    sink = FramesSink(NS, KEYS, destinations, BufferPool(1 << 20), verifier)
    feed_in_pieces(sink, frames([BLOCKS[0], compressed.to_bytes(), BLOCKS[2]]), size=333)
    assert all(torch.equal(buffer, chunk) for buffer, chunk in zip(out, CHUNKS, strict=True))
    for chunk, destination in zip(sink.received.chunks, destinations, strict=True):
        assert chunk is not None
        assert np.shares_memory(np.frombuffer(chunk.payload, dtype=np.uint8), destination)


def test_a_failed_get_leaves_no_verification_writing_to_the_callers_buffers() -> None:
    """``settle``: the verifications still queued behind a busy worker are dropped,
    so once the get has failed nothing touches ``out``."""
    out = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in KEYS]
    destinations = [buffer.view(torch.uint8).reshape(-1).numpy() for buffer in out]
    compressed = [  # decoded into ``out`` by the verification itself, not by the decoder
        encode_block(
            NS,
            key,
            None,
            memoryview(encode_payload(chunk_bytes(chunk, NS.layout), "float16", Codec.ZSTD)),
            codec=Codec.ZSTD,
            raw_len=NS.layout.chunk_nbytes,
        ).to_bytes()
        for key, chunk in zip(KEYS, CHUNKS, strict=True)
    ]
    busy = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(busy.wait, 10.0)
        sink = FramesSink(NS, KEYS, destinations, BufferPool(1 << 20), worker)
        sink.feed(frames(compressed))  # every block complete, its verification queued
        sink.settle()
        busy.set()
    assert sink.received.chunks == [None] * 3
    assert all(not destination.any() for destination in destinations)


def test_tier_labels_the_client_does_not_know_are_the_daemon_failing() -> None:
    assert tier_of("ssd") is TierKind.SSD
    for label in ("SSD", "floppy", None, ["dram"]):
        with pytest.raises(TierUnavailable):
            tier_of(label)


# Bodies a daemon could only send by failing: fed or read off a socket alike.
MALFORMED_BODIES = pytest.mark.parametrize(
    "body",
    [
        frames(BLOCKS)[:-1],  # truncated
        frames(BLOCKS) + b"x",  # trailing bytes
        frames(BLOCKS[:2], KEYS[:2]),  # fewer blocks than keys asked for
        b"\xff\xff\xff\x7f{",  # absurd metadata length
    ],
    ids=["truncated", "trailing", "short", "huge-meta"],
)


@MALFORMED_BODIES
def test_frames_sink_refuses_a_malformed_body_as_the_daemon_failing(body: bytes) -> None:
    sink = FramesSink(NS, KEYS, None, BufferPool(1 << 20))
    with pytest.raises(TierUnavailable):
        feed_in_pieces(sink, body)


# -- bodies read off the socket (``FramesSink.receive``) ------------------------------

GET = httpx.Request("POST", "http://kvstore/v1/get")


def receive_over_socket(
    sink: FramesSink, body: bytes, *, pending: int = 5, send: int | None = None
) -> None:
    """``sink.receive`` a ``body`` of ``len(body)`` bytes: its first ``pending`` bytes
    as if already read past the response head, the rest (or ``send`` bytes of it,
    then a hang-up) over a real socket pair, sent by another thread."""
    ours, theirs = socket.socketpair()

    def sender() -> None:
        with contextlib.suppress(OSError), theirs:  # the reader may stop early
            theirs.sendall(body[pending : send if send is None else pending + send])

    thread = threading.Thread(target=sender)
    thread.start()
    try:
        sink.receive(SocketBody(ours, body[:pending], len(body), 5.0, GET))
    finally:
        ours.close()
        thread.join()


def test_a_body_off_the_socket_turns_every_bad_block_into_a_counted_miss() -> None:
    keys = [*KEYS, *chunk_keys(NS, kv.tokens(4, start=10_000))]
    blocks = [
        *one_of_each_miss(keys),
        flip(BLOCKS[2], 3),  # a header bit flipped: refused before its payload is read
        block_bytes(NS, keys[6], CHUNKS[2]),  # good, after the bad header's payload
    ]
    sink = FramesSink(NS, keys, None, BufferPool(1 << 20))
    receive_over_socket(sink, frames(blocks, keys))
    got = [chunk is not None for chunk in sink.received.chunks]
    assert got == [True, False, False, False, False, False, True]
    assert sink.received.corrupt == 4
    first, last = sink.received.chunks[0], sink.received.chunks[6]
    assert first is not None and first.tier is TierKind.DRAM and first.key == KEYS[0]
    assert torch.equal(first.tensor(), CHUNKS[0])
    assert last is not None and torch.equal(last.tensor(), CHUNKS[2])


def test_a_body_off_the_socket_lands_in_the_out_buffers_raw_or_decoded() -> None:
    raw = chunk_bytes(CHUNKS[1], NS.layout)
    packed = memoryview(encode_payload(raw, "float16", Codec.ZSTD))
    compressed = encode_block(NS, KEYS[1], None, packed, codec=Codec.ZSTD, raw_len=raw.nbytes)
    out = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in KEYS]
    destinations = [buffer.view(torch.uint8).reshape(-1).numpy() for buffer in out]
    sink = FramesSink(NS, KEYS, destinations, BufferPool(1 << 20))
    receive_over_socket(sink, frames([BLOCKS[0], compressed.to_bytes(), BLOCKS[2]]))
    assert all(torch.equal(buffer, chunk) for buffer, chunk in zip(out, CHUNKS, strict=True))
    for chunk, destination in zip(sink.received.chunks, destinations, strict=True):
        assert chunk is not None
        assert np.shares_memory(np.frombuffer(chunk.payload, dtype=np.uint8), destination)


@MALFORMED_BODIES
def test_a_malformed_body_off_the_socket_is_the_daemon_failing(body: bytes) -> None:
    with pytest.raises(TierUnavailable):
        receive_over_socket(FramesSink(NS, KEYS, None, BufferPool(1 << 20)), body, pending=2)


def test_a_daemon_hanging_up_mid_body_is_a_read_error() -> None:
    """Raised as httpx's, for the shell to translate (``client.failures``)."""
    with pytest.raises(httpx.ReadError):
        receive_over_socket(
            FramesSink(NS, KEYS, None, BufferPool(1 << 20)), frames(BLOCKS), send=5000
        )


def test_the_stream_cuts_a_response_head_from_its_body() -> None:
    """h11 gets the head and nothing more; the body's first bytes wait for
    ``take_body_start``, or for the next read if h11 reads the body after all."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n"
    ours, theirs = socket.socketpair()
    with ours, theirs:
        stream = BodyStream(ours)
        stream.write(b"POST / HTTP/1.1\r\n\r\n", timeout=1.0)
        theirs.sendall(head[:-1])  # the blank line split across two reads
        got = stream.read(65536, timeout=1.0)
        theirs.sendall(head[-1:] + b"hello world")
        got += stream.read(65536, timeout=1.0)
        assert got == head
        assert stream.take_body_start() == b"hello world"
        stream.give_back(b"hello world")
        assert stream.read(65536, timeout=1.0) == b"hello world"
        stream.write(b"POST / HTTP/1.1\r\n\r\n", timeout=1.0)  # the next request
        assert stream.take_body_start() is None  # no head read since


@pytest.fixture
def arena() -> Iterator[SharedArena]:
    with mapped_blocks() as mapped:
        yield mapped


INTO = ["a pool buffer", "out", "pages"]


def destinations(out: list[torch.Tensor], into: str) -> list[np.ndarray | ChunkPages] | None:
    """Where copies land: buffers of the pool, each tensor's bytes, or each tensor's
    bytes as pages of unequal sizes (a paged cache's block)."""
    if into == "a pool buffer":
        return None
    flat = [buffer.view(torch.uint8).reshape(-1).numpy() for buffer in out]
    if into == "out":
        return list(flat)
    return [ChunkPages((array[:100], array[100:1500], array[1500:])) for array in flat]


@pytest.mark.parametrize("into", INTO)
def test_copy_leased_verifies_what_it_copied(arena: SharedArena, into: str) -> None:
    size = len(BLOCKS[0])
    keys = [*KEYS, *chunk_keys(NS, kv.tokens(4, start=10_000))]
    entries = [
        LeasedBlock(0, size, TierKind.DRAM, inline=False),
        LeasedBlock(8192, size, TierKind.DRAM, inline=False),  # tampered in the arena
        LeasedBlock(16384, size, TierKind.DRAM, inline=False),
        LeasedBlock(60 << 10, size, TierKind.DRAM, inline=False),  # runs past the arena
        LeasedBlock(None, None, None, inline=True),
        LeasedBlock(None, None, None, inline=False),  # missing
        LeasedBlock(0, 100, TierKind.DRAM, inline=False),  # shorter than a header
    ]
    out = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in keys]
    into_pages = destinations(out, into)
    received = copy_leased(arena, NS, keys, entries, into_pages, BufferPool(1 << 20))
    assert [chunk is not None for chunk in received.chunks] == [True, False, True] + [False] * 4
    assert received.corrupt == 3 and received.inline == [4]
    for index in (0, 2):
        chunk = received.chunks[index]
        assert chunk is not None and payload_of(chunk) == expected(index)
        assert torch.equal(out[index], CHUNKS[index]) is (into != "a pool buffer")
        if into == "pages":
            assert into_pages is not None and chunk.pages is into_pages[index]
            assert chunk.payload.nbytes == 0 and torch.equal(chunk.tensor(), CHUNKS[index])
    with pytest.raises(CorruptBlock):
        arena.block(-1, 10)


SLOT = 8192
FOUR_KEYS = chunk_keys(NS, kv.tokens(4, start=50_000))
FOUR_CHUNKS = kv.chunks(4, seed=7)


@pytest.fixture
def four_blocks() -> Iterator[SharedArena]:
    """An arena of four blocks, the second and the fourth changed in shared memory."""
    blocks = [
        block_bytes(NS, key, chunk) for key, chunk in zip(FOUR_KEYS, FOUR_CHUNKS, strict=True)
    ]
    flips = [(1, 500, 0x10), (3, 500, 0x10)]
    with mapped_blocks(blocks, slot=SLOT, size=4 * SLOT, flips=flips) as arena:
        yield arena


def four_entries() -> list[LeasedBlock]:
    size = len(block_bytes(NS, FOUR_KEYS[0], FOUR_CHUNKS[0]))
    return [LeasedBlock(index * SLOT, size, TierKind.DRAM, inline=False) for index in range(4)]


@pytest.mark.parametrize("into_out", [False, True])
@pytest.mark.parametrize("helper_busy", [False, True])
def test_a_large_lease_is_copied_by_two_threads(
    four_blocks: SharedArena, monkeypatch: pytest.MonkeyPatch, into_out: bool, helper_busy: bool
) -> None:
    """Both threads take blocks as they come (here checksummed whole: no generations),
    each verified, the corrupt ones missed; a helper busy with another call's copy is
    not waited for, and this thread copies everything."""
    monkeypatch.setattr(client_blocks, "PARALLEL_COPY_BYTES", 0)
    monkeypatch.setattr(client_blocks, "PARALLEL_BLOCK_BYTES", 0)
    out = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in FOUR_KEYS]
    destinations = [buffer.view(torch.uint8).reshape(-1).numpy() for buffer in out]
    copied_by: list[str] = []
    helper_copied = threading.Event()
    real_copy_payload = client_blocks.copy_payload

    def copy_payload(*args: Any) -> Any:
        name = threading.current_thread().name
        copied_by.append(name)
        if name.startswith("helper"):
            helper_copied.set()
        elif not helper_busy:  # leave the helper's thread time to take a block
            helper_copied.wait(5.0)
        return real_copy_payload(*args)

    monkeypatch.setattr(client_blocks, "copy_payload", copy_payload)
    busy = threading.Event()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="helper") as helper:
        if helper_busy:
            helper.submit(busy.wait, 10.0)
        started = time.monotonic()
        received = copy_leased(
            four_blocks,
            NS,
            FOUR_KEYS,
            four_entries(),
            destinations if into_out else None,
            BufferPool(1 << 20),
            helper,
        )
        took = time.monotonic() - started
        busy.set()
    assert [chunk is not None for chunk in received.chunks] == [True, False, True, False]
    assert received.corrupt == 2
    for index in (0, 2):
        chunk = received.chunks[index]
        assert chunk is not None and torch.equal(chunk.tensor(), FOUR_CHUNKS[index])
        assert torch.equal(out[index], FOUR_CHUNKS[index]) is into_out
    assert len(copied_by) == 4  # each block copied once
    on_helper = sum(name.startswith("helper") for name in copied_by)
    if helper_busy:
        assert on_helper == 0 and took < 5.0
    else:
        assert on_helper >= 1


@pytest.fixture
def dram() -> Iterator[DRAMTier]:
    tier = DRAMTier(8 * SLOT)
    try:
        yield tier
    finally:
        tier.close()


def store_blocks(tier: DRAMTier, blocks: list[tuple[ChunkKey, bytes]]) -> None:
    tier.put_many(NS.digest, [(key, stored_block(block)) for key, block in blocks])


@pytest.mark.parametrize("into", INTO)
def test_fast_copies_are_not_checksummed_while_their_extent_is_unchanged(
    dram: DRAMTier, into: str
) -> None:
    """FAST trusts what the daemon verified on the way in for as long as the extent's
    generation says it was not freed: a bit flipped in place (memory rot, the scrub's
    job) gets through FAST and not FULL; a block under another key fails either way."""
    store_blocks(dram, [(KEYS[0], BLOCKS[0]), (KEYS[1], BLOCKS[1]), (KEYS[2], BLOCKS[0])])
    entries = [leased(dram, key) for key in KEYS]
    rot = entries[1].offset
    assert rot is not None
    dram.arena.array(rot + 300, 1, np.uint8)[0] ^= 0x01
    arena = SharedArena(dram.arena.name)
    try:
        for verify, served in (
            (Verify.FAST, [True, True, False]),
            (Verify.FULL, [True] + [False] * 2),
        ):
            out = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in KEYS]
            received = copy_leased(
                arena,
                NS,
                KEYS,
                entries,
                destinations(out, into),
                BufferPool(1 << 20),
                verify=verify,
            )
            assert [chunk is not None for chunk in received.chunks] == served
            assert received.corrupt == served.count(False)
            chunk = received.chunks[0]
            assert chunk is not None and payload_of(chunk) == expected(0)
            assert torch.equal(out[0], CHUNKS[0]) is (into != "a pool buffer")
    finally:
        arena.close()


@pytest.mark.parametrize("into_out", [False, True])
def test_fast_copies_of_a_large_batch_are_shared_with_the_helper(
    dram: DRAMTier, monkeypatch: pytest.MonkeyPatch, into_out: bool
) -> None:
    """FAST copies of a large batch are taken by both threads as they come (two
    threads copy more than one, ``PARALLEL_COPY_BYTES``); every block is copied
    exactly once, whole."""
    monkeypatch.setattr(client_blocks, "PARALLEL_COPY_BYTES", 0)
    monkeypatch.setattr(client_blocks, "PARALLEL_BLOCK_BYTES", 0)
    store_blocks(dram, [(KEYS[0], BLOCKS[0]), (KEYS[1], BLOCKS[1]), (KEYS[2], BLOCKS[2])])
    entries = [leased(dram, key) for key in KEYS]
    copies: list[tuple[str, int]] = []
    real_copy_range = client_blocks._copy_range
    helper_copied = threading.Event()

    def copy_range(source: memoryview, target: memoryview) -> None:
        name = threading.current_thread().name
        copies.append((name, memoryview(target).nbytes))
        if name.startswith("helper"):
            helper_copied.set()
        else:  # leave the helper's thread time to take a block
            helper_copied.wait(5.0)
        real_copy_range(source, target)

    monkeypatch.setattr(client_blocks, "_copy_range", copy_range)
    out = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in KEYS]
    destinations = [buffer.view(torch.uint8).reshape(-1).numpy() for buffer in out]
    arena = SharedArena(dram.arena.name)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="helper") as helper:
            received = copy_leased(
                arena,
                NS,
                KEYS,
                entries,
                destinations if into_out else None,
                BufferPool(1 << 20),
                helper,
                Verify.FAST,
            )
    finally:
        arena.close()
    assert received.corrupt == 0
    for index, chunk in enumerate(received.chunks):
        assert chunk is not None and payload_of(chunk) == expected(index)
        assert torch.equal(out[index], CHUNKS[index]) is into_out
    assert sorted(size for _, size in copies) == [len(BLOCKS[0]) - HEADER_BYTES] * 3
    assert any(name.startswith("helper") for name, _ in copies)


@pytest.mark.parametrize("into", ["a pool buffer", "pages"])
def test_a_fast_copy_of_an_extent_freed_since_its_lease_is_checksummed(
    dram: DRAMTier, monkeypatch: pytest.MonkeyPatch, into: str
) -> None:
    """The hazards FAST exists for: the extent freed and rewritten (a lease that
    expired, a delete that ignores pins) before or during the copy. Whatever the
    new bytes are, even the block's own header over a torn payload, the generation
    changed, so the copy is checksummed and the torn block is a miss; a block
    rewritten intact still verifies and is served."""
    store_blocks(dram, [(KEYS[0], BLOCKS[0]), (KEYS[1], BLOCKS[1])])
    entries = [leased(dram, KEYS[0]), leased(dram, KEYS[1])]
    torn = BLOCKS[0][: HEADER_BYTES + 100] + BLOCKS[1][HEADER_BYTES + 100 :]
    arena = SharedArena(dram.arena.name)
    real_copy = client_blocks._copy_range
    rewritten: list[int] = []

    def rewritten_during_the_copy(source: memoryview, target: Any) -> None:
        # Block 1 is freed and rewritten, intact, while block 0's bytes are read.
        if not rewritten:
            dram.delete_many(NS.digest, [KEYS[1]])
            store_blocks(dram, [(KEYS[1], BLOCKS[1])])
            rewritten.append(1)
        real_copy(source, target)

    try:
        dram.delete_many(NS.digest, [KEYS[0]])  # freed, then the same extent reused
        store_blocks(dram, [(KEYS[0], torn)])
        assert leased(dram, KEYS[0]).offset == entries[0].offset
        monkeypatch.setattr(client_blocks, "_copy_range", rewritten_during_the_copy)
        out = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in KEYS[:2]]
        received = copy_leased(
            arena,
            NS,
            KEYS[:2],
            entries,
            destinations(out, into),
            BufferPool(1 << 20),
            verify=Verify.FAST,
        )
        assert received.chunks[0] is None and received.corrupt == 1
        chunk = received.chunks[1]
        assert chunk is not None and payload_of(chunk) == expected(1)
        assert leased(dram, KEYS[1]).generation == entries[1].generation + 1  # type: ignore[operator]
    finally:
        arena.close()


def test_a_lease_without_generations_is_checksummed_even_when_fast(arena: SharedArena) -> None:
    """A daemon that does not report generations (an older one) gets FULL checks."""
    size = len(BLOCKS[0])
    entries = [LeasedBlock(index * 8192, size, TierKind.DRAM, inline=False) for index in range(3)]
    received = copy_leased(arena, NS, KEYS, entries, None, BufferPool(1 << 20), verify=Verify.FAST)
    assert [chunk is not None for chunk in received.chunks] == [True, False, True]


def test_verify_must_be_fast_or_full() -> None:
    assert ClientProtocol(shm=True, backoff_s=1.0, verify="full").verify is Verify.FULL
    with pytest.raises(ConfigError):
        ClientProtocol(shm=True, backoff_s=1.0, verify="none")


def address(buffer: memoryview) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def test_a_pool_buffer_is_reused_only_once_nothing_refers_to_it() -> None:
    pool = BufferPool(1 << 20)
    first = pool.take(4096)
    where = address(first)
    tensor = torch.frombuffer(first, dtype=torch.uint8)  # what a caller makes of a chunk
    del first
    second = pool.take(4096)
    assert address(second) != where
    del tensor
    assert address(pool.take(4096)) == where


def test_a_pool_keeps_at_most_its_limit() -> None:
    pool = BufferPool(8192)
    taken = [pool.take(4096) for _ in range(3)]
    del taken
    assert pool.held_bytes == 8192
    again = [pool.take(4096) for _ in range(3)]
    assert pool.held_bytes == 0 and len({address(buffer) for buffer in again}) == 3


def test_lease_entries_that_make_no_sense_are_the_daemon_failing() -> None:
    with pytest.raises(TierUnavailable):
        LeasedBlock.parse({"key": KEYS[0].hex(), "offset": "x", "length": 1, "tier": "dram"})
    with pytest.raises(TierUnavailable):
        LeasedBlock.parse({"key": KEYS[0].hex(), "offset": 0, "length": 1, "tier": "floppy"})
