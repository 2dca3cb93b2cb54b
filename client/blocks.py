"""Blocks arriving from the daemon: verified before the caller sees a byte of them.

The socket and the shared arena are trust boundaries, exactly like a read
from LMDB: every block is checked against its checksum (header and payload),
and against the key, namespace and layout that were asked for. A block that
fails any check is a miss, counted as corrupt, and never returned; a wrong
block would silently corrupt a generation, while a miss only costs a
recompute.

Two sources, one check (``accept``):

* ``FramesSink`` takes a ``"bytes"`` get's frames body as it streams in
  (``kvstore.wire.FrameDecoder``), so no whole body is ever buffered.
* ``copy_leased`` copies the blocks a ``"shm"`` lease points at out of the
  read-only mapping (``client.shm``) *first* and verifies the copy, so a
  block changed in shared memory during the copy is caught, not served.

With ``out`` buffers the payload lands in the caller's buffer and the
returned ``KVChunk`` is a view of it, as with ``TieredStore.get(out=)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.block import (
    HEADER_BYTES,
    Codec,
    check_identity,
    parse_header,
    verify_block,
    verify_parts,
)
from kvstore.chunk import KVChunk
from kvstore.client.failures import unavailable
from kvstore.client.shm import SharedArena
from kvstore.codec import decode_payload
from kvstore.errors import CorruptBlock, LayoutMismatch
from kvstore.keys import ChunkKey, Namespace
from kvstore.tiers.base import TierKind
from kvstore.wire import FrameDecoder, FrameLimits, WireError

Destinations = Sequence[np.ndarray] | None


@dataclass
class Received:
    """What a get has so far: ``chunks[i]`` verified or ``None``; how many were corrupt."""

    chunks: list[KVChunk | None]
    corrupt: int = 0
    inline: list[int] = field(default_factory=list)  # shm: positions to fetch as bytes


def accept(
    data: bytes | bytearray,
    namespace: Namespace,
    key: ChunkKey,
    tier: TierKind,
    destination: np.ndarray | None,
) -> KVChunk:
    """Verify one complete block and turn it into the chunk asked for (or raise
    ``CorruptBlock`` / ``LayoutMismatch``)."""
    header = verify_block(data)
    check_identity(header, namespace, key)
    raw = decode_payload(
        memoryview(data)[HEADER_BYTES:], header.dtype, header.codec, header.raw_len
    )
    if raw.nbytes != namespace.layout.chunk_nbytes:
        raise CorruptBlock(f"block {key.hex()} holds {raw.nbytes} bytes, not one chunk")
    if destination is None:
        block = memoryview(data) if header.codec is Codec.NONE else None
        return KVChunk(key, tier, namespace.layout, raw, block)
    np.copyto(destination, np.frombuffer(raw, dtype=np.uint8))
    return KVChunk(key, tier, namespace.layout, destination.data)


def tier_of(label: Any) -> TierKind:
    """A tier label of the wire (``"dram"``) as a ``TierKind``."""
    try:
        return TierKind[str(label).upper()]
    except KeyError:
        raise unavailable(f"malformed response: unknown tier {label!r}") from None


class FramesSink:
    """Receives a ``"bytes"`` get's frames response, block by block, as it streams in."""

    def __init__(self, namespace: Namespace, keys: Sequence[ChunkKey], out: Destinations) -> None:
        self.namespace = namespace
        self.keys = keys
        self.out = out
        self.received = Received([None] * len(keys))
        self._tiers: list[Any] = []
        # The daemon answers exactly the keys asked for; a block can be at most a
        # little larger than raw (a codec's worst case), never gigabytes.
        limit = HEADER_BYTES + 2 * namespace.layout.chunk_nbytes + 4096
        self._decoder = FrameDecoder(FrameLimits(max_blocks=len(keys), max_block_bytes=limit))

    def feed(self, data: bytes) -> None:
        try:
            blocks = self._decoder.feed(data)
        except WireError as error:
            raise unavailable(f"malformed frames response: {error}") from None
        if not self._tiers and self._decoder.meta is not None:
            entries = self._decoder.meta["blocks"]
            if len(entries) != len(self.keys):
                raise unavailable(f"{len(entries)} blocks answered for {len(self.keys)} keys")
            self._tiers = [entry.get("tier") for entry in entries]
        for block in blocks:
            if block.data is None:
                continue
            destination = self.out[block.index] if self.out is not None else None
            key = self.keys[block.index]
            try:
                chunk = accept(
                    block.data, self.namespace, key, tier_of(self._tiers[block.index]), destination
                )
            except (CorruptBlock, LayoutMismatch):
                self.received.corrupt += 1
                continue
            self.received.chunks[block.index] = chunk

    def finish(self) -> None:
        try:
            self._decoder.finish()
        except WireError as error:
            raise unavailable(f"malformed frames response: {error}") from None


@dataclass(frozen=True, slots=True)
class LeasedBlock:
    """One entry of a ``"shm"`` get: where the block lies, or that it is inline or missing."""

    offset: int | None
    length: int | None
    tier: TierKind | None
    inline: bool

    @classmethod
    def parse(cls, entry: Any) -> LeasedBlock:
        try:
            if entry.get("missing"):
                return cls(None, None, None, False)
            if entry.get("inline"):
                return cls(None, None, None, True)
            return cls(int(entry["offset"]), int(entry["length"]), tier_of(entry["tier"]), False)
        except (AttributeError, KeyError, TypeError, ValueError):
            raise unavailable(f"malformed lease entry {entry!r}") from None


def copy_leased(
    arena: SharedArena,
    namespace: Namespace,
    keys: Sequence[ChunkKey],
    entries: Sequence[LeasedBlock],
    out: Destinations,
) -> Received:
    """Copy and verify every leased block; note which ones to fetch inline."""
    if len(entries) != len(keys):
        raise unavailable(f"{len(entries)} lease entries for {len(keys)} keys")
    received = Received([None] * len(keys))
    for index, entry in enumerate(entries):
        if entry.inline:
            received.inline.append(index)
        if entry.offset is None or entry.length is None or entry.tier is None:
            continue
        destination = out[index] if out is not None else None
        try:
            with arena.block(entry.offset, entry.length) as view:
                chunk = _copy_one(view, namespace, keys[index], entry.tier, destination)
        except (CorruptBlock, LayoutMismatch):
            received.corrupt += 1
            continue
        received.chunks[index] = chunk
    return received


def _copy_one(
    view: memoryview,
    namespace: Namespace,
    key: ChunkKey,
    tier: TierKind,
    destination: np.ndarray | None,
) -> KVChunk:
    """Copy one block out of shared memory, then verify the copy.

    A raw block bound for a caller's buffer is copied in two parts (header
    aside, payload straight into the buffer): one copy of the KV, as with
    the embedded store's ``get(out=)``. Anything else is copied whole.
    """
    header_bytes = bytes(view[:HEADER_BYTES])
    header = parse_header(header_bytes)
    if (
        destination is None
        or header.codec is not Codec.NONE
        or view.nbytes != HEADER_BYTES + destination.size
    ):
        return accept(bytearray(view), namespace, key, tier, destination)
    np.copyto(destination, np.frombuffer(view[HEADER_BYTES:], dtype=np.uint8))
    verified = verify_parts(header_bytes, destination.data)
    check_identity(verified, namespace, key)
    if verified.raw_len != namespace.layout.chunk_nbytes:
        raise CorruptBlock(f"block {key.hex()} holds {verified.raw_len} bytes, not one chunk")
    return KVChunk(key, tier, namespace.layout, destination.data)
