"""A put's frames body, each block framed just before it is sent, its checksum made
where the daemon asked for it (``kvstore.wire.Seal``).

::

    meta (lengths known up front: Content-Length is exact before any hashing)
    then per chunk i, when the sender reaches it, by seal:
      header   header with the checksum of header and payload (one pass over the
               payload to hash it, then the payload as views of the caller's
               buffer, in slices of at most BODY_SLICE_BYTES)
      trailer  header with a zero checksum; each slice hashed just before it is
               sent, while it is in cache; then the 8-byte checksum
      daemon   header with a zero checksum, then the slices (Unix socket only:
               the daemon checksums what lands)

Why the trailer: with the checksum in the header, every payload is read from
memory twice, once to hash it and once to send it; hashed slice by slice on
its way out, once. ``kvstore.client`` sends ``trailer`` over TCP, ``daemon``
over the Unix socket, and ``header`` only to a daemon that offers neither.
A body is iterated again on a retry, and hashed again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvstore.block import (
    HEADER_BYTES,
    TRAILER_BYTES,
    checksum_trailer,
    encode_block,
    payload_hasher,
)
from kvstore.keys import ChunkKey, Namespace
from kvstore.wire.frames import Seal, encode_frames

# A put body goes out in views of at most this many bytes, never joined: h11
# copies each piece it is given, and httpx's own transports copy the unsent rest
# of a piece after every partial send, quadratic in the piece's size on a Unix
# socket's ~200 KiB send buffer (``client.transports`` does not, but a caller
# may pass another transport). Slices keep both copies small, and a slice
# hashed just before it is sent is still in cache when it is copied.
BODY_SLICE_BYTES = 1 << 20


class PutBody:
    """The frames body of a put of ``payloads`` (validated raw chunk bytes; ``None``:
    absent) under ``keys``, chunk ``i``'s parent being key ``i - 1``; ``seal``:
    where each block's checksum goes."""

    def __init__(
        self,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        payloads: Sequence[memoryview | None],
        session: str | None,
        *,
        seal: Seal = Seal.HEADER,
    ) -> None:
        self._namespace = namespace
        self._seal = seal
        self._keys = list(keys[: len(payloads)])
        self._payloads = list(payloads)
        meta: dict[str, object] = {
            "namespace": namespace.digest.hex(),
            "session": session,
            "blocks": [
                {"key": key.hex(), "length": None if data is None else HEADER_BYTES + data.nbytes}
                for key, data in zip(self._keys, self._payloads, strict=True)
            ],
        }
        if seal is not Seal.HEADER:  # absent, as every daemon reads it: the header
            meta["seal"] = seal.value
        self._meta = [memoryview(piece) for piece in encode_frames(meta, ())]
        trailer = TRAILER_BYTES if seal is Seal.TRAILER else 0
        self.nbytes = sum(piece.nbytes for piece in self._meta) + sum(
            HEADER_BYTES + data.nbytes + trailer for data in self._payloads if data is not None
        )

    def __iter__(self) -> Iterator[bytes | memoryview]:
        yield from self._meta
        for index, payload in enumerate(self._payloads):
            if payload is None:
                continue
            parent = self._keys[index - 1] if index else None
            block = encode_block(
                self._namespace,
                self._keys[index],
                parent,
                payload,
                sealed=self._seal is Seal.HEADER,
            )
            yield block.header
            slices = (
                block.payload[start : start + BODY_SLICE_BYTES]
                for start in range(0, block.payload.nbytes, BODY_SLICE_BYTES)
            )
            if self._seal is not Seal.TRAILER:
                yield from slices
                continue
            hasher = payload_hasher(block.header)
            for piece in slices:
                hasher.update(piece)
                yield piece
            yield checksum_trailer(hasher)
