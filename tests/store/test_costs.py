"""Reload against recompute (``CostModel``, ``CachedPrefix.load_chunks``) and ``demote(to=)``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support import kv

from kvstore import TieredStore, TierKind
from kvstore.errors import ConfigError
from kvstore.store.config import CostModel, StoreConfig

HBM, DRAM, SSD, REDIS = TierKind.HBM, TierKind.DRAM, TierKind.SSD, TierKind.REDIS
LLAMA_8B = 131072  # KV bytes per token, Llama-3.1-8B bf16


def test_default_costs_load_memory_and_ssd_but_recompute_rather_than_read_redis() -> None:
    costs = CostModel()
    assert [costs.worth_loading(kind, LLAMA_8B) for kind in (HBM, DRAM, SSD, REDIS)] == [
        True,
        True,
        True,
        False,
    ]
    # 512 tokens from DRAM: 64 MiB at 50 GB/s; recomputing them: 512 / 17.5K tokens/s.
    assert costs.load_seconds(DRAM, 512, LLAMA_8B) == pytest.approx(512 * LLAMA_8B / 50e9)
    assert costs.recompute_seconds(512) == pytest.approx(512 / 17_500)


def test_load_run_cuts_where_loading_stops_paying() -> None:
    costs = CostModel()
    assert costs.load_run([DRAM, DRAM, REDIS, REDIS], 512, LLAMA_8B) == 2
    assert costs.load_run([REDIS, REDIS], 512, LLAMA_8B) == 0
    # One slow chunk is worth loading to reach the fast ones behind it: a cached
    # prefix is loaded as a prefix.
    assert costs.load_run([REDIS, DRAM, DRAM, DRAM], 512, LLAMA_8B) == 4
    assert costs.load_run([], 512, LLAMA_8B) == 0


def test_costs_from_toml_table(tmp_path: Path) -> None:
    config = StoreConfig.from_mapping(
        {"costs": {"recompute_tokens_per_s": 20000, "ssd_bytes_per_s": "7GB"}}, data_dir=tmp_path
    )
    assert config.costs.recompute_tokens_per_s == 20000
    assert config.costs.bytes_per_s(TierKind.SSD) == 7e9
    assert config.costs.bytes_per_s(TierKind.DRAM) == CostModel().bytes_per_s(TierKind.DRAM)
    with pytest.raises(ConfigError):
        StoreConfig.from_mapping({"costs": {"ssd_gbps": 7}}, data_dir=tmp_path)
    with pytest.raises(ConfigError):
        CostModel(recompute_tokens_per_s=0)


def slow_ssd_store(tmp_path: Path) -> TieredStore:
    """DRAM over an SSD that reloads slower than recomputing (1 GB/s at 128 KiB/token)."""
    costs = CostModel(reload_bytes_per_s={TierKind.SSD: 1e9}, kv_bytes_per_token=LLAMA_8B)
    config = StoreConfig(tiers=(kv.dram(2), kv.ssd(tmp_path / "lmdb")), costs=costs)
    return TieredStore(config)


def test_lookup_says_which_cached_chunks_to_load(tmp_path: Path) -> None:
    with slow_ssd_store(tmp_path) as store:
        ns = kv.namespace()
        store.put(ns, kv.tokens(4), kv.chunks(4))  # DRAM holds 2: the tail spilled to SSD
        prefix = store.lookup(ns, kv.tokens(4))
        assert prefix.tiers == (DRAM, DRAM, SSD, SSD)
        assert prefix.num_chunks == 4
        assert (prefix.load_chunks, prefix.load_tokens) == (2, 2 * kv.LAYOUT.chunk_tokens)
        keys = list(prefix.keys)
        store.demote(ns, keys[:2], to=SSD)
        prefix = store.lookup(ns, kv.tokens(4))
        assert prefix.tiers == (SSD,) * 4
        assert (prefix.load_chunks, prefix.load_tokens) == (0, 0)


def test_put_stores_again_what_was_only_held_where_recomputing_wins(tmp_path: Path) -> None:
    with slow_ssd_store(tmp_path) as store:
        ns = kv.namespace()
        store.put(ns, kv.tokens(2), kv.chunks(2))
        keys = store.keys_for(ns, kv.tokens(2))
        store.demote(ns, keys, to=SSD)
        # The engine recomputed both (load_chunks == 0) and hands them back.
        assert store.put(ns, kv.tokens(2), kv.chunks(2)) == 2
        assert store.locate(ns, keys) == [DRAM, DRAM]
        # Held in DRAM now, so a third put is a no-op as usual.
        assert store.put(ns, kv.tokens(2), kv.chunks(2)) == 0


@pytest.fixture
def three_level(tmp_path: Path):
    config = kv.config(kv.hbm(4), kv.dram(4), kv.ssd(tmp_path / "lmdb"))
    with TieredStore(config) as store:
        yield store


def test_demote_to_moves_out_of_every_faster_tier(three_level: TieredStore) -> None:
    store = three_level
    ns = kv.namespace()
    store.put(ns, kv.tokens(3), kv.chunks(3))
    keys = store.keys_for(ns, kv.tokens(3))
    assert store.locate(ns, keys) == [HBM] * 3
    assert store.demote(ns, keys[:1], to=DRAM) == 1
    store.promote(ns, keys[:1], to=HBM)  # HBM and DRAM both hold key 0 now
    assert store.demote(ns, keys, to=SSD) == 3
    assert store.locate(ns, keys) == [SSD] * 3
    stats = store.stats()
    assert (stats.tier(HBM).blocks, stats.tier(DRAM).blocks, stats.tier(SSD).blocks) == (0, 0, 3)
    # Already there: nothing moves, nothing counts.
    assert store.demote(ns, keys, to=DRAM) == 0
    assert store.demote(ns, keys, to=SSD) == 0
    assert store.get(ns, keys)[2] is not None


def test_demote_to_skips_pinned_and_drops_below_the_last_tier(three_level: TieredStore) -> None:
    store = three_level
    ns = kv.namespace()
    store.put(ns, kv.tokens(2), kv.chunks(2))
    keys = store.keys_for(ns, kv.tokens(2))
    store.pin(ns, keys[:1])
    assert store.demote(ns, keys, to=SSD) == 1
    assert store.locate(ns, keys) == [HBM, SSD]
    store.unpin(ns, keys[:1])
    assert store.demote(ns, keys, to=REDIS) == 2  # no Redis configured: dropped
    assert store.locate(ns, keys) == [None, None]


def test_demote_leaves_only_keeps_the_prefix_another_chain_extends(
    three_level: TieredStore,
) -> None:
    store = three_level
    ns = kv.namespace()
    prefix = kv.tokens(2)
    a = np.concatenate([prefix, kv.tokens(1, start=1000)])
    b = np.concatenate([prefix, kv.tokens(1, start=2000)])
    store.put(ns, a, kv.chunks(3), session="a")
    store.put(ns, b, kv.chunks(3), session="b")
    a_keys, b_keys = store.keys_for(ns, a), store.keys_for(ns, b)
    # a's chain goes to SSD; the prefix stays where b's chain still extends it.
    assert store.demote(ns, a_keys, to=SSD, leaves_only=True) == 1
    assert store.locate(ns, a_keys) == [HBM, HBM, SSD]
    assert store.locate(ns, b_keys) == [HBM] * 3
    # Once b's own block has gone down, the prefix is nobody else's and follows.
    assert store.demote(ns, b_keys[2:], to=DRAM, leaves_only=True) == 1
    assert store.demote(ns, a_keys, to=SSD, leaves_only=True) == 2
    assert store.locate(ns, a_keys) == [SSD] * 3
    # Without leaves_only, a move takes what it is given.
    store.promote(ns, b_keys, to=HBM)
    assert store.demote(ns, b_keys[:2], to=DRAM) == 2
