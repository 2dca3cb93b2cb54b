"""A put's frames body, each block framed (hashed) just before it is sent.

::

    meta (lengths known up front: Content-Length is exact before any hashing)
    then per chunk i, when the sender reaches it:
        encode_block: xxh3-64 over header and payload ──► header (128 bytes)
        header, then the payload as views of the caller's buffer, in slices
        of at most BODY_SLICE_BYTES

Why not frame every block first: the checksum reads the whole payload, so
framing a batch up front keeps the daemon idle while the client hashes
(tens of ms per 128 MiB) and sends each payload from memory after it left the
cache. Framed one at a time, the daemon lands block ``i`` while the client
hashes block ``i + 1``, and a payload is still in cache when the transport
copies it. A body is iterated again on a retry: headers already computed are
reused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvstore.block import HEADER_BYTES, Block, encode_block
from kvstore.keys import ChunkKey, Namespace
from kvstore.wire import encode_frames

# A put body goes out in views of at most this many bytes, never joined: h11
# copies each piece it is given, and httpx's own transports copy the unsent rest
# of a piece after every partial send, quadratic in the piece's size on a Unix
# socket's ~200 KiB send buffer (``client.transports`` does not, but a caller
# may pass another transport). Slices keep both copies small.
BODY_SLICE_BYTES = 1 << 20


class PutBody:
    """The frames body of a put of ``payloads`` (validated raw chunk bytes; ``None``:
    absent) under ``keys``, chunk ``i``'s parent being key ``i - 1``."""

    def __init__(
        self,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        payloads: Sequence[memoryview | None],
        session: str | None,
    ) -> None:
        self._namespace = namespace
        self._keys = list(keys[: len(payloads)])
        self._payloads = list(payloads)
        self._blocks: list[Block | None] = [None] * len(payloads)
        meta = {
            "namespace": namespace.digest.hex(),
            "session": session,
            "blocks": [
                {"key": key.hex(), "length": None if data is None else HEADER_BYTES + data.nbytes}
                for key, data in zip(self._keys, self._payloads, strict=True)
            ],
        }
        self._meta = [memoryview(piece) for piece in encode_frames(meta, ())]
        self.nbytes = sum(piece.nbytes for piece in self._meta) + sum(
            HEADER_BYTES + data.nbytes for data in self._payloads if data is not None
        )

    def __iter__(self) -> Iterator[bytes | memoryview]:
        yield from self._meta
        for index, data in enumerate(self._payloads):
            if data is None:
                continue
            block = self._block(index, data)
            yield block.header
            payload = block.payload
            for start in range(0, payload.nbytes, BODY_SLICE_BYTES):
                yield payload[start : start + BODY_SLICE_BYTES]

    def _block(self, index: int, data: memoryview) -> Block:
        block = self._blocks[index]
        if block is None:
            parent = self._keys[index - 1] if index else None
            block = encode_block(self._namespace, self._keys[index], parent, data)
            self._blocks[index] = block
        return block
