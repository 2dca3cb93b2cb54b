"""A whole namespace at once: its usage per tier, evicted from a tier, deleted
(``TieredStore.namespace_usage``, ``evict_namespace``, ``delete_namespace``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import kv

from kvstore.errors import ConfigError, UnknownNamespace
from kvstore.kinds import TierKind
from kvstore.store.tiered_store import TieredStore

DRAM, SSD = TierKind.DRAM, TierKind.SSD


def test_usage_counts_each_namespace_per_tier(tmp_path: Path) -> None:
    mine, theirs = kv.namespace(salt="usage-a"), kv.namespace(salt="usage-b")
    with TieredStore(kv.config(kv.dram(8), kv.ssd(tmp_path / "lmdb"))) as store:
        store.put(mine, kv.tokens(3), kv.chunks(3))
        store.put(theirs, kv.tokens(1), kv.chunks(1))
        store.demote(mine, store.keys_for(mine, kv.tokens(3))[2:])
        usage = {row.digest: row for row in store.namespace_usage()}
    assert set(usage) == {mine.digest, theirs.digest}
    assert usage[mine.digest].namespace == mine
    assert {kind: blocks for kind, (blocks, _) in usage[mine.digest].tiers.items()} == {
        DRAM: 2,
        SSD: 1,
    }
    assert all(nbytes > 0 for _, nbytes in usage[mine.digest].tiers.values())
    assert store.namespace_usage()[0].digest == mine.digest  # the largest first
    row = usage[theirs.digest].to_dict()
    assert row["tiers"] == {"dram": {"blocks": 1, "bytes": usage[theirs.digest].tiers[DRAM][1]}}
    assert row["tenant_salt_sha256"] and "usage-b" not in str(row)


def test_evict_writes_back_and_leaves_pinned_blocks_and_other_namespaces(tmp_path: Path) -> None:
    mine, theirs = kv.namespace(salt="evict-a"), kv.namespace(salt="evict-b")
    with TieredStore(kv.config(kv.dram(8), kv.ssd(tmp_path / "lmdb"))) as store:
        data = kv.chunks(3)
        store.put(mine, kv.tokens(3), data)
        store.put(theirs, kv.tokens(2), kv.chunks(2))
        keys = store.keys_for(mine, kv.tokens(3))
        store.pin(mine, keys[:1])
        done = store.evict_namespace(mine.digest, DRAM)
        assert (done.evicted, done.pinned) == (2, 1)
        assert store.lookup(mine, kv.tokens(3)).tiers == (DRAM, SSD, SSD)
        assert store.lookup(theirs, kv.tokens(2)).tiers == (DRAM, DRAM)
        kv.assert_chunks_equal(store, mine, keys, data)  # moved, not lost
        assert store.evict_namespace(mine.digest, SSD).evicted == 2  # the last tier: dropped
        with pytest.raises(ConfigError, match="no redis tier"):
            store.evict_namespace(mine.digest, TierKind.REDIS)


def test_delete_removes_every_copy_and_waits_for_pins(tmp_path: Path) -> None:
    mine, theirs = kv.namespace(salt="delete-a"), kv.namespace(salt="delete-b")
    with TieredStore(kv.config(kv.dram(8), kv.ssd(tmp_path / "lmdb"))) as store:
        store.put(mine, kv.tokens(3), kv.chunks(3))
        store.put(theirs, kv.tokens(2), kv.chunks(2))
        keys = store.keys_for(mine, kv.tokens(3))
        store.write_back(mine, keys, to=SSD)  # a copy in each tier
        store.pin(mine, keys[:1])
        assert store.delete_namespace(mine.digest) == 3
        assert store.lookup(mine, kv.tokens(3)).num_chunks == 1  # pinned: readable until unpinned
        store.unpin(mine, keys[:1])
        assert store.lookup(mine, kv.tokens(3)).num_chunks == 0
        assert store.lookup(theirs, kv.tokens(2)).num_chunks == 2
        assert store.delete_namespace(mine.digest) == 0  # registered, now empty: nothing to do
        with pytest.raises(UnknownNamespace, match="holds nothing here"):
            store.delete_namespace(bytes(16))
