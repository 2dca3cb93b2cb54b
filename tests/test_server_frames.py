"""The daemon's ``FrameSplitter``: a put body cut into blocks as it streams in, whatever
the sizes of the pieces it arrives in, with the same errors as ``FrameDecoder``."""

from __future__ import annotations

import random

import pytest
from support import http_kv
from support.http_kv import frames_body, make_chain

from kvstore.server.frames import FrameSplitter
from kvstore.wire import ErrorCode, FrameLimits, WireError

NS = http_kv.namespace_for("frames")


def _split(body: bytes, sizes: list[int], limits: FrameLimits | None = None) -> list:
    splitter = FrameSplitter(limits or FrameLimits())
    arrived = []
    start = 0
    for size in sizes:
        arrived += splitter.feed(body[start : start + size])
        start += size
    arrived += splitter.feed(body[start:])
    splitter.finish()
    assert splitter.meta is not None
    return arrived


@pytest.mark.parametrize("piece", [1, 7, 128, 4096, 1 << 20])
def test_blocks_come_out_whole_whatever_the_pieces(piece: int) -> None:
    chain = make_chain(NS, 5)
    sent = [None, chain.blocks[1], None, chain.blocks[3], chain.blocks[4]]
    body = frames_body(NS, chain.keys, sent)
    arrived = _split(body, [piece] * (len(body) // piece))
    assert [block.index for block in arrived] == [0, 1, 2, 3, 4]
    assert [block.key for block in arrived] == chain.keys
    assert [block.joined() for block in arrived] == sent
    assert [block.nbytes for block in arrived] == [len(block or b"") for block in sent]


def test_random_pieces() -> None:
    chain = make_chain(NS, 3)
    body = frames_body(NS, chain.keys, chain.blocks)
    rng = random.Random(7)
    for _ in range(20):
        sizes = [rng.randint(1, 3000) for _ in range(len(body) // 500)]
        assert [bytes(b.joined() or b"") for b in _split(body, sizes)] == chain.blocks


def test_a_block_in_one_piece_is_not_copied() -> None:
    chain = make_chain(NS, 1)
    body = frames_body(NS, chain.keys, chain.blocks)
    start = len(body) - len(chain.blocks[0])
    splitter = FrameSplitter(FrameLimits())
    assert splitter.feed(body[:start]) == []
    piece = body[start:]
    (block,) = splitter.feed(piece)
    joined = block.joined()
    assert isinstance(joined, memoryview) and joined.obj is piece


def test_malformed_bodies_are_refused() -> None:
    chain = make_chain(NS, 2)
    body = frames_body(NS, chain.keys, chain.blocks)
    with pytest.raises(WireError, match="after the last block") as error:
        _split(body + b"x", [])
    assert error.value.code is ErrorCode.MALFORMED_BODY
    for cut in (2, 10, len(body) - 1):
        with pytest.raises(WireError, match="ended before") as error:
            _split(body[:cut], [])
        assert error.value.code is ErrorCode.MALFORMED_BODY
    with pytest.raises(WireError) as error:  # refused once the length is in
        FrameSplitter(FrameLimits(max_meta_bytes=16)).feed(body[:4])
    assert error.value.code is ErrorCode.REQUEST_TOO_LARGE
    with pytest.raises(WireError) as error:
        _split(body, [], FrameLimits(max_blocks=1))
    assert error.value.code is ErrorCode.REQUEST_TOO_LARGE
