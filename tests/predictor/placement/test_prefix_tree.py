"""``PrefixTree``: which held blocks are leaves in each tier, as chains come and go."""

from __future__ import annotations

from kvstore.keys import ChunkKey, Namespace, external_keys
from kvstore.predictor.placement.prefix_tree import PrefixTree
from kvstore.predictor.replay.costs import stand_in_layout
from kvstore.tiers.kinds import TierKind

HBM, DRAM = TierKind.HBM, TierKind.DRAM
# root <- shared <- (a1 <- a2) and (b1): two chains extending one shared prefix
ROOT, SHARED, A1, A2, B1 = external_keys(Namespace("tree", stand_in_layout(16)), list(range(5)))


def _tree(held: dict[TierKind, set[ChunkKey]]) -> PrefixTree:
    tree = PrefixTree()
    tree.learn([ROOT, SHARED, A1, A2], held)
    tree.learn([ROOT, SHARED, B1], held)
    return tree


def test_only_leaves_are_offered_and_a_walk_can_free_a_whole_chain() -> None:
    held = {HBM: {ROOT, SHARED, A1, A2, B1}}
    tree = _tree(held)
    # Offered in the order given, a parent follows once every child of it went before.
    assert list(tree.leaves(HBM, [SHARED, A2, A1, B1, SHARED, ROOT])) == [A2, A1, B1, SHARED, ROOT]
    # A walk that never offers B1 keeps the shared prefix it extends.
    assert list(tree.leaves(HBM, [A2, A1, SHARED, ROOT])) == [A2, A1]


def test_children_are_counted_per_tier_as_blocks_enter_and_leave() -> None:
    tree = _tree({})  # parents learnt before anything is held
    for key in (ROOT, SHARED, A1):
        tree.entered(HBM, key)
    tree.entered(DRAM, A2)
    assert list(tree.leaves(HBM, [SHARED, ROOT, A1])) == [A1]
    assert list(tree.leaves(DRAM, [A2])) == [A2]  # its parent is not in DRAM
    tree.left(HBM, A1)
    assert list(tree.leaves(HBM, [SHARED, ROOT])) == [SHARED, ROOT]
    tree.entered(HBM, A1)
    tree.entered(HBM, A1)  # entering twice counts once
    tree.left(HBM, A1)
    assert list(tree.leaves(HBM, [SHARED])) == [SHARED]


def test_a_forgotten_block_entering_again_has_no_parent_until_learnt_again() -> None:
    tree = _tree({})
    tree.forget(A1)
    tree.entered(HBM, SHARED)
    tree.entered(HBM, A1)
    assert list(tree.leaves(HBM, [SHARED])) == [SHARED]
    tree.left(HBM, A1)
    tree.learn([ROOT, SHARED, A1], {HBM: {A1}})
    assert list(tree.leaves(HBM, [SHARED])) == []
