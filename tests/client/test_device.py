"""HBM blocks shared with a local engine (``client.device``): the arena opened by its
handle, blocks copied into ``out=`` tensors and proven by their generations, and every
way it falls back to bytes; and a get into ``out=`` tensors across every tier, through
``connect`` (``kvstore.store.out_buffers``). On the CPU the HBM arena is a host segment
(its handle a segment name), so the paths run for real here; the CUDA tests run the
same scenarios with the arena and the tensors on a device."""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import client_data, kv
from support.clients import FLAVOURS
from support.clients import opened as opened_client
from support.daemon import Daemon
from support.http_kv import make_chain, put, register
from support.lmdb_blocks import damage_block

import kvstore
from kvstore.block import stored_block
from kvstore.client.blocks import LeasedBlock
from kvstore.client.device import HBMArena, copy_device
from kvstore.keys import ChunkKey, chunk_keys
from kvstore.kinds import TierKind
from kvstore.store.chunk import KVChunk
from kvstore.tiers.arena_handle import ArenaHandle, HandleKind
from kvstore.tiers.hbm import HBMTier

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


# -- get(out=) tensors across the tiers ------------------------------------------------

# Two blocks' room in HBM and in DRAM: a chain of six puts its head in HBM, the next
# two in DRAM and its tail in LMDB only (every block is written through to LMDB).
TIERED = """\
data_dir = "{data_dir}"

[tiers.hbm]
capacity = "8KiB"
device = "{device}"

[tiers.dram]
capacity = "8KiB"

[tiers.ssd]
capacity = "16MiB"
"""
TOKENS = kv.tokens(6, start=80_000)
TIERED_CHUNKS = kv.chunks(6, seed=12)
# The chain, then a key never stored.
TIERED_KEYS = [*chunk_keys(NS, TOKENS), *chunk_keys(NS, kv.tokens(1, start=90_000))]
SENTINEL = 0x5A  # what each out= tensor holds before the get


def sentinel_out(device: str) -> list[torch.Tensor]:
    out = [
        torch.empty(kv.LAYOUT.chunk_shape, dtype=torch.float16, device=device) for _ in TIERED_KEYS
    ]
    for buffer in out:
        buffer.view(torch.uint8).fill_(SENTINEL)
    return out


def untouched(buffer: torch.Tensor) -> bool:
    return bool((buffer.view(torch.uint8) == SENTINEL).all())


def damage_dram_header(daemon: Daemon, key: ChunkKey) -> None:
    """Flip a bit of the magic of ``key``'s block in the daemon's DRAM arena, as a stray
    write would: a shared-memory copy parses every header, so the block is corrupt."""
    grant = shm_get(daemon, [key], device_memory=False)
    offset = grant["blocks"][0]["offset"]
    with daemon.client() as http:
        http.post(f"/v1/leases/{grant['lease']}/release")
    fd = os.open(Path("/dev/shm") / grant["shm"], os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as mapping:
            mapping[offset] ^= 0x01
    finally:
        os.close(fd)


def check_landed(got: list[KVChunk | None], out: list[torch.Tensor], device: str) -> None:
    """Every hit is exact in its out= tensor and its chunk stands for it; a tensor on a
    device that missed keeps what it held (a host buffer's content is unspecified)."""
    for chunk, buffer, expected in zip(got, out, [*TIERED_CHUNKS, None], strict=True):
        if chunk is None:
            assert device == "cpu" or untouched(buffer)
            continue
        assert expected is not None and torch.equal(buffer.cpu(), expected)
        assert torch.equal(chunk.tensor().cpu(), expected)
        if device == "cpu":
            assert chunk.out is None and np.shares_memory(
                np.frombuffer(chunk.payload, dtype=np.uint8), buffer.view(torch.uint8).numpy()
            )
        else:
            assert chunk.out is not None and chunk.out.data_ptr() == buffer.data_ptr()
            assert chunk.payload.nbytes == 0


def get_across_tiers(daemon_factory: Any, flavour: str, device: str) -> None:
    """One get into out= tensors on ``device``: two blocks in HBM (copied device to
    device), two in DRAM, one of them with a damaged header (a miss), two in LMDB (as
    bytes), one never stored; each hit or miss reported for its block."""
    daemon = daemon_factory(TIERED.replace("{device}", device))
    hbm, dram, ssd = TierKind.HBM, TierKind.DRAM, TierKind.SSD

    async def scenario() -> None:
        async with opened_client(flavour, daemon.url, transfer="shm", verify="fast") as client:
            assert await client.put(NS, TOKENS, TIERED_CHUNKS) == 6
            assert (await client.lookup(NS, TOKENS)).tiers == (hbm, hbm, dram, dram, ssd, ssd)
            damage_dram_header(daemon, TIERED_KEYS[3])
            out = sentinel_out(device)
            got = await client.get(NS, TIERED_KEYS, out=out)
            assert [chunk and chunk.tier for chunk in got] == [hbm, hbm, dram, None, ssd, ssd, None]
            check_landed(got, out, device)
            stats = await client.client_stats()
            assert (stats.corrupt_blocks, stats.device_fallbacks) == (1, 0)

    asyncio.run(scenario())


def embedded_across_tiers(tmp_path: Path, flavour: str, device: str) -> None:
    """The embedded store, the same get: a block damaged in LMDB is a miss, every other
    block lands in its tensor, read from LMDB, then again from the tiers it was
    promoted to."""
    config = tmp_path / "store.toml"
    config.write_text(TIERED.replace("{data_dir}", str(tmp_path)).replace("{device}", device))
    url = f"embedded://{config}"

    async def put() -> None:
        async with opened_client(flavour, url) as store:
            assert await store.put(NS, TOKENS, TIERED_CHUNKS) == 6

    async def get() -> list[set[TierKind]]:
        tiers = []
        async with opened_client(flavour, url) as store:
            for _ in range(2):
                out = sentinel_out(device)
                got = await store.get(NS, TIERED_KEYS, out=out)
                assert [chunk is None for chunk in got] == [False] * 3 + [True] + [False] * 2 + [
                    True
                ]
                check_landed(got, out, device)
                tiers.append({chunk.tier for chunk in got if chunk is not None})
        return tiers

    asyncio.run(put())
    damage_block(tmp_path / "lmdb", NS, TIERED_KEYS[3])  # the store closed, as a disk would
    first, second = asyncio.run(get())
    assert first == {TierKind.SSD} and TierKind.HBM in second


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_get_into_out_tensors_spans_every_tier_and_reports_each_block(
    daemon_factory: Any, flavour: str
) -> None:
    get_across_tiers(daemon_factory, flavour, "cpu")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_an_embedded_get_into_out_tensors_spans_every_tier(tmp_path: Path, flavour: str) -> None:
    embedded_across_tiers(tmp_path, flavour, "cpu")


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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_get_into_cuda_tensors_spans_every_tier_hbm_blocks_by_cuda_ipc(
    daemon_factory: Any,
) -> None:
    """Through ``connect``: the daemon's HBM blocks by CUDA IPC, DRAM and LMDB blocks
    verified in host memory then copied to the device, a corrupt block and a missing
    one left as they were. The blocking flavour only: the async one drives the same
    operation, and the CPU test runs both."""
    get_across_tiers(daemon_factory, "sync", "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_embedded_get_into_cuda_tensors_spans_every_tier(tmp_path: Path) -> None:
    embedded_across_tiers(tmp_path, "sync", "cuda")
