"""The store a replay runs on: its tiers sized in stand-in blocks (``store_config``),
and the chunk keys of a call (``ChunkChains``), which the offline bound keys by too."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, Namespace, external_keys
from kvstore.kinds import TierKind
from kvstore.predictor.replay.config import ReplayConfig
from kvstore.predictor.replay.conversations import Call
from kvstore.predictor.replay.costs import stand_in_capacity, stand_in_layout
from kvstore.store.config import StoreConfig
from kvstore.tiers.registry import TierConfig


def store_config(config: ReplayConfig, chunk_tokens: int, directory: Path) -> StoreConfig:
    """The store for one replay in ``directory``: each tier of ``config.sizing`` holds
    its slots of stand-in blocks; HBM on the CPU, LMDB without fsync, Redis (with
    ``--redis-gb``) written back as one host's overflow."""
    layout = stand_in_layout(chunk_tokens)
    tiers = []
    for kind in TierKind:
        slots = config.sizing.slots(kind, chunk_tokens, config.kv_bytes_per_token)
        if slots <= 0:
            continue
        capacity = stand_in_capacity(kind, slots, layout)
        if kind is TierKind.HBM:
            tiers.append(TierConfig(kind, capacity, device="cpu"))
        elif kind is TierKind.DRAM:
            tiers.append(TierConfig(kind, capacity))
        elif kind is TierKind.SSD:
            tiers.append(TierConfig(kind, capacity, path=directory / "lmdb", sync=False))
        else:
            if config.redis_url is None:
                raise ConfigError("a Redis tier needs a redis_url (local.redis_server starts one)")
            prefix = f"kvs-replay-{directory.name}"
            # One host's overflow, kept within --redis-gb by the store: write-back.
            tiers.append(
                TierConfig(kind, capacity, url=config.redis_url, key_prefix=prefix, write="back")
            )
    if not tiers or tiers[0].kind is not TierKind.HBM:
        raise ConfigError("the engine model needs an HBM tier: give --hbm-gb")
    costs = dataclasses.replace(config.costs, kv_bytes_per_token=config.kv_bytes_per_token)
    return StoreConfig(
        tiers=tuple(tiers), promote_on_hit=True, scan_on_open=False, data_dir=directory, costs=costs
    )


class ChunkChains:
    """A call's block ids as the chunk keys of one namespace: ``chunk_blocks`` ids a
    chunk, each keyed by every id before and in it (interned, so a chunk is hashed
    once however many calls share it)."""

    def __init__(self, namespace: Namespace, chunk_blocks: int) -> None:
        self.namespace = namespace
        self.chunk_blocks = chunk_blocks
        self._ids: dict[tuple[int, tuple[str, ...]], int] = {}
        self._keys: list[ChunkKey] = []

    def of(self, call: Call) -> list[ChunkKey]:
        return [self._keys[chunk] for chunk in self.ids(call)]

    def ids(self, call: Call) -> list[int]:
        """The call's chunks as small integers, one per distinct prefix."""
        size = self.chunk_blocks
        chunks: list[int] = []
        parent = -1
        for end in range(size, len(call.blocks) + 1, size):
            link = (parent, call.blocks[end - size : end])
            chunk = self._ids.get(link)
            if chunk is None:
                chunk = self._ids[link] = len(self._keys)
                self._keys.append(external_keys(self.namespace, [chunk])[0])
            chunks.append(chunk)
            parent = chunk
        return chunks
