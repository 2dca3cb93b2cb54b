"""kvstore: a hierarchical KV-cache store for LLM inference.

Embedded use::

    import kvstore

    ns = kvstore.Namespace("llama-3.1-8b", kvstore.KVLayout(32, 8, 128, "bfloat16"))
    with kvstore.TieredStore() as store:          # DRAM + LMDB, the embedded default
        store.put(ns, token_ids, kv_chunks)       # one tensor per full chunk
        prefix = store.lookup(ns, token_ids)      # prefix.num_tokens, prefix.tiers
        chunks = store.get(ns, prefix.keys)       # verified, bit for bit

The package, one folder per audience, dependencies running one way (a test,
``tests/layout/test_imports.py``, keeps it so)::

    kvstore/*.py        the format: errors.py, keys.py, kinds.py (the tier kinds and their
                        traits), block.py, codec.py, config.py (the settings loader);
                        and what every layer shares: breaker.py (skip a failed backend
                        until a probe finds it back), throttled_log.py (a line at most
                        once per interval), tensors.py (is it a tensor, without torch)
    kvstore/tiers/      one protocol, one registry, one module per backend
    kvstore/local/      what kvstore starts for itself: private redis-servers and a Redis
                        Cluster (the replay's, the benchmarks', the tests'), child processes
    kvstore/store/      the embedded engine: StoreCore and its faces, placement, eviction
    kvstore/wire/       what both ends of a socket agree on: codes, messages, frames, events
    kvstore/server/     the daemon (``kvstore serve``), all of it
    kvstore/client/     engines' side: connect(), the API protocol, hf/, vllm/
    kvstore/predictor/  learning when a human returns, and placing idle KV by it
    kvstore/cli/        the ``kvstore`` command

    format  <-  tiers  <-  store  <-  wire  <-  server, client, predictor  <-  cli
    format  <-  local  <-  predictor (the replay's Redis tier)

This module is the front door: every public name resolves on first use, so
``import kvstore.keys`` loads neither the store nor the client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.client.connect import connect, connect_async
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
    from kvstore.kinds import TierKind
    from kvstore.store.async_store import AsyncTieredStore
    from kvstore.store.chunk import CachedPrefix, KVChunk
    from kvstore.store.config import StoreConfig
    from kvstore.store.eviction import EvictionPolicy, LRUPolicy
    from kvstore.store.tiered_store import TieredStore
    from kvstore.tiers.registry import TierConfig

# Public name -> the module that defines it.
_PUBLIC: dict[str, str] = {
    "AsyncTieredStore": "kvstore.store.async_store",
    "CachedPrefix": "kvstore.store.chunk",
    "ChunkKey": "kvstore.keys",
    "ConfigError": "kvstore.errors",
    "CorruptBlock": "kvstore.errors",
    "EvictionPolicy": "kvstore.store.eviction",
    "HashAlgo": "kvstore.keys",
    "KVChunk": "kvstore.store.chunk",
    "KVLayout": "kvstore.keys",
    "KVStoreError": "kvstore.errors",
    "LRUPolicy": "kvstore.store.eviction",
    "LayoutMismatch": "kvstore.errors",
    "Namespace": "kvstore.keys",
    "RequestTooLarge": "kvstore.errors",
    "StoreConfig": "kvstore.store.config",
    "TierConfig": "kvstore.tiers.registry",
    "TierError": "kvstore.errors",
    "TierFull": "kvstore.errors",
    "TierKind": "kvstore.kinds",
    "TierUnavailable": "kvstore.errors",
    "TieredStore": "kvstore.store.tiered_store",
    "UnknownNamespace": "kvstore.errors",
    "chunk_keys": "kvstore.keys",
    "connect": "kvstore.client.connect",
    "connect_async": "kvstore.client.connect",
    "external_keys": "kvstore.keys",
}

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


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
