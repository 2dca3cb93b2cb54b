"""HBM blocks shared with a local engine (``client.device``): the arena opened by its
handle, blocks copied into ``out=`` tensors and proven by their generations, and every
way it falls back to bytes. On the CPU the HBM arena is a host segment (its handle a
segment name), so the path runs for real here; the CUDA IPC tests need a device."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support import client_data, kv
from support.daemon import Daemon
from support.http_kv import make_chain, put, register

import kvstore
from kvstore.block import stored_block
from kvstore.client.blocks import LeasedBlock
from kvstore.client.device import HBMArena, copy_device
from kvstore.keys import ChunkKey
from kvstore.tiers.arena_handle import ArenaHandle, HandleKind
from kvstore.tiers.hbm import HBMTier
from kvstore.tiers.kinds import TierKind

NS = kv.namespace(salt="device")
CHAIN = make_chain(NS, 3, start=70_000, seed=11)
CHUNKS = kv.chunks(3, seed=11)


@pytest.fixture
def hbm() -> Iterator[HBMTier]:
    tier = HBMTier(8 * kv.ARENA_SLOT, device="cpu")
    tier.put_many(
        NS.digest,
        [(key, stored_block(block)) for key, block in zip(CHAIN.keys, CHAIN.blocks, strict=True)],
    )
    try:
        yield tier
    finally:
        tier.close()


def leased(tier: HBMTier, key: ChunkKey) -> LeasedBlock:
    return client_data.leased(tier, key, NS)


def flat_out(n: int, device: str = "cpu") -> list[torch.Tensor]:
    return [torch.zeros(NS.layout.chunk_nbytes, dtype=torch.uint8, device=device) for _ in range(n)]


def as_chunk(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.cpu().view(torch.float16).reshape(kv.LAYOUT.chunk_shape)


def test_a_cpu_arena_is_handed_out_as_its_segment_and_copied_from_by_name(hbm: HBMTier) -> None:
    handle = hbm.handle()
    assert handle is not None and handle is hbm.handle()  # made once
    assert handle.kind is HandleKind.SHM and handle.size == 8 * kv.ARENA_SLOT
    assert ArenaHandle.from_json(handle.to_json()) == handle
    arena = HBMArena.open(handle)
    try:
        out = flat_out(3)
        entries = [(index, leased(hbm, key)) for index, key in enumerate(CHAIN.keys)]
        assert copy_device(arena, NS, CHAIN.keys, entries, out) == []
        for buffer, expected in zip(out, CHUNKS, strict=True):
            assert torch.equal(as_chunk(buffer), expected)
    finally:
        arena.close()


def test_blocks_that_cannot_be_copied_as_they_lie_fall_back(hbm: HBMTier) -> None:
    """A block under another key, an out= tensor of the wrong size, an entry that runs
    past the arena or has no generation: each is fetched as bytes, the rest copied."""
    handle = hbm.handle()
    assert handle is not None
    arena = HBMArena.open(handle)
    first, second, third = (leased(hbm, key) for key in CHAIN.keys)
    entries = [
        (0, second),  # key 0 asked, key 1's block shown
        (1, second),
        (2, third),
        (3, LeasedBlock(handle.size - 4096, first.length, TierKind.HBM, False, 0, 0)),
        (4, LeasedBlock(first.offset, first.length, TierKind.HBM, False)),  # no generation
    ]
    out = flat_out(5)
    out[2] = torch.zeros(7, dtype=torch.uint8)
    keys = [*CHAIN.keys, CHAIN.keys[0], CHAIN.keys[0]]
    try:
        assert copy_device(arena, NS, keys, entries, out) == [0, 2, 3, 4]
        assert torch.equal(as_chunk(out[1]), CHUNKS[1])
        assert not out[0].any() and not out[3].any() and not out[4].any()
    finally:
        arena.close()


def test_an_extent_freed_since_its_lease_falls_back(hbm: HBMTier) -> None:
    """The seqlock of the DRAM path, for device copies: the block deleted and its extent
    reused after the lease was granted moves its generation, so what landed in out=
    is not trusted and the block is fetched as bytes."""
    handle = hbm.handle()
    assert handle is not None
    entries = [(index, leased(hbm, key)) for index, key in enumerate(CHAIN.keys)]
    hbm.delete_many(NS.digest, [CHAIN.keys[1]])
    hbm.put_many(NS.digest, [(CHAIN.keys[1], stored_block(CHAIN.blocks[1]))])
    assert leased(hbm, CHAIN.keys[1]).offset == entries[1][1].offset  # the same extent
    arena = HBMArena.open(handle)
    try:
        assert copy_device(arena, NS, CHAIN.keys, entries, flat_out(3)) == [1]
    finally:
        arena.close()


def test_an_arena_that_will_not_open_raises_and_a_tier_that_does_not_share_has_no_handle(
    hbm: HBMTier,
) -> None:
    handle = hbm.handle()
    assert handle is not None
    gone = ArenaHandle(HandleKind.SHM, handle.size, handle.generations, "kvstore-0-00000000")
    with pytest.raises(FileNotFoundError):
        HBMArena.open(gone)
    with pytest.raises(ValueError):
        ArenaHandle.from_json({"kind": "shm", "size": 1, "generations": "g"})  # no name
    private = HBMTier(kv.ARENA_SLOT, device="cpu", share=False)
    try:
        assert private.handle() is None
    finally:
        private.close()


# -- against a daemon -----------------------------------------------------------------

HBM_DAEMON = """\
data_dir = "{data_dir}"

[tiers.hbm]
capacity = "1MiB"
device = "{device}"
share = {share}

[tiers.dram]
capacity = "4MiB"
"""


def hbm_daemon(factory: Any, device: str = "cpu", share: bool = True) -> Daemon:
    return factory(HBM_DAEMON.replace("{device}", device).replace("{share}", str(share).lower()))


def shm_get(daemon: Daemon, keys: list[ChunkKey], device_memory: bool) -> dict[str, Any]:
    body = {
        "namespace": NS.digest.hex(),
        "keys": [key.hex() for key in keys],
        "transfer": "shm",
        "device_memory": device_memory,
    }
    with daemon.client() as http:
        answer = http.post("/v1/get", json=body)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())


def put_chain(daemon: Daemon) -> None:
    with daemon.client() as http:
        register(http, NS)
        assert put(http, CHAIN) == 3


def test_a_shm_get_describes_hbm_blocks_only_to_a_client_that_asks(
    daemon_factory: Any,
) -> None:
    daemon = hbm_daemon(daemon_factory)
    put_chain(daemon)
    plain = shm_get(daemon, CHAIN.keys, device_memory=False)
    assert "hbm" not in plain and all(entry.get("inline") for entry in plain["blocks"])
    grant = shm_get(daemon, CHAIN.keys, device_memory=True)
    handle = ArenaHandle.from_json(grant["hbm"])
    assert handle.kind is HandleKind.SHM and handle.size == 1 << 20
    for entry, key in zip(grant["blocks"], CHAIN.keys, strict=True):
        assert entry["key"] == key.hex() and entry["tier"] == "hbm"
        assert entry["length"] == len(CHAIN.blocks[0]) and entry["generation"] == 0
        assert entry["generation_at"] == 8 * (entry["offset"] // 4096)
    with daemon.client() as http:
        stats = http.get("/v1/stats").json()
        assert stats["daemon"]["leased_blocks"] == 3  # the HBM blocks, pinned
        assert http.post(f"/v1/leases/{grant['lease']}/release").json() == {"released": 3}
        assert http.get("/v1/stats").json()["daemon"]["leased_blocks"] == 0
        assert stats["store"]["tiers"]["hbm"]["hits"] == 3


def test_a_daemon_whose_hbm_arena_is_not_shared_sends_its_blocks_inline(
    daemon_factory: Any,
) -> None:
    daemon = hbm_daemon(daemon_factory, share=False)
    put_chain(daemon)
    grant = shm_get(daemon, CHAIN.keys, device_memory=True)
    assert "hbm" not in grant and all(entry.get("inline") for entry in grant["blocks"])


def test_a_client_gets_hbm_blocks_into_out_tensors_through_the_arena(
    daemon_factory: Any,
) -> None:
    """out= tensors and FAST: copied out of the HBM arena, no fallback; without out=
    the same blocks come as bytes; a FULL client never asks."""
    daemon = hbm_daemon(daemon_factory)
    put_chain(daemon)
    with kvstore.connect(daemon.url, transfer="shm", verify="fast") as client:
        out = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in CHUNKS]
        got = client.get(NS, CHAIN.keys, out=out)
        assert [chunk.tier for chunk in got if chunk is not None] == [TierKind.HBM] * 3
        assert all(torch.equal(a, b) for a, b in zip(out, CHUNKS, strict=True))
        assert client.client_stats().device_fallbacks == 0
        plain = client.get(NS, CHAIN.keys)
        assert all(
            torch.equal(c.tensor(), e) for c, e in zip(plain, CHUNKS, strict=True) if c is not None
        )
        assert None not in plain
    with daemon.client() as http:
        hbm_hits = http.get("/v1/stats").json()["store"]["tiers"]["hbm"]["hits"]
    assert hbm_hits == 6  # three leased, three read as bytes


def test_a_client_that_cannot_open_the_arena_falls_back_to_bytes_for_good(
    daemon_factory: Any,
) -> None:
    """The arena's segment gone from this client's /dev/shm (another container's, say):
    the blocks come as bytes, counted, and the client stops asking."""
    daemon = hbm_daemon(daemon_factory)
    put_chain(daemon)
    name = ArenaHandle.from_json(shm_get(daemon, CHAIN.keys[:1], True)["hbm"]).name
    assert name is not None
    os.unlink(Path("/dev/shm") / name)  # the daemon keeps its mapping
    with kvstore.connect(daemon.url, transfer="shm", verify="fast") as client:
        for fallbacks in (3, 3):
            out = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in CHUNKS]
            got = client.get(NS, CHAIN.keys, out=out)
            assert None not in got and all(
                torch.equal(a, b) for a, b in zip(out, CHUNKS, strict=True)
            )
            assert client.client_stats().device_fallbacks == fallbacks
    assert daemon.stop() == 0  # its segment already gone, the daemon still shuts down clean


# -- on a device ----------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_copies_hbm_blocks_device_to_device_from_the_daemon(
    daemon_factory: Any,
) -> None:
    """The daemon's HBM arena on the device, opened here by its CUDA IPC handle (another
    process's memory), blocks copied device to device into out= tensors, exact; an
    out= tensor in host memory is not copied into but falls back."""
    daemon = hbm_daemon(daemon_factory, device="cuda")
    put_chain(daemon)
    grant = shm_get(daemon, CHAIN.keys, device_memory=True)
    handle = ArenaHandle.from_json(grant["hbm"])
    assert handle.kind is HandleKind.CUDA_IPC
    entries = [(index, LeasedBlock.parse(entry)) for index, entry in enumerate(grant["blocks"])]
    arena = HBMArena.open(handle)
    try:
        out = flat_out(3, device="cuda")
        assert copy_device(arena, NS, CHAIN.keys, entries, out) == []
        for buffer, expected in zip(out, CHUNKS, strict=True):
            assert torch.equal(as_chunk(buffer), expected)
        host = flat_out(3)
        assert copy_device(arena, NS, CHAIN.keys, entries, host) == [0, 1, 2]
        assert not any(buffer.any() for buffer in host)
    finally:
        arena.close()
        with daemon.client() as http:
            http.post(f"/v1/leases/{grant['lease']}/release")
