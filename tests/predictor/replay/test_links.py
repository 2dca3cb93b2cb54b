"""The replay's tier links: demand loads and prefetches share them, in the order issued."""

from __future__ import annotations

import pytest
from support import kv

from kvstore import TierKind
from kvstore.keys import external_keys
from kvstore.predictor.replay.links import Links

HBM, DRAM, SSD, REDIS = TierKind.HBM, TierKind.DRAM, TierKind.SSD, TierKind.REDIS
SECONDS = {HBM: 0.001, DRAM: 0.5, SSD: 2.0, REDIS: 4.0}


def keys(*names: str) -> list:
    return external_keys(kv.namespace(), [name.encode() for name in names])


def test_on_idle_links_a_load_costs_its_chunks_one_after_another() -> None:
    links = Links(SECONDS)
    a, b, c, d = keys("a", "b", "c", "d")
    load = links.load([a, b, c, d], [HBM, DRAM, SSD, SSD], 100.0)
    assert load.seconds == pytest.approx(0.001 + 0.5 + 2.0 + 2.0)
    assert load.nominal_s == pytest.approx(load.seconds)
    assert load.waited_s == pytest.approx(0.0)
    assert load.tiers == (HBM, DRAM, SSD, SSD)


def test_a_demand_load_waits_behind_a_prefetch_on_its_link_but_not_on_another() -> None:
    links = Links(SECONDS)
    p1, p2, x, y = keys("p1", "p2", "x", "y")
    links.prefetch([(p1, SSD), (p2, SSD)], 10.0)  # the SSD link is busy until 14
    behind = links.load([x], [SSD], 11.0)
    assert behind.seconds == pytest.approx(14.0 + 2.0 - 11.0)
    assert behind.waited_s == pytest.approx(3.0)
    beside = links.load([y], [DRAM], 11.0)  # DRAM's link is free
    assert beside.seconds == pytest.approx(0.5)


def test_a_chunk_in_flight_is_waited_for_and_charged_to_its_source() -> None:
    links = Links(SECONDS)
    a, b = keys("a", "b")
    links.prefetch([(a, SSD), (b, SSD)], 0.0)  # land at 2 and 4, into HBM
    load = links.load([a, b], [HBM, HBM], 1.0)
    assert load.seconds == pytest.approx(3.0)
    assert load.tiers == (SSD, SSD)
    landed = links.load([a, b], [HBM, HBM], 5.0)
    assert landed.seconds == pytest.approx(0.002)
    assert landed.tiers == (HBM, HBM)


def test_demand_loads_queue_behind_each_other_and_one_lane_a_gpu_serves_dram() -> None:
    one = Links(SECONDS)
    two = Links(SECONDS, {DRAM: 2})
    a, b = keys("a", "b")
    assert one.load([a], [DRAM], 0.0).seconds == pytest.approx(0.5)
    assert one.load([b], [DRAM], 0.0).seconds == pytest.approx(1.0)  # behind a
    assert two.load([a], [DRAM], 0.0).seconds == pytest.approx(0.5)
    assert two.load([b], [DRAM], 0.0).seconds == pytest.approx(0.5)  # its own lane
    assert two.load([b], [SSD], 0.0).seconds == pytest.approx(2.0)
    assert two.load([a], [SSD], 0.0).seconds == pytest.approx(4.0)  # SSD: one link


def test_landed_copies_are_forgotten_in_bulk() -> None:
    links = Links(SECONDS)
    many = keys(*(f"k{i}" for i in range(5000)))
    links.prefetch([(key, DRAM) for key in many], 0.0)  # the last lands at 2,500 s
    late = keys("late")
    links.prefetch([(late[0], DRAM)], 10_000.0)
    assert len(links) == 1
