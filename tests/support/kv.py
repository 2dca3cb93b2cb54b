"""Small namespaces, chunk data and store configs shared by the store tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.block import HEADER_BYTES
from kvstore.keys import ChunkKey, KVLayout, Namespace
from kvstore.kinds import TierKind
from kvstore.store.config import StoreConfig
from kvstore.store.tiered_store import TieredStore
from kvstore.tiers.registry import TierConfig

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=16)
# One chunk's stored size in an arena (header + payload, rounded to the 4 KiB page).
ARENA_SLOT = 4096
assert HEADER_BYTES + LAYOUT.chunk_nbytes <= ARENA_SLOT


def namespace(model: str = "test-model", salt: str | None = None) -> Namespace:
    return Namespace(model, LAYOUT, tenant_salt=salt)


def tokens(n_chunks: int, start: int = 0) -> np.ndarray:
    """Token ids for ``n_chunks`` full chunks; different ``start`` gives a different chain."""
    return np.arange(start, start + n_chunks * LAYOUT.chunk_tokens, dtype=np.int64)


def chunks(n_chunks: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(LAYOUT.chunk_shape, generator=generator).to(torch.float16)
        for _ in range(n_chunks)
    ]


def config(*tiers: TierConfig, promote_on_hit: bool = True) -> StoreConfig:
    return StoreConfig(tiers=tiers, promote_on_hit=promote_on_hit)


def hbm(slots: int) -> TierConfig:
    return TierConfig(TierKind.HBM, slots * ARENA_SLOT, device="cpu")


def dram(slots: int) -> TierConfig:
    return TierConfig(TierKind.DRAM, slots * ARENA_SLOT)


def ssd(path: Path, capacity: int = 64 << 20, codec: str = "none") -> TierConfig:
    return TierConfig(TierKind.SSD, capacity, path=path, codec=codec)


def redis(
    url: str, capacity: int = 64 << 20, codec: str = "none", write: str | None = None
) -> TierConfig:
    return TierConfig(
        TierKind.REDIS,
        capacity,
        url=url,
        codec=codec,
        socket_timeout_s=0.5,
        connect_timeout_s=0.5,
        write=write,
    )


def assert_chunks_equal(
    store: TieredStore, ns: Namespace, keys: Sequence[ChunkKey], expected: Sequence[torch.Tensor]
) -> None:
    """Every key is found and reads back exactly ``expected``."""
    got = store.get(ns, keys)
    assert all(chunk is not None for chunk in got)
    for chunk, tensor in zip(got, expected, strict=True):
        assert chunk is not None
        assert torch.equal(chunk.tensor(), tensor)


@pytest.fixture
def two_level(tmp_path: Path) -> Iterator[TieredStore]:
    """A store of 64 DRAM slots over LMDB (the store tests' common case)."""
    with TieredStore(config(dram(64), ssd(tmp_path / "lmdb"))) as store:
        yield store


def socket_reads(data: bytes, cut: int) -> Callable[[memoryview], None]:
    """A ``fill`` reading ``data`` in order, at most ``cut`` bytes per read (a socket)."""
    source = memoryview(data)

    def fill(step: memoryview) -> None:
        nonlocal source
        filled = 0
        while filled < step.nbytes:
            take = min(cut, step.nbytes - filled, source.nbytes)
            assert take, "read past the end of the source"
            step[filled : filled + take] = source[:take]
            source = source[take:]
            filled += take

    return fill


def wait_until_up(store: TieredStore, kind: TierKind, timeout_s: float = 15.0) -> float:
    """Wait for tier ``kind``'s breaker to close after an outage (its probe runs every
    0.5 s at first); how long that took. Fails the test after ``timeout_s``."""
    started = time.monotonic()
    while store.stats().tiers[kind].down:
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{kind.label} still down after {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - started


def written_through(store: TieredStore, timeout_s: float = 10.0) -> None:
    """Wait until every write-through copy queued so far has landed. A block being
    copied is pinned, and ``demote`` passes over pinned blocks: a test that moves
    blocks right after putting them waits here first."""
    assert store.drain_write_through(time.monotonic() + timeout_s)
