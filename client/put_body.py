"""A put's frames body, each block framed (hashed) just before it is sent.

::

    meta (lengths known up front: Content-Length is exact before any hashing)
    then per chunk i, when the sender reaches it:
        encode_block: xxh3-64 over header and payload ──► header (128 bytes)
        header, then the payload as views of the caller's buffer, in slices
        of at most BODY_SLICE_BYTES

Why not frame every block first: the checksum reads the whole payload, so
framing a batch up front keeps the daemon idle while the client hashes
(tens of ms per 128 MiB). Framed one at a time, the daemon lands block ``i``
while the client hashes block ``i + 1``; with a ``hasher`` thread, block
``i + 1`` is hashed there while this thread sends block ``i`` (xxhash and
the socket's send both release the GIL), so the hashing leaves the sender's
critical path. A body is iterated again on a retry: headers already
computed are reused.

Unsealed (``sealed=False``: a daemon over its Unix socket offered to seal
them, ``kvstore.server.put``), the blocks go with zero checksums: framing
reads no payload, and no thread is needed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future

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
    absent) under ``keys``, chunk ``i``'s parent being key ``i - 1``; ``sealed``:
    each block with its checksum (else zero, for the daemon to compute)."""

    def __init__(
        self,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        payloads: Sequence[memoryview | None],
        session: str | None,
        hasher: Executor | None = None,
        *,
        sealed: bool = True,
    ) -> None:
        self._namespace = namespace
        self._sealed = sealed
        self._hasher = hasher if sealed else None
        self._ahead: dict[int, Future[Block]] = {}
        self._keys = list(keys[: len(payloads)])
        self._payloads = list(payloads)
        self._blocks: list[Block | None] = [None] * len(payloads)
        meta: dict[str, object] = {
            "namespace": namespace.digest.hex(),
            "session": session,
            "blocks": [
                {"key": key.hex(), "length": None if data is None else HEADER_BYTES + data.nbytes}
                for key, data in zip(self._keys, self._payloads, strict=True)
            ],
        }
        if not sealed:  # absent, as every daemon reads it: sealed
            meta["sealed"] = False
        self._meta = [memoryview(piece) for piece in encode_frames(meta, ())]
        self.nbytes = sum(piece.nbytes for piece in self._meta) + sum(
            HEADER_BYTES + data.nbytes for data in self._payloads if data is not None
        )

    def __iter__(self) -> Iterator[bytes | memoryview]:
        yield from self._meta
        present = [index for index, data in enumerate(self._payloads) if data is not None]
        for position, index in enumerate(present):
            block = self._block(index)
            if position + 1 < len(present):
                self._frame_ahead(present[position + 1])
            yield block.header
            payload = block.payload
            for start in range(0, payload.nbytes, BODY_SLICE_BYTES):
                yield payload[start : start + BODY_SLICE_BYTES]

    def _block(self, index: int) -> Block:
        """Block ``index``, framed: by the hasher thread if it was asked to, else here."""
        ahead = self._ahead.pop(index, None)
        block = ahead.result() if ahead is not None else self._blocks[index]
        if block is None:
            block = self._encode(index)
        self._blocks[index] = block
        return block

    def _frame_ahead(self, index: int) -> None:
        if self._hasher is not None and self._blocks[index] is None and index not in self._ahead:
            self._ahead[index] = self._hasher.submit(self._encode, index)

    def _encode(self, index: int) -> Block:
        data = self._payloads[index]
        assert data is not None
        parent = self._keys[index - 1] if index else None
        return encode_block(self._namespace, self._keys[index], parent, data, sealed=self._sealed)
