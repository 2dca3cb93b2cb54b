"""``kvstore.wire.FrameDecoder``: its one-copy mode against its copying mode, fed the
same bodies in every kind of split (byte by byte, across headers, whole)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.block import HEADER_BYTES
from kvstore.keys import ChunkKey
from kvstore.wire.codes import WireError
from kvstore.wire.frames import FrameDecoder, ReceivedBlock, block_entries, encode_frames

# The decoder does not look inside blocks: any bytes will do, of every length class
# (longer than a header, exactly one, shorter than one) and absent ones between.
BLOCKS: list[bytes | None] = [
    os.urandom(HEADER_BYTES + 5000),
    None,
    os.urandom(HEADER_BYTES),
    os.urandom(50),
    None,
    os.urandom(HEADER_BYTES + 1),
]
KEYS = [ChunkKey(os.urandom(16)) for _ in BLOCKS]


def body(blocks: list[bytes | None] = BLOCKS) -> bytes:
    meta = {"blocks": block_entries(KEYS[: len(blocks)], blocks)}
    present = [block for block in blocks if block is not None]
    return b"".join(bytes(piece) for piece in encode_frames(meta, present))


def feed(decoder: FrameDecoder, data: bytes, size: int) -> list[ReceivedBlock]:
    received: list[ReceivedBlock] = []
    for start in range(0, len(data), size):
        received += decoder.feed(data[start : start + size])
    decoder.finish()
    return received


def whole(block: ReceivedBlock) -> bytes | None:
    """A received block's bytes, whichever mode received it."""
    if block.data is None:
        return None
    return bytes(block.data) if block.header is None else block.header + bytes(block.data)


SPLITS = [1, 7, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 1, 1000, 1 << 20]


@pytest.mark.parametrize("size", SPLITS)
def test_both_modes_give_every_block_whatever_the_split(size: int) -> None:
    copying = feed(FrameDecoder(), body(), size)
    placing = feed(FrameDecoder(into=lambda index, header, size: None), body(), size)
    for received in (copying, placing):
        assert [block.index for block in received] == list(range(len(BLOCKS)))
        assert [block.key for block in received] == KEYS
        assert [whole(block) for block in received] == BLOCKS
    # One-copy mode: the header aside (as much of it as the block has), the rest apart.
    for block, original in zip(placing, BLOCKS, strict=True):
        if original is not None:
            assert block.header == original[:HEADER_BYTES]
            assert isinstance(block.data, memoryview) and not block.data.readonly


@pytest.mark.parametrize("size", SPLITS)
def test_payloads_land_in_the_buffers_into_gives(size: int) -> None:
    given: dict[int, np.ndarray] = {}
    asked: list[tuple[int, bytes, int]] = []

    def into(index: int, header: bytes, payload_bytes: int) -> memoryview | None:
        asked.append((index, header, payload_bytes))
        if index != 0:
            return None
        given[index] = np.zeros(payload_bytes, dtype=np.uint8)
        return given[index].data

    received = feed(FrameDecoder(into=into), body(), size)
    present = [(i, b) for i, b in enumerate(BLOCKS) if b is not None]
    assert asked == [(i, b[:HEADER_BYTES], max(len(b) - HEADER_BYTES, 0)) for i, b in present]
    first = received[0].data
    assert first is not None and np.shares_memory(np.frombuffer(first, np.uint8), given[0])
    assert given[0].tobytes() == BLOCKS[0][HEADER_BYTES:]  # type: ignore[index]


@pytest.mark.parametrize(
    "buffer",
    [bytearray(10), memoryview(bytes(5000))],
    ids=["wrong-size", "read-only"],
)
def test_into_must_give_a_writable_buffer_of_the_payload_size(buffer: bytearray) -> None:
    decoder = FrameDecoder(into=lambda index, header, size: memoryview(buffer))
    with pytest.raises(ValueError, match="writable buffer of 5000 bytes"):
        decoder.feed(body())


@pytest.mark.parametrize("size", [1, 100, 1 << 20])
@pytest.mark.parametrize(
    "data",
    [
        body()[:-1],  # truncated in the last block
        body()[: len(body()) - HEADER_BYTES + 9],  # the last block's header cut short
        body() + b"x",  # a byte after the last block
    ],
    ids=["truncated", "truncated-header", "trailing"],
)
def test_both_modes_refuse_a_body_that_does_not_match_its_blocks(data: bytes, size: int) -> None:
    for decoder in (FrameDecoder(), FrameDecoder(into=lambda index, header, size: None)):
        with pytest.raises(WireError):
            feed(decoder, data, size)
