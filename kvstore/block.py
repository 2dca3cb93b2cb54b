"""The self-describing block: what every tier stores under a chunk key.

::

    offset  size  field
    ------  ----  -----------------------------------------------------------
         0     4  magic b"KVB1"
         4     2  format version (1)
         6     1  codec (Codec)
         7     1  dtype code (DTYPE_CODES)
         8    16  namespace digest
        24    16  chunk key                    } a block copied under the wrong
        40    16  parent chunk key (0 = root)  } key or namespace is detected
        56    16  num_layers, num_kv_heads, head_dim, chunk_tokens (u32 each)
        72     8  raw_len: payload bytes before the codec
        80     8  payload_len: stored payload bytes
        88     8  checksum: xxh3-64 over header bytes [0, 88) then the payload
        96    32  reserved (zero)
       128     -  payload (payload_len bytes; 128 keeps it cache-line aligned)

The checksum covers the header as well as the payload, so a flipped bit in a
length, a layout field or the key is caught like a flipped bit in the KV.
Blocks are verified whenever they cross a trust boundary (a read from LMDB,
Redis or the network; a block entering the DRAM or HBM arena from below); a
block that fails is never returned (``CorruptBlock``).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.errors import CorruptBlock, LayoutMismatch
from kvstore.keys import KEY_BYTES, ChunkKey, KVLayout, Namespace

MAGIC = b"KVB1"
FORMAT_VERSION = 1
HEADER_BYTES = 128
_HEADER = struct.Struct("<4sHBB16s16s16sIIIIQQQ")
_CHECKSUM_OFFSET = 88
assert _HEADER.size == _CHECKSUM_OFFSET + 8
TRAILER_BYTES = 8  # a checksum sent after its payload (``checksum_trailer``)

DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float8_e4m3fn": 4,
    "float8_e5m2": 5,
    "int8": 6,
    "uint8": 7,
}
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


class Codec(enum.IntEnum):
    """How the payload is stored. Chosen per tier (``kvstore.codec``)."""

    NONE = 0
    ZSTD = 1
    ZSTD_BYTEPLANE = 2


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The parsed, verified header of a stored block."""

    codec: Codec
    dtype: str
    namespace_digest: bytes
    key: ChunkKey
    parent: ChunkKey | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_tokens: int
    raw_len: int
    payload_len: int

    def matches(self, layout: KVLayout) -> bool:
        return (
            self.dtype == layout.dtype
            and self.num_layers == layout.num_layers
            and self.num_kv_heads == layout.num_kv_heads
            and self.head_dim == layout.head_dim
            and self.chunk_tokens == layout.chunk_tokens
        )


@dataclass(frozen=True, slots=True)
class Block:
    """A block ready to store: the header and the payload, kept as two buffers.

    Tiers that copy into their own memory (DRAM, HBM) write the two parts
    without first joining them; tiers that need one value (LMDB, Redis) call
    ``to_bytes``.
    """

    header: bytes
    payload: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.payload.nbytes

    def to_bytes(self) -> bytes:
        return b"".join((self.header, self.payload))


def encode_block(
    namespace: Namespace,
    key: ChunkKey,
    parent: ChunkKey | None,
    payload: memoryview,
    *,
    codec: Codec = Codec.NONE,
    raw_len: int | None = None,
    sealed: bool = True,
) -> Block:
    """Frame an (already codec-encoded) payload with its header and checksum
    (``sealed=False``: with a zero checksum, for its receiver to seal; see
    ``frame_block``)."""
    layout = namespace.layout
    return frame_block(
        BlockHeader(
            codec=codec,
            dtype=layout.dtype,
            namespace_digest=namespace.digest,
            key=key,
            parent=parent,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            chunk_tokens=layout.chunk_tokens,
            raw_len=payload.nbytes if raw_len is None else raw_len,
            payload_len=payload.nbytes,
        ),
        payload,
        sealed=sealed,
    )


def frame_block(header: BlockHeader, payload: memoryview, *, sealed: bool = True) -> Block:
    """Frame ``payload`` under ``header``'s identity; ``payload_len`` is taken from the payload.

    Used to re-frame a block whose codec changes between tiers without needing
    its ``Namespace`` object (the header carries everything).

    ``sealed=False`` leaves the checksum zero and reads none of the payload, for
    a block whose checksum is made elsewhere (``kvstore.wire.Seal``: hashed slice
    by slice as it is sent, or by the daemon as it lands), so that framing does
    not read every payload once more.
    """
    if payload.format != "B" or payload.ndim != 1:
        payload = payload.cast("B")
    prefix = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        int(header.codec),
        DTYPE_CODES[header.dtype],
        header.namespace_digest,
        header.key,
        header.parent if header.parent is not None else bytes(KEY_BYTES),
        header.num_layers,
        header.num_kv_heads,
        header.head_dim,
        header.chunk_tokens,
        header.raw_len,
        payload.nbytes,
        0,
    )[:_CHECKSUM_OFFSET]
    checksum = 0
    if sealed:
        hasher = payload_hasher(prefix)
        hasher.update(payload)
        checksum = hasher.intdigest()
    return Block(header=_with_checksum(prefix, checksum), payload=payload)


def payload_hasher(header_bytes: memoryview | bytes | bytearray) -> xxhash.xxh3_64:
    """A hasher fed the header bytes a block's checksum covers; feed it the payload,
    in as many pieces as you like, and its digest is the block's checksum."""
    return xxhash.xxh3_64(memoryview(header_bytes)[:_CHECKSUM_OFFSET])


def checksum_trailer(hasher: xxhash.xxh3_64) -> bytes:
    """A checksum as it follows a payload on the wire (a put with trailing checksums,
    ``kvstore.wire.Seal.TRAILER``): ``TRAILER_BYTES``, little-endian, as in a header."""
    return hasher.intdigest().to_bytes(TRAILER_BYTES, "little")


def check_trailer(sealed_header: bytes, trailer: bytes, key: ChunkKey) -> None:
    """Refuse a block whose trailing checksum differs from the one computed over what
    landed (``sealed_header``, from ``fill_sealed`` or ``seal_block``)."""
    if sealed_header[_CHECKSUM_OFFSET : _CHECKSUM_OFFSET + TRAILER_BYTES] != trailer:
        raise CorruptBlock(f"checksum mismatch for block {key.hex()}")


def _with_checksum(header: memoryview | bytes | bytearray, checksum: int) -> bytes:
    """The header bytes ``header`` (at least its first ``_CHECKSUM_OFFSET``) with ``checksum``."""
    return (
        bytes(header[:_CHECKSUM_OFFSET])
        + checksum.to_bytes(TRAILER_BYTES, "little")
        + bytes(HEADER_BYTES - _HEADER.size)
    )


def stored_block(data: memoryview | bytes | bytearray) -> Block:
    """A block as read from a tier, split back into header and payload (no copy)."""
    view = memoryview(data)
    return Block(header=bytes(view[:HEADER_BYTES]), payload=view[HEADER_BYTES:])


def parse_header(data: memoryview | bytes | bytearray) -> BlockHeader:
    """Parse the header fields without verifying the checksum (structure only)."""
    if len(data) < HEADER_BYTES:
        raise CorruptBlock(f"block of {len(data)} bytes is shorter than its header")
    (
        magic,
        version,
        codec,
        dtype_code,
        ns_digest,
        key,
        parent,
        num_layers,
        num_kv_heads,
        head_dim,
        chunk_tokens,
        raw_len,
        payload_len,
        _checksum,
    ) = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"unsupported block format version {version}")
    if bytes(data[_HEADER.size : HEADER_BYTES]) != bytes(HEADER_BYTES - _HEADER.size):
        raise CorruptBlock("reserved header bytes are not zero")
    if dtype_code not in _DTYPE_NAMES:
        raise CorruptBlock(f"unknown dtype code {dtype_code}")
    try:
        codec_value = Codec(codec)
    except ValueError:
        raise CorruptBlock(f"unknown codec {codec}") from None
    return BlockHeader(
        codec=codec_value,
        dtype=_DTYPE_NAMES[dtype_code],
        namespace_digest=ns_digest,
        key=ChunkKey(key),
        parent=None if parent == bytes(KEY_BYTES) else ChunkKey(parent),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        chunk_tokens=chunk_tokens,
        raw_len=raw_len,
        payload_len=payload_len,
    )


def verify_block(
    data: memoryview | bytes | bytearray, *, check_payload: bool = True
) -> BlockHeader:
    """Parse and verify a stored block: structure, length and (optionally) checksum.

    ``check_payload=False`` is for blocks read from memory the store owns and
    verified on the way in (the DRAM and HBM arenas).
    """
    view = memoryview(data)
    return verify_parts(view[:HEADER_BYTES], view[HEADER_BYTES:], check_payload=check_payload)


Pages = tuple[np.ndarray, ...]
"""A payload laid out in several flat uint8 arrays, in order (``store.chunk.ChunkPages``)."""


def verify_parts(
    header_bytes: memoryview | bytes | bytearray,
    payload: memoryview | bytes | bytearray | Pages,
    *,
    check_payload: bool = True,
) -> BlockHeader:
    """``verify_block`` for a block whose header and payload were copied apart
    (``Tier.get_many_into``), the payload perhaps into pages; the checksum
    covers the same bytes."""
    header = parse_header(header_bytes)
    pieces = _pieces(payload)
    check_payload_size(header, sum(piece.size for piece in pieces))
    if check_payload:
        hasher = payload_hasher(header_bytes)
        for piece in pieces:
            hasher.update(piece.data)
        _compare_checksum(hasher, memoryview(header_bytes), header.key)
    return header


def check_payload_size(header: BlockHeader, nbytes: int) -> None:
    """Refuse a payload of ``nbytes`` that is not the length its header says: the one
    length check of a block, wherever its bytes come from."""
    if nbytes != header.payload_len:
        raise CorruptBlock(f"payload is {nbytes} bytes, header says {header.payload_len}")


# copy_payload's step: small enough that a step just copied is still in the L2
# cache when it is checksummed (measured at 2 MiB blocks: 256 KiB steps beat
# 64 KiB and 1 MiB ones, and a whole copy then a whole checksum by 10-15%).
COPY_VERIFY_STEP = 256 << 10


def copy_payload(
    header_bytes: memoryview | bytes | bytearray,
    source: memoryview | bytes | bytearray,
    destination: memoryview | bytearray | Pages,
    *,
    verify: bool = True,
) -> BlockHeader:
    """Copy a payload from ``source`` into ``destination`` (one buffer, or pages filled
    in order) after checking the header's structure and lengths; with ``verify``,
    ``verify_parts`` the copy in the same pass: each step is checksummed right
    after it is copied, while it is still in cache, so the payload is read from
    memory once, not twice.

    What is checksummed is the copy, never ``source``: a source that changes
    during the copy (shared memory) fails the check instead of being served.
    Both numpy's copy and xxhash release the GIL, so copies run in parallel on
    threads. ``verify=False`` is only for a source whose bytes were verified
    when they were stored and whose caller proves, after the copy, that they did
    not change during it (a shared-memory client comparing extent generations,
    ``client.blocks``).
    """
    header = parse_header(header_bytes)
    targets = _pieces(destination)
    check_payload_size(header, memoryview(source).nbytes)
    check_payload_size(header, sum(target.size for target in targets))
    if not verify:
        copy_into(source, targets)
        return header
    hasher = payload_hasher(header_bytes)
    _copy_hashing(source, targets, hasher)
    _compare_checksum(hasher, memoryview(header_bytes), header.key)
    return header


def fill_verified(
    header_bytes: memoryview | bytes | bytearray,
    destination: memoryview | bytearray,
    fill: Callable[[memoryview], None],
) -> BlockHeader:
    """Have ``fill`` write a payload into ``destination`` step by step, checksumming
    each step right after it is written, while it is still in cache.

    ``fill(step)`` must fill ``step`` exactly (a socket's ``recv_into`` loop:
    ``kvstore.server.borrowed_body``), or raise. As with ``copy_payload``, what
    is checksummed is what landed in ``destination``.
    """
    header, hasher = _fill_hashing(header_bytes, destination, fill)
    _compare_checksum(hasher, memoryview(header_bytes), header.key)
    return header


def fill_sealed(
    header_bytes: memoryview | bytes | bytearray,
    destination: memoryview | bytearray,
    fill: Callable[[memoryview], None],
) -> tuple[BlockHeader, bytes]:
    """``fill_verified`` for an unsealed block (``frame_block(sealed=False)``): the
    checksum is computed over what landed, in the same pass, and returned in a
    copy of the header, which the caller stores in place of the one received."""
    header, hasher = _fill_hashing(header_bytes, destination, fill)
    return header, _with_checksum(header_bytes, hasher.intdigest())


def seal_block(data: memoryview) -> None:
    """Write the checksum of the unsealed block ``data`` (header and payload, writable)
    into its header: what ``fill_sealed`` does for a block received some other way."""
    header = parse_header(data)
    check_payload_size(header, data.nbytes - HEADER_BYTES)
    hasher = payload_hasher(data)
    hasher.update(data[HEADER_BYTES:])
    data[:HEADER_BYTES] = _with_checksum(data, hasher.intdigest())


def _fill_hashing(
    header_bytes: memoryview | bytes | bytearray,
    destination: memoryview | bytearray,
    fill: Callable[[memoryview], None],
) -> tuple[BlockHeader, xxhash.xxh3_64]:
    """``fill`` the payload into ``destination`` a step at a time, hashing each step
    (after the header's checksummed bytes) while it is still in cache."""
    header = parse_header(header_bytes)
    target = memoryview(destination).cast("B")
    check_payload_size(header, target.nbytes)
    hasher = payload_hasher(header_bytes)
    for start in range(0, target.nbytes, COPY_VERIFY_STEP):
        step = target[start : start + COPY_VERIFY_STEP]
        fill(step)
        hasher.update(step)
    return header, hasher


def _pieces(payload: memoryview | bytes | bytearray | Pages) -> Pages:
    """A payload's bytes as flat uint8 arrays, in order: its pages, or the one buffer."""
    if isinstance(payload, tuple):
        return payload
    return (np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8),)


def copy_into(
    source: memoryview | bytes | bytearray | np.ndarray,
    destination: memoryview | bytearray | Pages,
) -> None:
    """Copy a payload's bytes into ``destination``, one buffer or pages in order, with
    no check (its own frame, for the reason ``_copy_hashing`` gives)."""
    targets = _pieces(destination)
    copy_from = np.frombuffer(source, dtype=np.uint8)
    at = 0
    for copy_to in targets:
        np.copyto(copy_to, copy_from[at : at + copy_to.size])
        at += copy_to.size


def _copy_hashing(
    source: memoryview | bytes | bytearray, targets: Pages, hasher: xxhash.xxh3_64
) -> None:
    # Its own frame, so the arrays exporting ``source`` are gone before a checksum
    # mismatch is raised: a traceback holding them would keep a shared-memory
    # view from being released.
    copy_from = np.frombuffer(source, dtype=np.uint8)
    at = 0
    for copy_to in targets:
        for start in range(0, copy_to.size, COPY_VERIFY_STEP):
            step = copy_to[start : start + COPY_VERIFY_STEP]
            np.copyto(step, copy_from[at + start : at + start + step.size])
            hasher.update(step.data)
        at += copy_to.size


def _compare_checksum(hasher: xxhash.xxh3_64, header: memoryview, key: ChunkKey) -> None:
    stored = int.from_bytes(header[_CHECKSUM_OFFSET : _CHECKSUM_OFFSET + 8], "little")
    if hasher.intdigest() != stored:
        raise CorruptBlock(f"checksum mismatch for block {key.hex()}")


def check_identity(
    header: BlockHeader, namespace: Namespace, key: ChunkKey, *, whole_chunk: bool = False
) -> None:
    """Refuse a block stored under another key, namespace or layout than asked for;
    with ``whole_chunk``, also one that is not exactly one chunk of KV (what the
    daemon checks of every block it receives, besides its checksum)."""
    if header.key != key:
        raise CorruptBlock(f"block under {key.hex()} carries key {header.key.hex()}")
    if header.namespace_digest != namespace.digest:
        raise CorruptBlock(f"block {key.hex()} belongs to another namespace")
    if not header.matches(namespace.layout):
        raise LayoutMismatch(f"block {key.hex()} has a layout other than its namespace's")
    if whole_chunk and header.raw_len != namespace.layout.chunk_nbytes:
        raise LayoutMismatch(
            f"block {key.hex()} holds {header.raw_len} bytes of KV, "
            f"the namespace's chunk is {namespace.layout.chunk_nbytes}"
        )
