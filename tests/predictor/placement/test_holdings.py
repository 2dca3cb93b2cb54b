"""``Holdings``: whose blocks each tier holds, the order they leave in, and how long they
stay; what the policy moves itself is neither an eviction nor a stay."""

from __future__ import annotations

from kvstore.keys import ChunkKey
from kvstore.kinds import TierKind
from kvstore.predictor.placement.holdings import Holdings

HBM, DRAM = TierKind.HBM, TierKind.DRAM


def chain(name: str, length: int) -> list[ChunkKey]:
    return [ChunkKey(f"{name}{i:015d}"[:16].encode()) for i in range(length)]


def test_blocks_belong_to_the_last_session_that_touched_them() -> None:
    held = Holdings()
    a, b = chain("a", 3), chain("b", 2)
    assert held.entered(HBM, a, "a", now=0.0) == ["a"]
    assert held.entered(HBM, a[:2] + b, "b", now=1.0) == ["b"]
    assert held.owned("a") == {HBM: 1} and held.owned("b") == {HBM: 4}
    held.claim("a", a)  # a session's event names the chain: all of it is its own again
    assert held.owned("a") == {HBM: 3} and held.owned("b") == {HBM: 2}
    assert held.level("a") is HBM and held.level("c") is None


def test_unowned_blocks_go_first_then_a_sessions_blocks_tail_first() -> None:
    held = Holdings()
    a, loose = chain("a", 3), chain("x", 1)
    held.entered(HBM, a, "a", now=0.0)
    held.entered(HBM, loose, None, now=0.0)
    held.tiers[HBM].rank("a", (0.5, 0.5, 1))
    order = held.victims(HBM)
    assert [next(order), next(order)] == [loose[0], a[2]]
    assert held.pushed_out(HBM, a[2]) == "a"
    assert held.pushed_out(HBM, a[0]) is None  # not offered


def test_the_mean_stay_counts_pressure_not_the_policys_own_moves() -> None:
    held = Holdings()
    a = chain("a", 2)
    held.entered(DRAM, a, "a", now=0.0)
    with held.moving([a[1]]):
        held.left(DRAM, a[1], now=100.0)
    assert held.residence(DRAM) is None
    held.left(DRAM, a[0], now=40.0)
    assert held.residence(DRAM) == 40.0
    assert held.owned("a") == {} and held.owner(a[0]) is None  # held nowhere: forgotten


def test_the_fastest_copy_below_a_tier() -> None:
    held = Holdings()
    a = chain("a", 1)
    held.entered(HBM, a, "a", now=0.0)
    assert held.fastest_below(HBM, a[0]) is None
    held.entered(TierKind.SSD, a, "a", now=0.0)
    assert list(held.fastest_each([a[0], *chain("b", 1)])) == [HBM, None]
    assert held.fastest_below(HBM, a[0]) is TierKind.SSD
