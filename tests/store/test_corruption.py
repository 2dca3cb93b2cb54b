"""Corruption injection: flip bits in, truncate, extend and swap stored values in
LMDB and Redis behind the store's back. Every one must be detected, purged and
counted; no wrong byte may ever be returned."""

from __future__ import annotations

from pathlib import Path

import lmdb
import redis
import torch
from support import kv

from kvstore import TieredStore, TierKind
from kvstore.block import HEADER_BYTES
from kvstore.local.redis_server import RedisServer

N_CHUNKS = 8


def corrupt(value: bytes, how: str, other: bytes) -> bytes:
    """One kind of damage per chunk; ``other`` is another (valid) block's bytes."""
    if how == "payload-bit":
        index = HEADER_BYTES + 777
        return value[:index] + bytes([value[index] ^ 0x10]) + value[index + 1 :]
    if how == "header-bit":
        return value[:60] + bytes([value[60] ^ 0x01]) + value[61:]
    if how == "checksum-bit":
        return value[:90] + bytes([value[90] ^ 0x80]) + value[91:]
    if how == "truncated":
        return value[: len(value) // 2]
    if how == "header-only":
        return value[:HEADER_BYTES]
    if how == "extended":
        return value + b"\x00" * 8
    if how == "swapped":
        return other
    raise AssertionError(how)


DAMAGE = [
    "payload-bit",
    "header-bit",
    "checksum-bit",
    "truncated",
    "header-only",
    "extended",
    "swapped",
]


def assert_detected(store: TieredStore, kind: TierKind, data: list[torch.Tensor]) -> None:
    ns = kv.namespace()
    keys = store.keys_for(ns, kv.tokens(N_CHUNKS))
    got = store.get(ns, keys)
    damaged = len(DAMAGE)
    assert [chunk is None for chunk in got] == [True] * damaged + [False] * (N_CHUNKS - damaged)
    for chunk, tensor in zip(got[damaged:], data[damaged:], strict=True):
        assert chunk is not None and torch.equal(chunk.tensor(), tensor)
    assert store.stats().tiers[kind].corrupt_blocks == damaged
    # Purged from the tier, so a second read is a plain miss, not another detection.
    assert store.tier(kind).contains_many(ns.digest, keys[:damaged]) == [False] * damaged


def test_every_lmdb_corruption_is_detected(tmp_path: Path) -> None:
    ns = kv.namespace()
    data = kv.chunks(N_CHUNKS)
    config = kv.config(kv.ssd(tmp_path / "lmdb"), promote_on_hit=False)
    with TieredStore(config) as store:
        store.put(ns, kv.tokens(N_CHUNKS), data)
        keys = store.keys_for(ns, kv.tokens(N_CHUNKS))
    env = lmdb.open(str(tmp_path / "lmdb"), subdir=True)
    with env.begin(write=True) as txn:
        values = [bytes(txn.get(ns.digest + key)) for key in keys]
        for index, how in enumerate(DAMAGE):
            txn.put(ns.digest + keys[index], corrupt(values[index], how, values[-1]))
    env.close()
    with TieredStore(config) as store:
        # Header damage is already caught by the index rebuild at open; the rest on read.
        assert_detected(store, TierKind.SSD, data)


def test_every_redis_corruption_is_detected(clean_redis: RedisServer) -> None:
    ns = kv.namespace()
    data = kv.chunks(N_CHUNKS)
    config = kv.config(kv.redis(clean_redis.url), promote_on_hit=False)
    with TieredStore(config) as store:
        store.put(ns, kv.tokens(N_CHUNKS), data)
        keys = store.keys_for(ns, kv.tokens(N_CHUNKS))
        client = redis.Redis.from_url(clean_redis.url)
        try:
            prefix = f"kvs:{ns.digest.hex()}:".encode()
            values = [client.get(prefix + key) for key in keys]
            for index, how in enumerate(DAMAGE):
                client.set(prefix + keys[index], corrupt(values[index], how, values[-1]))
        finally:
            client.close()
        assert_detected(store, TierKind.REDIS, data)


def test_a_corrupt_copy_falls_back_to_a_good_lower_copy(
    tmp_path: Path, clean_redis: RedisServer
) -> None:
    ns = kv.namespace()
    data = kv.chunks(2)
    config = kv.config(kv.ssd(tmp_path / "lmdb"), kv.redis(clean_redis.url))
    with TieredStore(config) as store:
        store.put(ns, kv.tokens(2), data)
        keys = store.keys_for(ns, kv.tokens(2))
        kv.written_through(store)
        store.demote(ns, keys)  # LMDB -> Redis
        store.promote(ns, keys)  # copy back up; Redis keeps its copy
        assert store.lookup(ns, kv.tokens(2)).tiers == (TierKind.SSD, TierKind.SSD)
    env = lmdb.open(str(tmp_path / "lmdb"), subdir=True)
    with env.begin(write=True) as txn:
        value = bytes(txn.get(ns.digest + keys[0]))
        txn.put(ns.digest + keys[0], corrupt(value, "payload-bit", value))
    env.close()
    with TieredStore(config) as store:
        got = store.get(ns, keys)
        assert got[0] is not None and got[0].tier is TierKind.REDIS
        assert torch.equal(got[0].tensor(), data[0])
        assert store.stats().tiers[TierKind.SSD].corrupt_blocks == 1
