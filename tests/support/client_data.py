"""Blocks, frames and a shared-memory arena for the client tests that run without a
daemon (``test_client_protocol.py``, ``test_client_blocks.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from multiprocessing import shared_memory
from typing import Any

import torch

from kvstore.block import encode_block
from kvstore.client.blocks import FramesSink, LeasedBlock
from kvstore.client.shm import SharedArena
from kvstore.keys import ChunkKey, Namespace, chunk_keys
from kvstore.store.chunk import chunk_bytes
from kvstore.tiers.dram import DRAMTier
from kvstore.tiers.hbm import HBMTier
from kvstore.wire.frames import encode_frames
from support import kv

NS = kv.namespace(salt="protocol")
TOKENS = kv.tokens(3)
KEYS = chunk_keys(NS, TOKENS)
CHUNKS = kv.chunks(3)


def leased(tier: DRAMTier | HBMTier, key: ChunkKey, namespace: Namespace = NS) -> LeasedBlock:
    """The entry a daemon's lease gives for ``key`` (``routes._get_shared``)."""
    extent = tier.extent_of(namespace.digest, key)
    assert extent is not None
    return LeasedBlock(
        extent.offset,
        extent.nbytes,
        tier.kind,
        inline=False,
        generation=extent.generation,
        generation_at=tier.generation_offset(extent.offset),
    )


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
    """A chunk's bytes, wherever they landed: its payload, or the pages it landed in."""
    if chunk.pages is not None:
        return b"".join(page.tobytes() for page in chunk.pages.pages)
    return bytes(chunk.payload)


def expected(index: int) -> bytes:
    return CHUNKS[index].view(torch.uint8).numpy().tobytes()


@contextlib.contextmanager
def mapped_blocks(
    blocks: Sequence[bytes] = BLOCKS,
    *,
    slot: int = 8192,
    size: int = 64 << 10,
    flips: Sequence[tuple[int, int, int]] = ((1, 200, 0x01),),
) -> Iterator[SharedArena]:
    """``blocks`` in a fresh ``size``-byte shared-memory segment at ``slot``-byte slots,
    changed there by ``flips`` (block, byte in it, bit mask: by default block 1),
    mapped as a client maps the daemon's arena."""
    segment = shared_memory.SharedMemory(create=True, size=size)
    try:
        for index, block in enumerate(blocks):
            segment.buf[index * slot : index * slot + len(block)] = block
        for index, offset, mask in flips:  # changed in shared memory
            segment.buf[index * slot + offset] ^= mask
        mapped = SharedArena(segment.name)
        try:
            yield mapped
        finally:
            mapped.close()
    finally:
        segment.close()
        segment.unlink()
