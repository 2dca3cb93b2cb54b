"""kvstore: a hierarchical KV-cache store for LLM inference.

Embedded use::

    import kvstore

    ns = kvstore.Namespace("llama-3.1-8b", kvstore.KVLayout(32, 8, 128, "bfloat16"))
    with kvstore.TieredStore() as store:          # DRAM + LMDB, the embedded default
        store.put(ns, token_ids, kv_chunks)       # one tensor per full chunk
        prefix = store.lookup(ns, token_ids)      # prefix.num_tokens, prefix.tiers
        chunks = store.get(ns, prefix.keys)       # verified, bit for bit
"""

from kvstore.aio import AsyncTieredStore
from kvstore.chunk import CachedPrefix, KVChunk
from kvstore.client import connect, connect_async
from kvstore.config import StoreConfig, TierConfig
from kvstore.errors import (
    ConfigError,
    CorruptBlock,
    KVStoreError,
    LayoutMismatch,
    RequestTooLarge,
    TierError,
    TierFull,
    TierUnavailable,
    UnknownNamespace,
)
from kvstore.keys import ChunkKey, HashAlgo, KVLayout, Namespace, chunk_keys, external_keys
from kvstore.policy import EvictionPolicy, LRUPolicy
from kvstore.store import TieredStore
from kvstore.tiers.base import TierKind

__all__ = [
    "AsyncTieredStore",
    "CachedPrefix",
    "ChunkKey",
    "ConfigError",
    "CorruptBlock",
    "EvictionPolicy",
    "HashAlgo",
    "KVChunk",
    "KVLayout",
    "KVStoreError",
    "LRUPolicy",
    "LayoutMismatch",
    "Namespace",
    "RequestTooLarge",
    "StoreConfig",
    "TierConfig",
    "TierError",
    "TierFull",
    "TierKind",
    "TierUnavailable",
    "TieredStore",
    "UnknownNamespace",
    "chunk_keys",
    "connect",
    "connect_async",
    "external_keys",
]
