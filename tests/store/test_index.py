"""``BlockIndex``: the store's record of which tiers hold each chunk, its parent and pins.

Placement, lookups and deferred deletes all trust it, so each operation is checked exactly.
"""

from __future__ import annotations

from support import kv

from kvstore.keys import ChunkKey, chunk_keys
from kvstore.kinds import TierKind
from kvstore.store.index import BlockIndex, BlockMeta

HBM, DRAM, SSD, REDIS = TierKind.HBM, TierKind.DRAM, TierKind.SSD, TierKind.REDIS
NS = kv.namespace()
OTHER = kv.namespace(salt="other-tenant")
A, B, C, D = chunk_keys(NS, kv.tokens(4))


def test_record_creates_an_entry_with_namespace_parent_size_and_session() -> None:
    index = BlockIndex()
    meta = index.record(DRAM, B, NS.digest, A, 2176, session="s1")
    assert index.get(B) is meta
    assert meta == BlockMeta(NS.digest, A, {DRAM: 2176}, pins=0, session="s1", deleted=False)
    assert B in index and A not in index
    assert index.get(A) is None


def test_record_adds_a_tier_and_keeps_size_per_tier_and_the_fastest() -> None:
    index = BlockIndex()
    index.record(SSD, B, NS.digest, A, 900)
    meta = index.record(DRAM, B, NS.digest, A, 2176)
    assert meta.sizes == {SSD: 900, DRAM: 2176}
    assert meta.fastest is DRAM
    index.record(HBM, B, NS.digest, A, 2176)
    assert meta.fastest is HBM
    assert index.fastest([A, B, C]) == [None, HBM, None]
    assert BlockMeta(NS.digest, None).fastest is None
    assert BlockMeta(NS.digest, None, {SSD: 900, DRAM: 2176}).fastest is DRAM


def test_record_fills_a_missing_parent_but_never_replaces_a_known_one() -> None:
    index = BlockIndex()
    index.record(SSD, C, NS.digest, None, 2176)
    assert index.record(DRAM, C, NS.digest, B, 2176).parent == B
    assert index.record(HBM, C, NS.digest, A, 2176).parent == B
    assert index.record(HBM, C, NS.digest, None, 2176).parent == B


def test_record_without_session_keeps_the_last_writer() -> None:
    index = BlockIndex()
    index.record(DRAM, A, NS.digest, None, 2176, session="s1")
    assert index.record(SSD, A, NS.digest, None, 2176).session == "s1"
    assert index.record(SSD, A, NS.digest, None, 2176, session="s2").session == "s2"


def test_drop_forgets_one_copy_and_the_entry_with_its_last_copy() -> None:
    index = BlockIndex()
    index.record(DRAM, A, NS.digest, None, 2176)
    index.record(SSD, A, NS.digest, None, 2176)
    assert index.drop(HBM, A) is False
    assert index.drop(DRAM, A) is True
    assert index.fastest([A]) == [SSD]  # kept as copies go, for lookups without the lock
    assert index.drop(DRAM, A) is False
    assert index.get(A) == BlockMeta(NS.digest, None, {SSD: 2176})
    assert index.drop(SSD, A) is True
    assert A not in index
    assert index.drop(SSD, B) is False


def test_holds_is_exact_and_may_hold_trusts_the_index_except_for_unknown_shared_keys() -> None:
    index = BlockIndex()
    index.record(DRAM, A, NS.digest, None, 2176)
    assert index.holds(DRAM, A) and not index.holds(SSD, A) and not index.holds(REDIS, A)
    # A known key: the index is trusted for every tier, shared ones included.
    assert [index.may_hold(kind, A) for kind in (HBM, DRAM, SSD, REDIS)] == [
        False,
        True,
        False,
        False,
    ]
    # An unknown key: only a shared tier may still hold it (another process wrote it).
    assert [index.may_hold(kind, B) for kind in (HBM, DRAM, SSD, REDIS)] == [
        False,
        False,
        False,
        True,
    ]
    assert not index.holds(REDIS, B)


def test_pin_counts_known_keys_only_and_unpin_never_goes_below_zero() -> None:
    index = BlockIndex()
    index.record(DRAM, A, NS.digest, None, 2176)
    index.record(DRAM, B, NS.digest, A, 2176)
    assert index.pin([A, B, C]) == [A, B]
    assert index.pin([A]) == [A]
    meta_a, meta_b = index.get(A), index.get(B)
    assert meta_a is not None and meta_b is not None
    assert (meta_a.pins, meta_b.pins) == (2, 1)
    assert index.unpin([A, B, B, C]) == []
    assert (meta_a.pins, meta_b.pins) == (1, 0)


def test_unpin_releases_a_deleted_block_only_with_its_last_pin() -> None:
    index = BlockIndex()
    index.record(DRAM, A, NS.digest, None, 2176)
    index.record(DRAM, B, OTHER.digest, None, 2176)
    index.pin([A, A, B])
    for key in (A, B):
        meta = index.get(key)
        assert meta is not None
        meta.deleted = True
    assert index.unpin([A, B]) == [(OTHER.digest, B)]
    assert index.unpin([A]) == [(NS.digest, A)]
    # Released, not removed: removing is the caller's job (``Placement.unpin``).
    assert A in index and B in index
    assert index.unpin([A, B]) == []


def test_held_by_count_and_by_tier_report_per_tier_in_the_order_given() -> None:
    index = BlockIndex()
    index.record(DRAM, A, NS.digest, None, 2176)
    index.record(SSD, A, NS.digest, None, 2176)
    index.record(SSD, B, OTHER.digest, A, 2176)
    index.record(DRAM, C, NS.digest, B, 2176)
    assert sorted(index.held_by(SSD)) == sorted([(NS.digest, A), (OTHER.digest, B)])
    assert index.held_by(HBM) == []
    assert (index.count(DRAM), index.count(SSD), index.count(HBM)) == (2, 2, 0)
    assert index.by_tier([C, D, B, A]) == {DRAM: [C, A], SSD: [B, A]}
    assert index.by_tier([D]) == {}


def test_held_by_is_a_snapshot_safe_to_drop_while_iterating() -> None:
    index = BlockIndex()
    keys = [ChunkKey(bytes([n]) * 16) for n in range(5)]
    for key in keys:
        index.record(DRAM, key, NS.digest, None, 2176)
    for _, key in index.held_by(DRAM):
        assert index.drop(DRAM, key)
    assert index.count(DRAM) == 0 and all(key not in index for key in keys)


def test_lineage_puts_the_indexed_ancestors_of_a_chains_head_before_it() -> None:
    index = BlockIndex()
    keys = chunk_keys(NS, kv.tokens(5, start=1_000))
    for i, key in enumerate(keys):
        index.record(TierKind.DRAM, key, NS.digest, keys[i - 1] if i else None, 10)
    assert index.lineage(keys[3:5]) == keys[:5]
    assert index.lineage(keys[:2]) == keys[:2]  # a head has no ancestors
    assert index.lineage([]) == []
    index.drop(TierKind.DRAM, keys[1])  # the walk stops where no tier holds the parent
    assert index.lineage(keys[3:4]) == keys[2:4]
    unknown = chunk_keys(OTHER, kv.tokens(1))
    assert index.lineage(unknown) == unknown


# The prefix tree: root <- shared <- (a1 <- a2) and (b1), two chains extending one prefix.
ROOT, SHARED, A1, A2, B1 = chunk_keys(NS, kv.tokens(5))


def _tree(*kinds: TierKind) -> BlockIndex:
    index = BlockIndex()
    for kind in kinds:
        for key, parent in ((ROOT, None), (SHARED, ROOT), (A1, SHARED), (A2, A1), (B1, SHARED)):
            index.record(kind, key, NS.digest, parent, 64)
    return index


def test_only_leaves_are_offered_and_a_walk_can_free_a_whole_chain() -> None:
    index = _tree(HBM)
    # Offered in the order given, a parent follows once every child of it went before.
    assert list(index.leaves(HBM, [SHARED, A2, A1, B1, SHARED, ROOT])) == [A2, A1, B1, SHARED, ROOT]
    # A walk that never offers B1 keeps the shared prefix it extends.
    assert list(index.leaves(HBM, [A2, A1, SHARED, ROOT])) == [A2, A1]
    # A key the index does not know is offered: the store tells the policy it is gone.
    assert list(index.leaves(HBM, [D])) == [D]


def test_extended_names_the_prefix_a_chain_outside_the_move_still_extends() -> None:
    index = _tree(HBM)
    # Moving a's chain with the prefix it shares: the prefix stays with b1, in any order.
    assert index.extended(HBM, [ROOT, SHARED, A1, A2]) == {ROOT, SHARED}
    assert index.extended(HBM, [A2, ROOT, A1, SHARED]) == {ROOT, SHARED}
    # Both chains moving: nothing stays. A key not held there is not named.
    assert index.extended(HBM, [ROOT, SHARED, A1, A2, B1]) == set()
    assert index.extended(DRAM, [ROOT, SHARED, A1]) == set()
    # Part of a chain: its tail, outside the move, keeps the rest of it.
    assert index.extended(HBM, [ROOT, SHARED, A1]) == {ROOT, SHARED, A1}
    index.drop(HBM, B1)  # b's chain went down: the prefix is a's alone
    assert index.extended(HBM, [ROOT, SHARED, A1, A2]) == set()


def test_children_are_counted_per_tier_as_blocks_enter_and_leave() -> None:
    index = _tree(HBM)
    index.drop(HBM, A2)
    index.drop(HBM, B1)
    index.record(DRAM, A2, NS.digest, A1, 64)
    assert list(index.leaves(HBM, [SHARED, ROOT, A1])) == [A1]
    assert list(index.leaves(DRAM, [A2])) == [A2]  # its parent is not in DRAM
    index.drop(HBM, A1)
    assert list(index.leaves(HBM, [SHARED, ROOT])) == [SHARED, ROOT]
    index.record(HBM, A1, NS.digest, SHARED, 64)
    index.record(HBM, A1, NS.digest, SHARED, 64)  # recorded twice, a child once
    index.drop(HBM, A1)
    assert list(index.leaves(HBM, [SHARED])) == [SHARED]


def test_a_parent_named_later_makes_a_child_in_every_tier_holding_the_block() -> None:
    index = BlockIndex()
    index.record(HBM, SHARED, NS.digest, ROOT, 64)
    index.record(HBM, A1, NS.digest, None, 64)  # found in a shared tier: no parent known
    index.record(DRAM, A1, NS.digest, None, 64)
    assert list(index.leaves(HBM, [SHARED])) == [SHARED]
    index.record(SSD, A1, NS.digest, SHARED, 64)
    assert list(index.leaves(HBM, [SHARED])) == []
    index.drop(HBM, A1)
    assert list(index.leaves(HBM, [SHARED])) == [SHARED]
    index.drop(DRAM, A1)
    index.drop(SSD, A1)  # the entry goes with its last copy; no count is left behind
    index.record(HBM, A1, NS.digest, SHARED, 64)
    index.drop(HBM, A1)
    assert list(index.leaves(HBM, [SHARED])) == [SHARED]
