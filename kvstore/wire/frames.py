"""Bulk KV on the wire: frames, their decoder, and where a put's checksums travel.

Control messages are JSON (``kvstore.wire.messages``). Bulk KV travels as *frames*, never base64::

    +----------+-------------------------------+--------------+--------------+---
    | u32 LE n | n bytes of JSON metadata      | block 0      | block 1      | ...
    |          | {"namespace": hex, ...,       | (header +    | (lengths in  |
    |          |  "blocks": [{"key": hex,      |  payload,    |  the JSON,   |
    |          |    "length": int|null}, ...]} |  kvstore.    |  in order;   |
    |          |                               |  block)      |  null = none)|
    +----------+-------------------------------+--------------+--------------+---

Every block on the wire is a complete stored block (``kvstore.block``), so the
receiver verifies its checksum, key and namespace exactly as it would a block
read from LMDB: a network transfer is a trust boundary.

``FrameDecoder`` is sans-IO: it is fed bytes as they arrive (from aiohttp's
request stream on the daemon, from an httpx response on a client) and hands
back the metadata and then each block, so neither side buffers a whole body
it does not need to and both share one parser. By default each block comes
back as one ``bytes``; in its one-copy mode (``into``) each block's header
is kept aside and its payload copied once, as it arrives, into a buffer of
the receiver's choosing (a fresh one, or the caller's own KV buffer).
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.block import HEADER_BYTES
from kvstore.keys import ChunkKey
from kvstore.wire import strict_json
from kvstore.wire.codes import ErrorCode, WireError
from kvstore.wire.messages import hex_bytes

FRAMES_CONTENT_TYPE = "application/x-kvstore-frames"
# A frames body starts with the length of its JSON metadata: u32, little-endian.
META_LENGTH = struct.Struct("<I")


class Seal(enum.Enum):
    """Who checksums a put's blocks, and where the checksum travels (the put
    metadata's ``"seal"``; a registration answer's ``"put_seals"`` lists those a
    daemon takes on that connection).

    ``HEADER`` (the default): in each block's header, as stored. ``TRAILER``: the
    header's checksum is zero and the checksum follows the payload
    (``block.TRAILER_BYTES``), so a sender hashes each slice just before sending
    it, while it is in cache, instead of reading every payload once more
    beforehand; the daemon verifies it as strictly. ``DAEMON``: zero checksums and
    no trailer; the daemon computes them as the blocks land. Only on the Unix
    socket, a kernel copy on one host, where a checksum on each side guards
    nothing.
    """

    HEADER = "header"
    TRAILER = "trailer"
    DAEMON = "daemon"


def encode_frames(
    meta: dict[str, Any], blocks: Sequence[bytes | memoryview]
) -> Iterator[bytes | memoryview]:
    """The pieces of a frames body, in order (write them without joining).

    ``meta["blocks"][i]["length"]`` must already describe ``blocks`` (use
    ``block_entries``); blocks whose length is ``None`` are absent and have no
    bytes in the body.
    """
    encoded = json.dumps(meta, separators=(",", ":")).encode()
    yield META_LENGTH.pack(len(encoded))
    yield encoded
    yield from blocks


def block_entries(
    keys: Sequence[ChunkKey], blocks: Sequence[bytes | memoryview | None]
) -> list[dict[str, Any]]:
    """``meta["blocks"]`` for ``blocks`` (``None`` = absent)."""
    return [
        {"key": key.hex(), "length": None if block is None else memoryview(block).nbytes}
        for key, block in zip(keys, blocks, strict=True)
    ]


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """Bounds a decoder enforces before buffering anything."""

    max_meta_bytes: int = 1 << 20
    max_blocks: int = 4096
    max_block_bytes: int = 1 << 30


@dataclass(frozen=True, slots=True)
class ReceivedBlock:
    """One block of a frames body: its position, key and bytes (``None`` if absent).

    ``data`` is the whole block, unless the decoder places payloads
    (``FrameDecoder(into=...)``): then ``header`` holds the block's first
    ``HEADER_BYTES`` and ``data`` the payload after them.
    """

    index: int
    key: ChunkKey
    data: bytes | memoryview | None
    header: bytes | None = None


# ``into(index, header, size)``: a writable buffer of exactly ``size`` bytes for the
# payload of block ``index`` (whose header is ``header``), or ``None`` for a fresh one.
PayloadBuffer = Callable[[int, bytes, int], memoryview | None]


class FrameDecoder:
    """Incremental parser of a frames body. ``feed`` bytes, then ``finish``.

    ``meta`` is available once its bytes have arrived; complete blocks are
    returned by ``feed`` in order. Anything malformed (a length field past the
    limits, bad JSON, a block list that does not match the bytes) raises
    ``WireError(MALFORMED_BODY)`` or ``WireError(REQUEST_TOO_LARGE)``.

    With ``into`` (one-copy mode), each block is split as it arrives: its first
    ``HEADER_BYTES`` (fewer if the block is shorter) are kept aside, and as soon
    as they are in, ``into`` chooses where the rest goes; the bytes fed are
    copied there directly, once, and never buffered. The default mode instead
    appends every byte to a buffer and cuts each block out of it as ``bytes``
    (three copies of each byte: cheap for small bodies, not for KV).
    """

    def __init__(
        self, limits: FrameLimits | None = None, *, into: PayloadBuffer | None = None
    ) -> None:
        self.limits = limits or FrameLimits()
        self.meta: dict[str, Any] | None = None
        self._into = into
        self._buffer = bytearray()  # one-copy mode: only until the metadata is parsed
        self._entries: list[tuple[ChunkKey, int | None]] = []
        self._next = 0
        # One-copy mode: the block being received.
        self._header = bytearray()
        self._payload: memoryview | None = None
        self._filled = 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[ReceivedBlock]:
        if self._into is not None and self.meta is not None:
            return self._place(memoryview(data).cast("B"))
        self._buffer += data
        received: list[ReceivedBlock] = []
        if self.meta is None and not self._parse_meta():
            return received
        if self._into is not None:
            rest, self._buffer = self._buffer, bytearray()
            return self._place(memoryview(rest))
        while self._next < len(self._entries):
            key, length = self._entries[self._next]
            if length is None:
                received.append(ReceivedBlock(self._next, key, None))
            elif len(self._buffer) >= length:
                received.append(ReceivedBlock(self._next, key, bytes(self._buffer[:length])))
                del self._buffer[:length]
            else:
                break
            self._next += 1
        if self._next == len(self._entries) and self._buffer:
            raise WireError(ErrorCode.MALFORMED_BODY, "bytes after the last block")
        return received

    def finish(self) -> None:
        """Raise unless the body ended exactly after its last block."""
        if self.meta is None or self._next != len(self._entries) or self._buffer:
            raise WireError(ErrorCode.MALFORMED_BODY, "body ended before its last block")

    def _place(self, view: memoryview) -> list[ReceivedBlock]:
        """One-copy mode: copy ``view`` into the blocks it continues."""
        received: list[ReceivedBlock] = []
        while self._next < len(self._entries):
            key, length = self._entries[self._next]
            if length is None:
                received.append(ReceivedBlock(self._next, key, None))
                self._next += 1
                continue
            if self._payload is None:
                head = min(length, HEADER_BYTES)
                take = min(view.nbytes, head - len(self._header))
                self._header += view[:take]
                view = view[take:]
                if len(self._header) < head:
                    break
                self._payload = self._payload_buffer(length - head)
            take = min(view.nbytes, self._payload.nbytes - self._filled)
            self._payload[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled < self._payload.nbytes:
                break
            received.append(ReceivedBlock(self._next, key, self._payload, bytes(self._header)))
            self._header.clear()
            self._payload, self._filled = None, 0
            self._next += 1
        if view.nbytes:
            raise WireError(ErrorCode.MALFORMED_BODY, "bytes after the last block")
        return received

    def _payload_buffer(self, size: int) -> memoryview:
        assert self._into is not None
        buffer = self._into(self._next, bytes(self._header), size)
        if buffer is None:
            # np.empty, not bytearray: not zero-filled first (allocating and filling
            # MiB-sized buffers measured ~2.5x faster).
            return np.empty(size, dtype=np.uint8).data
        if buffer.readonly or buffer.nbytes != size:
            raise ValueError(f"into() must give a writable buffer of {size} bytes")
        return buffer.cast("B")

    def _parse_meta(self) -> bool:
        if len(self._buffer) < META_LENGTH.size:
            return False
        length = meta_length(bytes(self._buffer[: META_LENGTH.size]), self.limits)
        if len(self._buffer) < META_LENGTH.size + length:
            return False
        raw = bytes(self._buffer[META_LENGTH.size : META_LENGTH.size + length])
        del self._buffer[: META_LENGTH.size + length]
        self.meta, self._entries = parse_meta(raw, self.limits)
        return True


def meta_length(prefix: bytes, limits: FrameLimits) -> int:
    """The metadata length a frames body starts with; refused past the limit."""
    (length,) = META_LENGTH.unpack(prefix)
    if length > limits.max_meta_bytes:
        raise WireError(ErrorCode.REQUEST_TOO_LARGE, f"metadata of {length} bytes")
    return int(length)


def parse_meta(
    raw: bytes, limits: FrameLimits
) -> tuple[dict[str, Any], list[tuple[ChunkKey, int | None]]]:
    """A frames body's metadata and its blocks' (key, length) entries, checked
    against ``limits``; ``WireError`` for anything malformed."""
    try:
        meta = strict_json.loads(raw)
        entries = meta["blocks"]
        if not isinstance(entries, list):
            raise TypeError("blocks must be a list")
    except (ValueError, KeyError, TypeError) as error:
        raise WireError(ErrorCode.MALFORMED_BODY, f"bad frame metadata: {error}") from None
    if len(entries) > limits.max_blocks:
        raise WireError(
            ErrorCode.REQUEST_TOO_LARGE,
            f"{len(entries)} blocks; the limit is {limits.max_blocks}",
        )
    parsed: list[tuple[ChunkKey, int | None]] = []
    for entry in entries:
        try:
            key = ChunkKey(hex_bytes(entry["key"], "key"))
            length = entry["length"]
        except (KeyError, TypeError):
            raise WireError(ErrorCode.MALFORMED_BODY, "each block needs key and length") from None
        if length is not None and (
            not isinstance(length, int)
            or isinstance(length, bool)
            or not 0 < length <= limits.max_block_bytes
        ):
            raise WireError(ErrorCode.MALFORMED_BODY, f"bad block length {length!r}")
        parsed.append((key, length))
    return meta, parsed
