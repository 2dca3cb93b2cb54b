"""The replay's model of time and size: what a request costs, how big a tier is.

The store moves real but tiny stand-in payloads (two bytes per token), so
nothing here is measured: every cost is modeled from ``kvstore.store.config.CostModel``
(tier reload bandwidths, prefill rate) at the real model's KV size::

    a chunk's copy = chunk_tokens * kv_bytes_per_token / bandwidth(tier)
    load_s      = the loaded chunks' copies, one after another, each also waiting
                  for the copies ahead of it on its tier's link (``replay.links``)
    recompute_s = recomputed_tokens / recompute_tokens_per_s
    TTFT        = load_s + recompute_s          (loads and prefill do not overlap)
    GPU-seconds = the sum of TTFTs: the GPU waits for loads and computes the rest

Prefill is modeled linear in the recomputed tokens (the anchor is a 10k-token
prefix in 572 ms); attention makes long prefixes somewhat dearer per token,
which only widens the gap between a hit and a miss. Decode is the same under
every policy and is left out, except that it decides when a request ends
(``decode_tokens_per_s``), hence when its session goes idle.

Capacities are counted in chunk slots: ``--hbm-gb X`` holds
``X * 1e9 // (chunk_tokens * kv_bytes_per_token)`` chunks (596 for 40 GB of
Llama-3.1-8B 512-token chunks), and each tier's ``capacity_bytes`` is sized so
that it holds exactly that many stand-in blocks: an arena block takes one
4 KiB page; LMDB and Redis count value lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.block import HEADER_BYTES
from kvstore.keys import KVLayout
from kvstore.kinds import TierKind
from kvstore.store.config import CostModel
from kvstore.tiers.extents import PAGE_BYTES, round_up

LLAMA_8B_KV_BYTES_PER_TOKEN = 131072
"""Llama-3.1-8B, bf16: 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes."""

DECODE_TOKENS_PER_S = 40.0
"""Per-stream decode speed of an 8B model in a busy batch; only sets when a request ends."""

GB = 10**9


def stand_in_layout(chunk_tokens: int) -> KVLayout:
    """One byte of K and one of V per token: ``(1, 2, chunk_tokens, 1, 1)`` uint8, 1 KiB
    per 512-token chunk."""
    return KVLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        dtype="uint8",
        chunk_tokens=chunk_tokens,
        name="replay-stand-in",
    )


@dataclass(frozen=True)
class Sizing:
    """Tier sizes of one replay, in GB of the modeled model's KV (``None``: no such tier)."""

    hbm_gb: float | None
    dram_gb: float | None
    ssd_gb: float | None
    redis_gb: float | None = None

    def gb(self, kind: TierKind) -> float | None:
        return {
            TierKind.HBM: self.hbm_gb,
            TierKind.DRAM: self.dram_gb,
            TierKind.SSD: self.ssd_gb,
            TierKind.REDIS: self.redis_gb,
        }[kind]

    def slots(self, kind: TierKind, chunk_tokens: int, kv_bytes_per_token: int) -> int:
        """Chunks tier ``kind`` holds (0 when it is absent)."""
        gb = self.gb(kind)
        if not gb:
            return 0
        return int(gb * GB // (chunk_tokens * kv_bytes_per_token))


def stand_in_capacity(kind: TierKind, slots: int, layout: KVLayout) -> int:
    """``capacity_bytes`` under which tier ``kind`` holds exactly ``slots`` stand-in blocks."""
    block = HEADER_BYTES + layout.chunk_nbytes
    if kind in (TierKind.HBM, TierKind.DRAM):
        return slots * round_up(block, PAGE_BYTES)
    return slots * block


class CostMeter:
    """``CostModel`` at a fixed chunk size and KV size: the cost of each request."""

    def __init__(self, costs: CostModel, chunk_tokens: int, kv_bytes_per_token: int) -> None:
        self.costs = costs
        self.chunk_tokens = chunk_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self._chunk_load_s = {
            kind: costs.load_seconds(kind, chunk_tokens, kv_bytes_per_token) for kind in TierKind
        }

    def load_run(self, tiers: Sequence[TierKind]) -> int:
        """Leading chunks worth loading (as ``TieredStore.lookup`` answers)."""
        return self.costs.load_run(tiers, self.chunk_tokens, self.kv_bytes_per_token)

    def chunk_load_seconds(self, kind: TierKind) -> float:
        """Loading one chunk from tier ``kind``."""
        return self._chunk_load_s[kind]

    def recompute_seconds(self, tokens: int) -> float:
        return self.costs.recompute_seconds(tokens)

    @property
    def chunk_bytes(self) -> int:
        """Modeled bytes of one chunk of KV (not the stand-in's)."""
        return self.chunk_tokens * self.kv_bytes_per_token
