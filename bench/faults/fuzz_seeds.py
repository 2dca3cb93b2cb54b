"""The fuzz namespace's valid inputs, built without a daemon: its chain, put bodies
under every seal, and blocks of every codec, each with the offsets of its numbers
marked for ``fuzz_inputs`` to edit."""

from __future__ import annotations

from typing import Any

import numpy as np

from faults import fuzz_inputs as fi
from kvstore.block import (
    Codec,
    checksum_trailer,
    encode_block,
    payload_hasher,
)
from kvstore.codec import encode_payload
from kvstore.keys import ChunkKey, KVLayout, Namespace, chunk_keys
from kvstore.wire.frames import (
    META_LENGTH,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=16)


def fuzz_chain() -> tuple[Namespace, list[ChunkKey], list[memoryview]]:
    """The fuzzer's own namespace, a chain of 4 keys in it, and their payloads."""
    namespace = Namespace("fuzz-target", LAYOUT, tenant_salt="fuzz")
    keys = chunk_keys(namespace, np.arange(0, 4 * LAYOUT.chunk_tokens, dtype=np.int64))
    rng = np.random.default_rng(7)
    return namespace, keys, [memoryview(rng.bytes(LAYOUT.chunk_nbytes)) for _ in keys]


def put_parts(
    namespace: Namespace, keys: list[ChunkKey], payloads: list[memoryview], seal: str
) -> tuple[dict[str, Any], list[bytes]]:
    """A put's metadata and its blocks as they travel with ``seal`` (the third absent)."""
    entries: list[dict[str, Any]] = []
    blocks: list[bytes] = []
    for index, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
        if index == 2:
            entries.append({"key": key.hex(), "length": None})
            continue
        parent = keys[index - 1] if index else None
        block = encode_block(namespace, key, parent, payload, sealed=seal == "header")
        entries.append({"key": key.hex(), "length": block.nbytes})
        trailer = b""
        if seal == "trailer":
            hasher = payload_hasher(block.header)
            hasher.update(block.payload)
            trailer = checksum_trailer(hasher)
        blocks.append(block.to_bytes() + trailer)
    meta = {"namespace": namespace.digest.hex(), "session": "fuzz-session", "seal": seal}
    return {**meta, "blocks": entries}, blocks


def frames(meta: Any, blocks: bytes) -> bytes:
    encoded = fi.dumps(meta)
    return META_LENGTH.pack(len(encoded)) + encoded + blocks


# A block header's numbers: (offset, width) of version, codec, dtype, the four layout
# fields, raw_len, payload_len, checksum and the reserved bytes.
_HEADER_NUMBERS = (
    (4, 2),
    (6, 1),
    (7, 1),
    (56, 4),
    (60, 4),
    (64, 4),
    (68, 4),
    (72, 8),
    (80, 8),
    (88, 8),
    (96, 8),
    (120, 8),
)


def put_seed(meta: dict[str, Any], blocks: list[bytes]) -> fi.Seed:
    body = frames(meta, b"".join(blocks))
    numbers: list[tuple[int, int]] = [(0, 4)]
    start = len(body) - sum(len(block) for block in blocks)
    for block in blocks:
        numbers += [(start + offset, width) for offset, width in _HEADER_NUMBERS]
        start += len(block)
    return fi.Seed(body, tuple(numbers))


def block_seed(
    namespace: Namespace, keys: list[ChunkKey], payload: memoryview, codec: Codec
) -> fi.Seed:
    stored = encode_payload(payload, namespace.layout.dtype, codec)
    block = encode_block(
        namespace, keys[1], keys[0], memoryview(stored), codec=codec, raw_len=payload.nbytes
    )
    return fi.Seed(block.to_bytes(), _HEADER_NUMBERS)
