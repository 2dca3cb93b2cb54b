"""What the Redis tier tests share: blocks shaped as the store writes them, the Redis
key a block lands under, and ``make_tier``, which closes every tier it built."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvstore.block import Block, encode_block
from kvstore.keys import ChunkKey, KVLayout, Namespace, chunk_keys
from kvstore.tiers.redis_tier import RedisTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=16)
NS = Namespace("test-model", LAYOUT)
OTHER_NS = Namespace("test-model", LAYOUT, tenant_salt="other-tenant")
CAPACITY = 1 << 30

MakeTier = Callable[..., RedisTier]


def make_blocks(namespace: Namespace, n: int, *, seed: int = 0) -> list[tuple[ChunkKey, Block]]:
    """``n`` chained chunks with random payloads, encoded as the store would."""
    layout = namespace.layout
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, size=n * layout.chunk_tokens)
    blocks: list[tuple[ChunkKey, Block]] = []
    parent: ChunkKey | None = None
    for key in chunk_keys(namespace, tokens):
        payload = rng.integers(0, 256, size=layout.chunk_nbytes, dtype=np.uint8).tobytes()
        blocks.append((key, encode_block(namespace, key, parent, memoryview(payload))))
        parent = key
    return blocks


def redis_key(namespace: Namespace, key: ChunkKey, prefix: str = "kvs") -> bytes:
    return f"{prefix}:{namespace.digest.hex()}:".encode() + key


@pytest.fixture
def make_tier() -> Iterator[MakeTier]:
    """Build tiers that are always closed after the test (no ResourceWarning)."""
    tiers: list[RedisTier] = []

    def make(url_or_nodes: str | list[str], **kwargs: object) -> RedisTier:
        tier = RedisTier(url_or_nodes, kwargs.pop("capacity_bytes", CAPACITY), **kwargs)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()
