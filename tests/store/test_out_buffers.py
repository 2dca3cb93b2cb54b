"""A get's ``out=`` buffers (``kvstore.store.out_buffers``): host buffers written in
place, staged payloads copied to their tensors or pages only once verified, misses never.

Staging is made only for tensors on a CUDA device; here the buffers are built with CPU
tensors in its place, so ``deliver`` runs exactly the code it runs for a device but
the stream wait (``tests/client/test_device.py`` runs it on one)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from support import kv

from kvstore.errors import LayoutMismatch
from kvstore.keys import chunk_keys
from kvstore.kinds import TierKind
from kvstore.store.chunk import ChunkPages, KVChunk
from kvstore.store.out_buffers import OutBuffers, copy_to_device, in_pages

NS = kv.namespace(salt="out-buffers")
KEYS = chunk_keys(NS, kv.tokens(3))
CHUNKS = kv.chunks(3, seed=5)
NBYTES = kv.LAYOUT.chunk_nbytes


def flat(chunk: torch.Tensor) -> np.ndarray:
    return chunk.view(torch.uint8).reshape(-1).numpy()


def verified(index: int, host: np.ndarray) -> KVChunk:
    """What a get leaves for block ``index`` once it verified it into ``host``."""
    np.copyto(host, flat(CHUNKS[index]))
    return KVChunk(KEYS[index], TierKind.DRAM, kv.LAYOUT, host.data)


def staged(count: int) -> tuple[OutBuffers, list[torch.Tensor]]:
    """Buffers whose every payload is staged for a tensor of its own, 0xEE each."""
    targets = [torch.full((NBYTES,), 0xEE, dtype=torch.uint8) for _ in range(count)]
    host = list(np.zeros((count, NBYTES), dtype=np.uint8))
    return OutBuffers(host, targets, dict(enumerate(targets)), {}), targets


def pages_of(tensor: torch.Tensor) -> ChunkPages:
    """A tensor's bytes as three pages of unequal sizes, as a paged cache's block."""
    array = flat(tensor)
    return ChunkPages((array[:100], array[100:1500], array[1500:]))


def test_host_buffers_are_written_in_place_and_nothing_is_delivered() -> None:
    out = [
        torch.empty(kv.LAYOUT.chunk_shape, dtype=torch.float16),
        np.empty(kv.LAYOUT.chunk_shape, dtype=np.float16),
        bytearray(NBYTES),
    ]
    buffers = OutBuffers.of(out, kv.LAYOUT, 3)
    assert buffers.devices == {} and buffers.tensors is None  # not every one a tensor
    assert np.shares_memory(buffers.host[0], out[0].numpy())
    assert np.shares_memory(buffers.host[1], out[1])
    assert np.shares_memory(buffers.host[2], np.frombuffer(out[2], dtype=np.uint8))
    chunks = [verified(index, buffers.host[index]) for index in range(3)]
    assert buffers.deliver(chunks) == chunks
    assert torch.equal(out[0], CHUNKS[0])
    tensors = OutBuffers.of([out[0]], kv.LAYOUT, 1).tensors
    assert tensors is not None and tensors[0].data_ptr() == out[0].data_ptr()


def test_only_verified_staged_payloads_reach_their_tensors() -> None:
    """A hit is copied and its chunk stands for the tensor; a miss (``None``) leaves its
    tensor as it was, whatever its staging holds; a block that landed in its tensor
    already (device to device) is not copied over."""
    buffers, targets = staged(3)
    buffers.host[1][:] = 0x11  # a block that failed its check, left in the staging
    landed = buffers.landed(2, KEYS[2], TierKind.HBM, kv.LAYOUT)
    delivered = buffers.deliver([verified(0, buffers.host[0]), None, landed])
    first = delivered[0]
    assert first is not None and first.out is targets[0] and first.payload.nbytes == 0
    assert first.block is None and first.tier is TierKind.DRAM
    assert torch.equal(first.tensor(), CHUNKS[0])
    assert delivered[1] is None and bool((targets[1] == 0xEE).all())
    assert delivered[2] is landed and landed.out is targets[2]
    assert bool((targets[2] == 0xEE).all())  # whatever the device copy put there


def test_pages_are_filled_once_verified_unless_a_copy_landed_in_them() -> None:
    """Pages get staging for a get that cannot write them (bytes, a tier), and are
    themselves where a copy that can (shared memory) lands (``direct``); ``deliver``
    fills a staged hit's pages, never a miss's, and leaves a landed chunk alone."""
    targets = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in range(3)]
    pages = [pages_of(target) for target in targets]
    buffers = OutBuffers.of(pages, kv.LAYOUT, 3)
    assert not np.shares_memory(buffers.host[0], flat(targets[0]))
    assert all(got is want for got, want in zip(buffers.direct, pages, strict=True))
    buffers.host[1][:] = 0x11  # a block that failed its check, left in the staging
    landed = in_pages(KVChunk(KEYS[2], TierKind.DRAM, kv.LAYOUT, memoryview(b"")), pages[2])
    delivered = buffers.deliver([verified(0, buffers.host[0]), None, landed])
    first = delivered[0]
    assert first is not None and first.pages is pages[0] and first.payload.nbytes == 0
    assert torch.equal(targets[0], CHUNKS[0]) and torch.equal(first.tensor(), CHUNKS[0])
    assert delivered[1] is None and not targets[1].any()
    assert delivered[2] is landed and not targets[2].any()  # whatever the copy put there


def test_a_host_buffer_that_landed_is_a_view_of_it() -> None:
    out = [torch.empty(kv.LAYOUT.chunk_shape, dtype=torch.float16)]
    buffers = OutBuffers.of(out, kv.LAYOUT, 1)
    chunk = buffers.landed(0, KEYS[0], TierKind.HBM, kv.LAYOUT)
    assert chunk.out is None
    assert np.shares_memory(np.frombuffer(chunk.payload, dtype=np.uint8), out[0].numpy())


def test_copy_to_device_copies_each_payload_into_its_tensor() -> None:
    targets = [torch.zeros(NBYTES, dtype=torch.uint8) for _ in CHUNKS]
    copy_to_device([flat(chunk) for chunk in CHUNKS], targets)
    for target, chunk in zip(targets, CHUNKS, strict=True):
        assert torch.equal(target, torch.from_numpy(flat(chunk)))
    copy_to_device([], [])


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ([bytearray(NBYTES)] * 2, "2 destinations for 1 keys"),
        ([torch.empty(kv.LAYOUT.chunk_shape, dtype=torch.float32)], "float16 tensor"),
        ([torch.empty(kv.LAYOUT.chunk_shape, dtype=torch.float16)[:, 0]], "contiguous"),
        ([torch.empty(3, dtype=torch.float16)], "has 6 bytes, one chunk needs"),
        ([torch.empty(kv.LAYOUT.chunk_shape, dtype=torch.float16, device="meta")], "'meta'"),
        ([bytes(NBYTES)], "unsupported destination type bytes"),
        ([memoryview(bytes(NBYTES))], "read-only"),
        ([np.empty((NBYTES, 2), dtype=np.uint8)[:, 0]], "contiguous"),
        ([ChunkPages((np.empty(NBYTES - 1, dtype=np.uint8),))], "pages hold 2047 bytes"),
        ([ChunkPages((np.empty(NBYTES // 2, dtype=np.uint16),))], "flat contiguous uint8"),
        ([ChunkPages((np.empty((NBYTES, 2), dtype=np.uint8)[:, 0],))], "flat contiguous"),
        ([ChunkPages((np.frombuffer(bytes(NBYTES), dtype=np.uint8),))], "writable"),
    ],
)
def test_buffers_that_do_not_fit_raise(out: list[Any], message: str) -> None:
    with pytest.raises(LayoutMismatch, match=message):
        OutBuffers.of(out, kv.LAYOUT, 1)
