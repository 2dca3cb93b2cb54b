"""The client's logic without a daemon: the sans-IO operations driven by hand, the
block verification fed tampered bytes, and both shells over an httpx ``MockTransport``
(a transport swapped in, nothing patched)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from support import kv
from support.clients import FLAVOURS, Face, opened

from kvstore import (
    CorruptBlock,
    KVStoreError,
    LayoutMismatch,
    RequestTooLarge,
    TierKind,
    TierUnavailable,
    chunk_keys,
)
from kvstore.block import HEADER_BYTES, Codec, encode_block, stored_block
from kvstore.chunk import chunk_bytes
from kvstore.client import AsyncStoreClient, ClientStats, StoreClient, aio, sync
from kvstore.client import blocks as client_blocks
from kvstore.client.address import TOKEN_ENV, Address, Scheme, bearer_token
from kvstore.client.blocks import FramesSink, LeasedBlock, Verify, copy_leased, tier_of
from kvstore.client.buffers import BufferPool
from kvstore.client.protocol import Call, ClientProtocol, Reply
from kvstore.client.put_body import BODY_SLICE_BYTES
from kvstore.client.shm import SharedArena
from kvstore.codec import encode_payload
from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, KVLayout, Namespace
from kvstore.tiers.dram import DRAMTier
from kvstore.wire import ErrorCode, encode_frames, error_body

NS = kv.namespace(salt="protocol")
TOKENS = kv.tokens(3)
KEYS = chunk_keys(NS, TOKENS)
CHUNKS = kv.chunks(3)


def block_bytes(namespace: Namespace, key: ChunkKey, chunk: torch.Tensor) -> bytes:
    return encode_block(namespace, key, None, chunk_bytes(chunk, namespace.layout)).to_bytes()


BLOCKS = [block_bytes(NS, key, chunk) for key, chunk in zip(KEYS, CHUNKS, strict=True)]


def frames(blocks: list[bytes | None], keys: list[ChunkKey] = KEYS) -> bytes:
    entries = [
        {"key": key.hex(), "length": None if block is None else len(block), "tier": "dram"}
        for key, block in zip(keys, blocks, strict=True)
    ]
    present = [block for block in blocks if block is not None]
    return b"".join(encode_frames({"blocks": entries}, present))


def flip(data: bytes, offset: int) -> bytes:
    tampered = bytearray(data)
    tampered[offset] ^= 0x01
    return bytes(tampered)


def feed_in_pieces(sink: FramesSink, body: bytes, size: int = 777) -> None:
    for start in range(0, len(body), size):
        sink.feed(body[start : start + size])
    sink.finish()


def payload_of(chunk: Any) -> bytes:
    return bytes(chunk.payload)


def expected(index: int) -> bytes:
    return CHUNKS[index].view(torch.uint8).numpy().tobytes()


# -- addresses -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "scheme", "base_url", "path"),
    [
        (
            "unix:///run/kvstore/kvstore.sock",
            Scheme.UNIX,
            "http://kvstore",
            "/run/kvstore/kvstore.sock",
        ),
        ("http://127.0.0.1:8470", Scheme.HTTP, "http://127.0.0.1:8470", None),
        ("embedded://", Scheme.EMBEDDED, "embedded://", None),
        (
            "embedded:///etc/kvstore.toml",
            Scheme.EMBEDDED,
            "embedded:///etc/kvstore.toml",
            "/etc/kvstore.toml",
        ),
    ],
)
def test_address_forms(url: str, scheme: Scheme, base_url: str, path: str | None) -> None:
    assert Address.parse(url) == Address(scheme, base_url, path)


@pytest.mark.parametrize(
    "url", ["redis://localhost", "unix://relative.sock", "http://host:1/prefix", "embedded://x"]
)
def test_address_rejects(url: str) -> None:
    with pytest.raises(ConfigError):
        Address.parse(url)


def test_token_from_the_environment_over_tcp_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert bearer_token(Address.parse("http://127.0.0.1:1"), None) == "from-env"
    assert bearer_token(Address.parse("http://127.0.0.1:1"), "given") == "given"
    assert bearer_token(Address.parse("unix:///tmp/x.sock"), "given") is None


# -- received blocks -------------------------------------------------------------------


@pytest.fixture(params=["inline", "on-a-worker"])
def verifier(request: pytest.FixtureRequest) -> Iterator[ThreadPoolExecutor | None]:
    """Verification in the feeding thread, or overlapped on a worker as the client does."""
    if request.param == "inline":
        yield None
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier") as executor:
        yield executor


def test_frames_sink_turns_every_bad_block_into_a_counted_miss(
    verifier: ThreadPoolExecutor | None,
) -> None:
    other = kv.namespace(salt="another tenant")
    keys = [*KEYS, *chunk_keys(NS, kv.tokens(2, start=10_000))]
    blocks: list[bytes | None] = [
        BLOCKS[0],  # good
        flip(BLOCKS[1], 1000),  # a payload bit flipped in transit
        BLOCKS[0],  # a good block, but of another key
        block_bytes(other, keys[3], CHUNKS[0]),  # the right key, another namespace
        None,  # not cached
    ]
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


@pytest.mark.parametrize(
    "body",
    [
        frames(BLOCKS)[:-1],  # truncated
        frames(BLOCKS) + b"x",  # trailing bytes
        frames(BLOCKS[:2], KEYS[:2]),  # fewer blocks than keys asked for
        b"\xff\xff\xff\x7f{",  # absurd metadata length
    ],
    ids=["truncated", "trailing", "short", "huge-meta"],
)
def test_frames_sink_refuses_a_malformed_body_as_the_daemon_failing(body: bytes) -> None:
    sink = FramesSink(NS, KEYS, None, BufferPool(1 << 20))
    with pytest.raises(TierUnavailable):
        feed_in_pieces(sink, body)


@pytest.fixture
def arena() -> Any:
    segment = shared_memory.SharedMemory(create=True, size=64 << 10)
    try:
        for index, block in enumerate(BLOCKS):
            segment.buf[index * 8192 : index * 8192 + len(block)] = block
        segment.buf[8192 + 200] ^= 0x01  # block 1 changed in shared memory
        mapped = SharedArena(segment.name)
        try:
            yield mapped
        finally:
            mapped.close()
    finally:
        segment.close()
        segment.unlink()


@pytest.mark.parametrize("into_out", [False, True])
def test_copy_leased_verifies_what_it_copied(arena: SharedArena, into_out: bool) -> None:
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
    destinations = [buffer.view(torch.uint8).reshape(-1).numpy() for buffer in out]
    received = copy_leased(
        arena, NS, keys, entries, destinations if into_out else None, BufferPool(1 << 20)
    )
    assert [chunk is not None for chunk in received.chunks] == [True, False, True] + [False] * 4
    assert received.corrupt == 3 and received.inline == [4]
    for index in (0, 2):
        chunk = received.chunks[index]
        assert chunk is not None and payload_of(chunk) == expected(index)
        assert torch.equal(out[index], CHUNKS[index]) is into_out
    with pytest.raises(CorruptBlock):
        arena.block(-1, 10)


SLOT = 8192
FOUR_KEYS = chunk_keys(NS, kv.tokens(4, start=50_000))
FOUR_CHUNKS = kv.chunks(4, seed=7)


@pytest.fixture
def four_blocks() -> Iterator[SharedArena]:
    """An arena of four blocks, the second and the fourth changed in shared memory."""
    segment = shared_memory.SharedMemory(create=True, size=4 * SLOT)
    try:
        for index, (key, chunk) in enumerate(zip(FOUR_KEYS, FOUR_CHUNKS, strict=True)):
            block = block_bytes(NS, key, chunk)
            segment.buf[index * SLOT : index * SLOT + len(block)] = block
        for index in (1, 3):
            segment.buf[index * SLOT + 500] ^= 0x10
        mapped = SharedArena(segment.name)
        try:
            yield mapped
        finally:
            mapped.close()
    finally:
        segment.close()
        segment.unlink()


def four_entries() -> list[LeasedBlock]:
    size = len(block_bytes(NS, FOUR_KEYS[0], FOUR_CHUNKS[0]))
    return [LeasedBlock(index * SLOT, size, TierKind.DRAM, inline=False) for index in range(4)]


@pytest.mark.parametrize("into_out", [False, True])
@pytest.mark.parametrize("helper_busy", [False, True])
def test_a_large_lease_is_copied_by_two_threads(
    four_blocks: SharedArena, monkeypatch: pytest.MonkeyPatch, into_out: bool, helper_busy: bool
) -> None:
    """Each half (blocks 0-1 here, 2-3 on the helper) verified, a corrupt block in each;
    a helper busy with another call's copy leaves both halves to the caller."""
    monkeypatch.setattr(client_blocks, "PARALLEL_COPY_BYTES", 0)
    out = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in FOUR_KEYS]
    destinations = [buffer.view(torch.uint8).reshape(-1).numpy() for buffer in out]
    copied_by: dict[ChunkKey, str] = {}
    real_copy_one = client_blocks._copy_one

    def copy_one(view: memoryview, namespace: Namespace, key: ChunkKey, *rest: Any) -> Any:
        copied_by[key] = threading.current_thread().name
        return real_copy_one(view, namespace, key, *rest)

    monkeypatch.setattr(client_blocks, "_copy_one", copy_one)
    busy = threading.Event()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="helper") as helper:
        if helper_busy:
            helper.submit(busy.wait, 10.0)
        received = copy_leased(
            four_blocks,
            NS,
            FOUR_KEYS,
            four_entries(),
            destinations if into_out else None,
            BufferPool(1 << 20),
            helper,
        )
        busy.set()
    assert [chunk is not None for chunk in received.chunks] == [True, False, True, False]
    assert received.corrupt == 2
    for index in (0, 2):
        chunk = received.chunks[index]
        assert chunk is not None and torch.equal(chunk.tensor(), FOUR_CHUNKS[index])
        assert torch.equal(out[index], FOUR_CHUNKS[index]) is into_out
    on_helper = [copied_by[key].startswith("helper") for key in FOUR_KEYS]
    assert on_helper == [False, False] + [not helper_busy] * 2


@pytest.fixture
def dram() -> Iterator[DRAMTier]:
    tier = DRAMTier(8 * SLOT)
    try:
        yield tier
    finally:
        tier.close()


def leased(tier: DRAMTier, key: ChunkKey) -> LeasedBlock:
    """The entry a daemon's lease gives for ``key`` (``routes._get_shared``)."""
    extent = tier.extent_of(NS.digest, key)
    assert extent is not None
    return LeasedBlock(
        extent.offset,
        extent.nbytes,
        TierKind.DRAM,
        inline=False,
        generation=extent.generation,
        generation_at=tier.generation_offset(extent.offset),
    )


def store_blocks(tier: DRAMTier, blocks: list[tuple[ChunkKey, bytes]]) -> None:
    tier.put_many(NS.digest, [(key, stored_block(block)) for key, block in blocks])


@pytest.mark.parametrize("into_out", [False, True])
def test_fast_copies_are_not_checksummed_while_their_extent_is_unchanged(
    dram: DRAMTier, into_out: bool
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
            destinations = [buffer.view(torch.uint8).reshape(-1).numpy() for buffer in out]
            received = copy_leased(
                arena,
                NS,
                KEYS,
                entries,
                destinations if into_out else None,
                BufferPool(1 << 20),
                verify=verify,
            )
            assert [chunk is not None for chunk in received.chunks] == served
            assert received.corrupt == served.count(False)
            chunk = received.chunks[0]
            assert chunk is not None and payload_of(chunk) == expected(0)
            assert torch.equal(out[0], CHUNKS[0]) is into_out
    finally:
        arena.close()


def test_a_fast_copy_of_an_extent_freed_since_its_lease_is_checksummed(
    dram: DRAMTier, monkeypatch: pytest.MonkeyPatch
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
    real_copy = client_blocks.copy_unverified

    def rewritten_during_the_copy(header: bytes, source: memoryview, target: memoryview) -> Any:
        # Block 1 is freed and rewritten, intact, while block 0's bytes are read.
        dram.delete_many(NS.digest, [KEYS[1]])
        store_blocks(dram, [(KEYS[1], BLOCKS[1])])
        monkeypatch.setattr(client_blocks, "copy_unverified", real_copy)
        return real_copy(header, source, target)

    try:
        dram.delete_many(NS.digest, [KEYS[0]])  # freed, then the same extent reused
        store_blocks(dram, [(KEYS[0], torn)])
        assert leased(dram, KEYS[0]).offset == entries[0].offset
        monkeypatch.setattr(client_blocks, "copy_unverified", rewritten_during_the_copy)
        received = copy_leased(
            arena, NS, KEYS[:2], entries, None, BufferPool(1 << 20), verify=Verify.FAST
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


# -- operations, driven by hand ---------------------------------------------------------


def ok(body: Any) -> Reply:
    return Reply(200, json.dumps(body).encode())


def error(status: int, code: ErrorCode) -> Reply:
    return Reply(status, json.dumps(error_body(code, "from the test")).encode())


def test_lookup_registers_once_then_asks_with_keys() -> None:
    protocol = ClientProtocol(shm=False, backoff_s=0.0)
    operation = protocol.lookup(NS, TOKENS)
    call = next(operation)
    assert (call.method, call.path) == ("POST", "/v1/namespaces")
    assert call.json["layout"]["chunk_tokens"] == kv.LAYOUT.chunk_tokens
    call = operation.send(ok({"namespace": NS.digest.hex()}))
    assert call == Call(
        "POST", "/v1/lookup", {"namespace": NS.digest.hex(), "keys": [k.hex() for k in KEYS]}
    )
    with pytest.raises(StopIteration) as done:
        operation.send(
            ok({"num_chunks": 2, "chunk_tokens": 16, "total_chunks": 3, "tiers": ["dram", "ssd"]})
        )
    prefix = done.value.value
    assert prefix.keys == tuple(KEYS[:2]) and prefix.tiers == (TierKind.DRAM, TierKind.SSD)
    assert prefix.num_tokens == 2 * kv.LAYOUT.chunk_tokens and prefix.total_chunks == 3
    # Registered now: the next operation asks straight away.
    assert next(protocol.lookup(NS, TOKENS)).path == "/v1/lookup"


def test_unknown_namespace_registers_again_and_retries_once() -> None:
    protocol = ClientProtocol(shm=False, backoff_s=0.0)
    operation = protocol.delete(NS, KEYS)
    assert next(operation).path == "/v1/namespaces"
    assert operation.send(ok({"namespace": NS.digest.hex()})).path == "/v1/delete"
    assert operation.send(error(404, ErrorCode.UNKNOWN_NAMESPACE)).path == "/v1/namespaces"
    assert operation.send(ok({"namespace": NS.digest.hex()})).path == "/v1/delete"
    with pytest.raises(StopIteration) as done:
        operation.send(ok({"deleted": 3}))
    assert done.value.value == 3


def test_a_daemon_hashing_namespaces_differently_is_refused() -> None:
    operation = ClientProtocol(shm=False, backoff_s=0.0).lookup(NS, TOKENS)
    next(operation)
    with pytest.raises(KVStoreError, match="different kvstore versions"):
        operation.send(ok({"namespace": "00" * 16}))


def test_caller_mistakes_raise_before_any_exchange() -> None:
    protocol = ClientProtocol(shm=False, backoff_s=0.0)
    wrong_dtype = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float32)]
    with pytest.raises(LayoutMismatch):
        next(protocol.put(NS, TOKENS, wrong_dtype, None))
    with pytest.raises(LayoutMismatch):
        next(protocol.put(NS, TOKENS, kv.chunks(4), None))  # more chunks than keys
    with pytest.raises(LayoutMismatch):
        next(protocol.get(NS, KEYS, [bytearray(10)] * 3))
    with pytest.raises(LayoutMismatch):
        next(protocol.get(NS, KEYS, [bytearray(kv.LAYOUT.chunk_nbytes)]))


def test_a_put_body_goes_out_in_slices_of_the_callers_buffers() -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, chunk_tokens=160)
    assert layout.chunk_nbytes > 2 * BODY_SLICE_BYTES
    namespace = Namespace("big", layout)
    tokens = np.arange(2 * layout.chunk_tokens)
    chunks = [torch.randn(layout.chunk_shape).to(torch.bfloat16) for _ in range(2)]
    operation = ClientProtocol(shm=False, backoff_s=0.0).put(namespace, tokens, chunks, None)
    next(operation)  # registers the namespace
    call = operation.send(ok({"namespace": namespace.digest.hex()}))
    assert call.path == "/v1/put" and call.body is not None
    assert all(memoryview(piece).nbytes <= BODY_SLICE_BYTES for piece in call.body)
    assert int(call.headers["Content-Length"]) == sum(len(piece) for piece in call.body)
    keys = chunk_keys(namespace, tokens)
    stored = [
        encode_block(namespace, key, parent, chunk_bytes(chunk, layout)).to_bytes()
        for key, parent, chunk in zip(keys, [None, keys[0]], chunks, strict=True)
    ]
    meta = {
        "namespace": namespace.digest.hex(),
        "session": None,
        "blocks": [{"key": k.hex(), "length": len(b)} for k, b in zip(keys, stored, strict=True)],
    }
    assert b"".join(call.body) == b"".join(bytes(p) for p in encode_frames(meta, stored))
    payload = chunks[1].view(torch.uint8).reshape(-1).numpy()
    assert any(np.shares_memory(np.frombuffer(piece, np.uint8), payload) for piece in call.body)


# -- both shells over a mock transport -----------------------------------------------


class FakeDaemon:
    """Answers the API from a dict of blocks; ``script`` overrides the next answers.

    Shared-memory gets lease the blocks of ``arena`` (a segment name) at the
    offsets in ``leased``; ``hold`` runs before a release is answered, and
    ``released`` lists the releases answered.
    """

    def __init__(self) -> None:
        self.blocks: dict[str, bytes] = {}
        self.paths: list[str] = []
        self.script: list[httpx.Response | Exception] = []
        self.arena: str | None = None
        self.leased: dict[str, tuple[int, int]] = {}
        self.hold: Callable[[], object] = lambda: None
        self.released: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if self.script:
            outcome = self.script.pop(0)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        route = request.url.path.removeprefix("/v1/")
        if route == "namespaces":
            return httpx.Response(200, json={"namespace": NS.digest.hex()})
        if route == "events":
            return httpx.Response(200, json={"accepted": True})
        if route == "shm":
            return httpx.Response(200, json={"name": self.arena})
        if route.startswith("leases/"):
            self.hold()
            self.released.append(route.split("/")[1])
            return httpx.Response(200, json={"released": 1})
        body = json.loads(request.content)
        if route == "lookup":
            run = next(
                (i for i, key in enumerate(body["keys"]) if key not in self.blocks),
                len(body["keys"]),
            )
            return httpx.Response(200, json={"num_chunks": run, "tiers": ["dram"] * run})
        if route == "get" and body["transfer"] == "shm":
            entries = [
                {"key": key, "offset": self.leased[key][0], "length": self.leased[key][1]}
                | {"tier": "dram"}
                for key in body["keys"]
            ]
            lease = f"lease{len(self.paths)}"
            return httpx.Response(200, json={"lease": lease, "shm": self.arena, "blocks": entries})
        if route == "get":
            keys = [ChunkKey(bytes.fromhex(key)) for key in body["keys"]]
            return httpx.Response(
                200, content=frames([self.blocks.get(k) for k in body["keys"]], keys)
            )
        raise AssertionError(f"unexpected {request.url.path}")


def mock_client(
    flavour: str, daemon: FakeDaemon, backoff_s: float = 0.0, shm: bool = False
) -> Face:
    transport = httpx.MockTransport(daemon)
    client_type = StoreClient if flavour == "sync" else AsyncStoreClient
    return Face(client_type("http://kvstore", transport=transport, backoff_s=backoff_s, shm=shm))


def scenario(
    flavour: str,
    body: Callable[[Face, FakeDaemon], Any],
    backoff_s: float = 0.0,
    shm: bool = False,
) -> None:
    daemon = FakeDaemon()

    async def run() -> None:
        client = mock_client(flavour, daemon, backoff_s, shm)
        try:
            await body(client, daemon)
        finally:
            await client.close()

    asyncio.run(run())


def failing(status: int, code: ErrorCode) -> httpx.Response:
    return httpx.Response(status, json=error_body(code, "from the test"))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_block_tampered_in_transit_is_never_returned(flavour: str) -> None:
    async def body(client: Face, daemon: FakeDaemon) -> None:
        daemon.blocks = {KEYS[0].hex(): BLOCKS[0], KEYS[1].hex(): flip(BLOCKS[1], 100)}
        chunks = await client.get(NS, KEYS)
        assert chunks[0] is not None and payload_of(chunks[0]) == expected(0)
        assert chunks[1] is None and chunks[2] is None
        assert (await client.client_stats()).corrupt_blocks == 1

    scenario(flavour, body)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_failing_daemon_degrades_where_the_engine_must_not_stall(flavour: str) -> None:
    async def body(client: Face, daemon: FakeDaemon) -> None:
        await client.lookup(NS, KEYS)  # registered
        daemon.script = [failing(500, ErrorCode.INTERNAL)]
        assert (await client.lookup(NS, KEYS)).num_tokens == 0
        daemon.script = [httpx.Response(200, content=b"not json")]
        assert await client.put(NS, TOKENS, CHUNKS) == 0
        daemon.script = [failing(503, ErrorCode.UNAVAILABLE)]
        assert await client.get(NS, KEYS) == [None] * 3
        daemon.script = [httpx.ReadTimeout("too slow")]
        await client.request_started("s", prompt_tokens=10, cached_tokens=0)
        stats = await client.client_stats()
        assert (stats.lookups_failed, stats.puts_dropped, stats.gets_failed) == (1, 1, 1)
        assert stats.events_dropped == 1
        # Facts the client cannot make up raise instead.
        daemon.script = [failing(503, ErrorCode.UNAVAILABLE)]
        with pytest.raises(TierUnavailable):
            await client.delete(NS, KEYS)
        daemon.script = [httpx.ConnectError("refused")]
        with pytest.raises(TierUnavailable):
            await client.stats()

    scenario(flavour, body)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_after_a_failure_the_daemon_is_left_alone_for_the_backoff(flavour: str) -> None:
    async def body(client: Face, daemon: FakeDaemon) -> None:
        daemon.script = [httpx.ConnectError("refused")]
        assert (await client.lookup(NS, KEYS)).num_tokens == 0
        assert await client.get(NS, KEYS) == [None] * 3
        assert await client.put(NS, TOKENS, CHUNKS) == 0
        with pytest.raises(TierUnavailable, match="back-off"):
            await client.delete(NS, KEYS)
        assert daemon.paths == ["/v1/namespaces"]  # one try, then none until the back-off ends

    scenario(flavour, body, backoff_s=60.0)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize(
    ("status", "code", "raised"),
    [
        (401, ErrorCode.UNAUTHORIZED, KVStoreError),
        (422, ErrorCode.LAYOUT_MISMATCH, LayoutMismatch),
        (413, ErrorCode.REQUEST_TOO_LARGE, RequestTooLarge),
    ],
)
def test_a_wrong_request_raises(flavour: str, status: int, code: ErrorCode, raised: type) -> None:
    async def body(client: Face, daemon: FakeDaemon) -> None:
        await client.lookup(NS, KEYS)  # registered
        daemon.script = [failing(status, code)]
        with pytest.raises(raised, match=code.value):
            await client.put(NS, TOKENS, CHUNKS)
        assert await client.client_stats() == ClientStats()

    scenario(flavour, body)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_connection_dead_before_answering_is_retried_once(flavour: str) -> None:
    async def body(client: Face, daemon: FakeDaemon) -> None:
        daemon.blocks = {KEYS[0].hex(): BLOCKS[0]}
        daemon.script = [httpx.RemoteProtocolError("Server disconnected")]
        assert (await client.lookup(NS, KEYS)).num_chunks == 1
        assert daemon.paths == ["/v1/namespaces", "/v1/namespaces", "/v1/lookup"]
        # Events are not idempotent: not sent twice, dropped instead.
        daemon.script = [httpx.RemoteProtocolError("Server disconnected")]
        await client.request_finished(
            "s", steps=1, output_tokens=1, context_tokens=2, loaded_tokens=1, recomputed_tokens=1
        )
        assert (await client.client_stats()).events_dropped == 1

    scenario(flavour, body)


@pytest.fixture
def leased_daemon(arena: SharedArena) -> Callable[[FakeDaemon], None]:
    """Sets a ``FakeDaemon`` up to lease blocks 0 and 2 of the ``arena`` fixture."""

    def setup(daemon: FakeDaemon) -> None:
        daemon.arena = arena.name
        daemon.leased = {KEYS[i].hex(): (i * 8192, len(BLOCKS[i])) for i in (0, 2)}

    return setup


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_get_does_not_wait_for_its_lease_release_but_close_does(
    flavour: str, leased_daemon: Callable[[FakeDaemon], None]
) -> None:
    held = threading.Event()
    seen: list[FakeDaemon] = []

    async def body(client: Face, daemon: FakeDaemon) -> None:
        seen.append(daemon)
        leased_daemon(daemon)
        if flavour == "sync":  # sent by another thread: hold its answer there
            daemon.hold = lambda: held.wait(10.0)
        got = await client.get(NS, [KEYS[0], KEYS[2]])
        assert [payload_of(chunk) for chunk in got] == [expected(0), expected(2)]
        assert daemon.released == []  # the get returned before its release was answered
        held.set()
        await client.get(NS, [KEYS[2]])

    scenario(flavour, body, shm=True)
    assert len(seen[0].released) == 2  # answered by close() at the latest


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_past_the_background_limit_a_release_is_sent_in_place(
    flavour: str, leased_daemon: Callable[[FakeDaemon], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sync, "MAX_DETACHED_CALLS", 0)
    monkeypatch.setattr(aio, "MAX_DETACHED_CALLS", 0)

    async def body(client: Face, daemon: FakeDaemon) -> None:
        leased_daemon(daemon)
        got = await client.get(NS, [KEYS[0]])
        assert got[0] is not None and payload_of(got[0]) == expected(0)
        assert len(daemon.released) == 1

    scenario(flavour, body, shm=True)


def test_the_token_is_sent_as_a_bearer_header() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"accepted": True})

    with StoreClient(
        "http://kvstore", transport=httpx.MockTransport(handler), token="t0k"
    ) as client:
        client.request_started("s", prompt_tokens=1, cached_tokens=0)
    assert seen == ["Bearer t0k"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_no_daemon_at_all_is_a_degraded_answer_and_leaks_no_socket(
    flavour: str, tmp_path: Path
) -> None:
    """The blocking Unix transport closes the socket of a refused connect (httpcore's
    own leaves it to the garbage collector: a ResourceWarning, an error here)."""

    async def run() -> None:
        async with opened(flavour, f"unix://{tmp_path}/absent.sock", backoff_s=0.0) as store:
            for _ in range(3):
                assert (await store.lookup(NS, TOKENS)).num_tokens == 0
            assert (await store.client_stats()).lookups_failed == 3

    asyncio.run(run())


def test_a_put_body_frames_each_block_once_and_skips_absent_chunks() -> None:
    chunks = kv.chunks(3)
    operation = ClientProtocol(shm=False, backoff_s=0.0).put(NS, TOKENS, [None, *chunks[1:]], None)
    next(operation)  # registers the namespace
    call = operation.send(ok({"namespace": NS.digest.hex()}))
    assert call.body is not None
    first = b"".join(call.body)
    assert b"".join(call.body) == first  # sent again (a retry): the same bytes
    stored = [
        encode_block(NS, KEYS[i], KEYS[i - 1], chunk_bytes(chunks[i], kv.LAYOUT)).to_bytes()
        for i in (1, 2)
    ]
    meta = {
        "namespace": NS.digest.hex(),
        "session": None,
        "blocks": [
            {"key": KEYS[0].hex(), "length": None},
            *({"key": KEYS[i].hex(), "length": len(stored[i - 1])} for i in (1, 2)),
        ],
    }
    assert first == b"".join(bytes(p) for p in encode_frames(meta, stored))
    assert int(call.headers["Content-Length"]) == len(first)
