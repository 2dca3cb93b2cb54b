"""Placement policies on hand-built scenarios over a real store: which tier holds what, when."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from support import kv
from support.sessions import Sessions, StepForecast, opened

from kvstore import TierKind
from kvstore.keys import external_keys
from kvstore.predictor.learning.model import DEFAULT_HORIZONS
from kvstore.predictor.learning.online import ReturnForecast
from kvstore.predictor.placement.baselines import LRUBaseline, TTLPolicy
from kvstore.predictor.placement.decisions import Action
from kvstore.predictor.placement.policy import (
    PlacementConfig,
    PlacementPolicy,
    PrefetchStats,
    perfect_forecast,
)
from kvstore.predictor.placement.prefetching import LinkBudget
from kvstore.store.config import CostModel
from kvstore.store.tiered_store import TieredStore

HBM, DRAM, SSD = TierKind.HBM, TierKind.DRAM, TierKind.SSD


def forecast(session: str, at: float, *probabilities: float) -> ReturnForecast:
    return ReturnForecast(session, at, DEFAULT_HORIZONS, tuple(probabilities))


def test_a_likely_soon_return_stays_hot(three_tiers: Sessions) -> None:
    run = three_tiers
    state = run.request("a", 0, 3, now=0.0)
    placed = run.policy.on_idle(run.store, state, forecast("a", 1.0, 0.9, 0.95, 0.99), 1.0)
    assert placed is HBM
    for now in (11.0, 21.0, 31.0, 41.0):
        run.policy.tick(run.store, now)
    assert run.where(0, 3) == [HBM] * 3
    # Copied down at idle: when someone needs the HBM, evicting it writes nothing.
    assert run.store.write_back(run.ns, run.keys(0, 3), to=DRAM) == 0


def test_a_likely_long_gap_is_demoted_at_once(three_tiers: Sessions) -> None:
    run = three_tiers
    run.busy(5)
    state = run.request("a", 0, 3, now=0.0)  # HBM is full now
    placed = run.policy.on_idle(run.store, state, forecast("a", 1.0, 0.05, 0.2, 0.4), 1.0)
    # Unlikely back within the hour: no target tier at all; HBM is full of a running
    # request, so the chain goes, and DRAM, which has room, keeps it.
    assert placed is DRAM
    assert run.where(0, 3) == [DRAM] * 3
    assert run.where(5000, 5) == [HBM] * 5
    assert run.policy.demoted == 3


def test_with_room_to_spare_an_idle_chain_stays(three_tiers: Sessions) -> None:
    run = three_tiers
    state = run.request("a", 0, 3, now=0.0)
    placed = run.policy.on_idle(run.store, state, forecast("a", 1.0, 0.05, 0.2, 0.4), 1.0)
    assert placed is HBM  # nobody needs the space yet
    assert run.where(0, 3) == [HBM] * 3


def test_under_pressure_the_chain_goes_below_a_tier_it_cannot_beat(tmp_path: Path) -> None:
    run = opened(PlacementPolicy(), kv.hbm(8), kv.dram(3), kv.ssd(tmp_path / "lmdb"))
    with run.store as store:
        run.busy(5)
        likely = run.request("likely", 0, 3, now=0.0)
        run.policy.on_idle(store, likely, forecast("likely", 1.0, 0.2, 0.9, 0.95), 1.0)
        assert run.where(0, 3) == [DRAM] * 3  # DRAM is full now
        unlikely = run.request("unlikely", 1000, 3, now=2.0)
        placed = run.policy.on_idle(store, unlikely, forecast("unlikely", 3.0, 0.1, 0.3, 0.9), 3.0)
        assert placed is SSD
        assert run.where(1000, 3) == [SSD] * 3
        assert run.where(0, 3) == [DRAM] * 3


def test_a_resume_prefetches_the_chain_before_its_lookup(three_tiers: Sessions) -> None:
    run = three_tiers
    run.busy(5)
    state = run.request("a", 0, 3, now=0.0)
    run.policy.on_idle(run.store, state, forecast("a", 1.0, 0.05, 0.2, 0.4), 1.0)
    assert run.where(0, 3) == [DRAM] * 3
    run.policy.on_resume(run.store, state, 500.0)
    assert run.where(0, 3) == [HBM] * 3  # the running request lost its tail to make room
    assert run.policy.prefetches.issued == 3
    assert run.store.lookup(run.ns, kv.tokens(3)).tiers == (HBM,) * 3
    run.store.get(run.ns, run.keys(0, 3))
    assert (run.policy.prefetches.used, run.policy.prefetches.wasted) == (3, 0)


def test_a_deferred_prefetch_moves_nothing_until_its_plan_is_run(tmp_path: Path) -> None:
    """The daemon's mode: the hook, under the store's lock, only plans; the chain moves
    and counts as prefetched when the caller runs the plan, after letting go."""
    policy = PlacementPolicy(
        PlacementConfig(check_min_s=10.0, check_fraction=0.0), defer_prefetches=True
    )
    run = opened(policy, kv.hbm(8), kv.dram(8), kv.ssd(tmp_path / "lmdb"))
    with run.store:
        run.busy(5)
        state = run.request("a", 0, 3, now=0.0)
        policy.on_idle(run.store, state, forecast("a", 1.0, 0.05, 0.2, 0.4), 1.0)
        assert run.where(0, 3) == [DRAM] * 3
        with run.store.locked():
            policy.on_resume(run.store, state, 500.0)
            (plan,) = policy.take_prefetches()
        assert policy.take_prefetches() == []
        assert run.where(0, 3) == [DRAM] * 3 and policy.prefetches.issued == 0
        assert (plan.keys, plan.to, plan.planned_at) == (tuple(run.keys(0, 3)), HBM, 500.0)
        assert [d.action for d in policy.decisions.latest("a", limit=2)] == [
            Action.PREFETCH_PLANNED,  # logged as it was planned ...
            Action.WRITE_DOWN,
        ]
        policy.prefetch(run.store, plan)
        assert run.where(0, 3) == [HBM] * 3 and policy.prefetches.issued == 3
    ran, planned = policy.decisions.latest("a", limit=2)  # ... and again as it ran
    assert (ran.action, ran.source, ran.to, ran.chunks) == (Action.PREFETCH, DRAM, HBM, 3)
    assert plan.decision == planned and (ran.why, ran.at) == (planned.why, 500.0)


def test_a_rising_probability_prefetches_ahead_of_the_return(three_tiers: Sessions) -> None:
    run = three_tiers
    run.busy(5)
    state = run.request("a", 0, 3, now=0.0)
    placed = run.policy.on_idle(run.store, state, StepForecast("a", 1.0, after=300.0), 1.0)
    assert placed is DRAM  # back in 300 s: within ten minutes, not within one
    busy = run.tracker.get("busy")
    assert busy is not None
    run.policy.on_idle(run.store, busy, forecast("busy", 2.0, 0.9, 0.95, 0.99), 2.0)
    now = 1.0
    while now < 230.0:
        now += 10.0
        run.policy.tick(run.store, now)
    assert run.where(0, 3) == [DRAM] * 3
    run.policy.tick(run.store, 251.0)  # now back within a minute, and HBM has room
    assert run.where(0, 3) == [HBM] * 3
    assert run.policy.prefetches.issued == 3


@pytest.mark.parametrize("margin", [0.25, 10.0])
def test_a_chain_that_comes_to_outrank_a_resident_is_promoted(
    tmp_path: Path, margin: float
) -> None:
    """Chances fall at different rates as sessions idle: a chain put on SSD at idle, when
    DRAM's residents were likelier back, is brought up once it is likelier than the next
    of them by the margin, and that one goes down in its place. With a margin it cannot
    beat, nothing trades places."""
    policy = PlacementPolicy(PlacementConfig(promote_margin=margin))
    run = opened(policy, kv.hbm(8), kv.dram(6), kv.ssd(tmp_path / "lmdb"))
    with run.store as store:
        run.busy(5)
        for i, name in enumerate(["early", "late"]):  # likely back within a minute, or never
            state = run.request(name, 100 * i, 3, now=float(i))
            policy.on_idle(store, state, forecast(name, i + 1.0, 0.6, 0.7, 0.75), i + 1.0)
        slow = run.request("slow", 1000, 3, now=2.0)  # back in minutes to an hour
        policy.on_idle(store, slow, forecast("slow", 3.0, 0.05, 0.3, 0.9), 3.0)
        assert run.where(0, 3) + run.where(100, 3) == [DRAM] * 6
        assert run.where(1000, 3) == [SSD] * 3
        now = 3.0
        while now < 600.0 and run.where(1000, 3) != [DRAM] * 3:
            now += 10.0
            policy.tick(store, now)
        if margin > 1.0:
            assert run.where(1000, 3) == [SSD] * 3
            assert run.where(0, 3) + run.where(100, 3) == [DRAM] * 6
            return
        assert now < 200.0 and run.where(1000, 3) == [DRAM] * 3
        assert run.where(0, 3) == [SSD] * 3  # the resident touched least recently
        assert run.where(100, 3) == [DRAM] * 3
        ran, _ = policy.decisions.latest("slow", limit=2)
        assert (ran.action, ran.source, ran.to, ran.chunks) == (Action.PREFETCH, SSD, DRAM, 3)
        assert ran.why.p is not None and ran.why.rival is not None
        assert ran.why.p > (1 + margin) * ran.why.rival


def test_without_hbm_a_chain_pushed_to_ssd_comes_back_once_dram_has_room(
    tmp_path: Path,
) -> None:
    """The daemon's store (DRAM and LMDB): DRAM is its fastest tier and the engine's
    HBM none of its own, so a chain another session pushed down is read back into DRAM
    as soon as there is room, before its session asks for it."""
    policy = PlacementPolicy()
    run = opened(policy, kv.dram(6), kv.ssd(tmp_path / "lmdb"))
    with run.store as store:
        a = run.request("a", 0, 3, now=0.0)
        policy.on_idle(store, a, forecast("a", 1.0, 0.05, 0.3, 0.9), 1.0)
        b = run.request("b", 100, 6, now=2.0)  # fills DRAM: a's chain goes to LMDB
        assert run.where(0, 3) == [SSD] * 3
        store.delete(run.ns, run.keys(100, 6))
        policy.on_idle(store, b, forecast("b", 3.0, 0.6, 0.7, 0.75), 3.0)
        for now in (13.0, 23.0, 33.0):
            policy.tick(store, now)
        assert run.where(0, 3) == [DRAM] * 3
        ran = policy.decisions.latest("a", limit=1)[0]
        assert (ran.action, ran.source, ran.to, ran.chunks) == (Action.PREFETCH, SSD, DRAM, 3)


def test_victims_go_by_predicted_return_not_recency(tmp_path: Path) -> None:
    run = opened(PlacementPolicy(), kv.dram(6), kv.ssd(tmp_path / "lmdb"))
    with run.store as store:
        likely = run.request("likely", 0, 2, now=0.0)
        run.policy.on_idle(store, likely, forecast("likely", 1.0, 0.6, 0.7, 0.8), 1.0)
        later = run.request("later", 1000, 2, now=2.0)  # touched last, but less likely back
        run.policy.on_idle(store, later, forecast("later", 3.0, 0.52, 0.55, 0.6), 3.0)
        run.request("new", 2000, 3, now=4.0)  # needs one slot more than is free
        assert run.where(1000, 2) == [DRAM, SSD]  # the tail of the least likely chain
        assert run.where(0, 2) == [DRAM, DRAM]
        assert run.where(2000, 3) == [DRAM] * 3


def test_lru_would_have_evicted_the_older_chain(tmp_path: Path) -> None:
    run = opened(LRUBaseline(), kv.dram(6), kv.ssd(tmp_path / "lmdb"))
    with run.store:
        run.request("likely", 0, 2, now=0.0)
        run.request("later", 1000, 2, now=2.0)
        run.request("new", 2000, 3, now=4.0)
        assert run.where(0, 2) == [DRAM, SSD]


def test_a_shared_prefix_stays_with_its_last_user(three_tiers: Sessions) -> None:
    run = three_tiers
    run.busy(5)
    a = run.request("a", 0, 3, now=0.0)
    run.request("b", 0, 2, now=2.0)  # b's prompt is a's first two chunks: b owns them now
    run.policy.on_idle(run.store, a, forecast("a", 3.0, 0.05, 0.2, 0.4), 3.0)
    assert run.where(0, 3) == [HBM, HBM, DRAM]


@pytest.mark.parametrize("told", [False, True])
def test_blocks_put_with_no_session_are_its_own_to_place_once_its_event_says_so(
    three_tiers: Sessions, told: bool
) -> None:
    run = three_tiers
    run.busy(5)
    state = run.request("a", 0, 3, now=0.0, named=False)  # HBM is full now
    if told:  # the daemon, from the chain its request_finished carried
        run.policy.touch("a", state.chain)
    run.policy.on_idle(run.store, state, forecast("a", 1.0, 0.05, 0.2, 0.4), 1.0)
    assert run.where(0, 3) == [DRAM if told else HBM] * 3


def test_ttl_demotes_what_nobody_touched_for_the_timeout(tmp_path: Path) -> None:
    policy = TTLPolicy(60.0)
    run = opened(policy, kv.hbm(8), kv.dram(8), kv.ssd(tmp_path / "lmdb"))
    with run.store as store:
        a = run.request("a", 0, 3, now=0.0)
        assert policy.on_idle(store, a, None, 1.0) is HBM
        policy.tick(store, 40.0)
        assert run.where(0, 3) == [HBM] * 3
        run.request("b", 0, 1, now=45.0)  # b keeps the head in use
        policy.tick(store, 61.0)
        assert run.where(0, 3) == [HBM, DRAM, DRAM]


def test_perfect_forecast_is_a_perfect_classifier_at_the_horizons() -> None:
    soon = perfect_forecast("s", 0.0, 100.0, DEFAULT_HORIZONS)
    assert soon.probabilities == (0.0, 1.0, 1.0)
    assert (soon.within(60.0), soon.within(600.0), soon.within(1e6)) == (0.0, 1.0, 1.0)
    assert 0.0 < soon.within(300.0) < 1.0  # read between horizons as a learnt one is
    never = perfect_forecast("s", 0.0, float("inf"), DEFAULT_HORIZONS)
    assert never.probabilities == (0.0, 0.0, 0.0)


def test_a_prefetch_names_its_copies_in_order_with_their_source_and_route(
    three_tiers: Sessions,
) -> None:
    run = three_tiers
    run.busy(5)
    state = run.request("a", 0, 3, now=0.0)
    run.policy.on_idle(run.store, state, forecast("a", 1.0, 0.05, 0.2, 0.4), 1.0)
    assert run.where(0, 3) == [DRAM] * 3
    heard: list[tuple[list[tuple[object, TierKind]], float]] = []
    run.policy.prefetches.listener = lambda copies, at: heard.append((list(copies), at))
    run.policy.on_resume(run.store, state, 500.0)
    assert run.where(0, 3) == [HBM] * 3  # the store moved them at once; the replay times them
    assert heard == [([(key, DRAM) for key in run.keys(0, 3)], 500.0)]
    assert run.policy.prefetches.routes == {(DRAM, HBM): 3}
    assert run.policy.prefetches.issued == 3


def test_prefetch_stats_count_routes_without_a_listener() -> None:
    stats = PrefetchStats()
    a, b, c = external_keys(kv.namespace(), [b"a", b"b", b"c"])
    stats.copied([(a, SSD), (b, SSD)], DRAM, 10.0)
    stats.copied([(c, DRAM)], HBM, 11.0)
    stats.copied([], HBM, 12.0)
    assert stats.routes == {(SSD, DRAM): 2, (DRAM, HBM): 1}
    assert stats.to_dict() == {"issued": 3, "used": 0, "wasted": 0, "pending": 3}


def test_the_last_session_to_touch_a_shared_prefix_does_not_take_it_down(
    three_tiers: Sessions,
) -> None:
    """a touched the shared prefix last, so owns it; it goes idle unlikely back while b,
    likely back, still holds the chain extending the prefix in HBM. a's own block goes;
    the prefix stays with b's."""
    run = three_tiers
    b = run.request("b", 1000, 1, now=0.0, shared=2)
    run.policy.on_idle(run.store, b, forecast("b", 1.0, 0.9, 0.95, 0.99), 1.0)
    a = run.request("a", 2000, 1, now=5.0, shared=2)
    run.policy.on_idle(run.store, a, forecast("a", 6.0, 0.01, 0.02, 0.05), 6.0)
    assert run.policy.owned("a")[HBM] == 3  # the prefix is a's: it touched it last
    run.busy(5)  # one of the four idle blocks must go: a's own
    run.policy.tick(run.store, 20.0)
    prefix = run.shared_keys(2)
    assert run.store.locate(run.ns, prefix) == [HBM, HBM]
    assert run.store.locate(run.ns, b.chain) == [HBM] * 3
    assert run.store.locate(run.ns, a.chain[2:]) == [DRAM]


def test_a_forecast_made_again_re_places_the_idle_chain(three_tiers: Sessions) -> None:
    run = three_tiers
    run.busy(5)
    state = run.request("a", 0, 3, now=0.0)  # HBM is full now
    placed = run.policy.on_idle(run.store, state, forecast("a", 1.0, 0.9, 0.95, 0.99), 1.0)
    assert placed is HBM
    # Its user started another session: hardly anyone comes back to the old one.
    run.policy.on_forecast(run.store, state, forecast("a", 30.0, 0.01, 0.02, 0.03), 30.0)
    assert run.where(0, 3) == [DRAM] * 3
    # Read from when it was made: at 60 s the new forecast's first minute is not over.
    run.policy.on_forecast(run.store, state, forecast("a", 60.0, 0.9, 0.95, 0.99), 60.0)
    assert run.where(0, 3) == [HBM] * 3  # expected back after all: prefetched


def test_a_forecast_for_a_session_that_is_not_idle_changes_nothing(
    three_tiers: Sessions,
) -> None:
    run = three_tiers
    run.busy(5)
    busy = run.tracker.get("busy")  # the policy heard it start, never go idle
    assert busy is not None
    run.policy.on_forecast(run.store, busy, forecast("busy", 5.0, 0.0, 0.0, 0.0), 5.0)
    assert run.where(5000, 5) == [HBM] * 5


def test_the_baselines_read_no_forecast(tmp_path: Path) -> None:
    run = opened(TTLPolicy(60.0), kv.hbm(8), kv.dram(8), kv.ssd(tmp_path / "lmdb"))
    with run.store as store:
        state = run.request("a", 0, 3, now=0.0)
        run.policy.on_idle(store, state, None, 1.0)
        run.policy.on_forecast(store, state, forecast("a", 5.0, 0.0, 0.0, 0.0), 5.0)
        assert run.where(0, 3) == [HBM] * 3


def test_the_link_budget_lets_speculative_copies_take_only_their_share() -> None:
    budget = LinkBudget(share=0.1, burst_s=10.0)  # at most 1 s of link banked
    assert budget.spend({SSD: 3.0}, 0.0)  # a whole chain goes, into debt
    assert not budget.spend({SSD: 0.1}, 10.0)  # 1 s repaid of 2 owed
    assert budget.spend({DRAM: 0.5}, 10.0)  # another tier's link is its own
    assert not budget.spend({DRAM: 0.1, SSD: 0.1}, 15.0)  # SSD still owes: neither spends
    assert budget.spend({SSD: 0.1}, 40.0) and budget.refused == 2


def test_promotions_while_nobody_waits_keep_to_the_links_budget(tmp_path: Path) -> None:
    """Two chains pushed to LMDB, DRAM with room for both: at a modeled 0.5 s a chunk from
    SSD and a budget of 1% of the link, the first chain comes up and spends the next 140 s
    of budget; the second waits for it. A resume's prefetch spends nothing."""
    costs = CostModel(kv_bytes_per_token=2_500_000_000 // kv.LAYOUT.chunk_tokens)
    config = dataclasses.replace(
        kv.config(kv.dram(8), kv.ssd(tmp_path / "lmdb", 256 << 20)), costs=costs
    )
    policy = PlacementPolicy(PlacementConfig(speculative_link_share=0.01))
    run = Sessions(TieredStore(config, policy=policy), policy)
    with run.store as store:
        run.pushed_down({"a": 0, "b": 100}, 3, (0.05, 0.3, 0.9), to=SSD)
        run.busy(1)  # DRAM holds something: its size in blocks is known
        for now in (20.0, 40.0):
            policy.tick(store, now)
        assert sorted([run.where(0, 3), run.where(100, 3)]) == [[DRAM] * 3, [SSD] * 3]
        assert policy.link_budget.refused >= 1
        for now in range(60, 700, 20):
            policy.tick(store, float(now))
        assert run.where(0, 3) == run.where(100, 3) == [DRAM] * 3
