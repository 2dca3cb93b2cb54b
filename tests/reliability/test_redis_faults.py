"""The ``redis_faults`` scenario in its short form: a real daemon over a real Redis (and a
real three-master cluster) behind the fault proxy, one window per fault mode.

The scenario runs once for the module; each test reads one property off its
report.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from faults import redis_faults
from faults.campaign import SHORT, Report

FAULTS = [case.name for case in redis_faults.CASES]
# DRAM hits may get at most twice as slow at p99 during a fault, or this slow at
# all: the p99 of 40 reads is their slowest, and on a shared two-core machine one
# read alone can take over 100 ms. Still half the 0.5 s socket timeout, so a DRAM
# hit that waited on Redis fails it.
DRAM_P99_FLOOR_MS = 250.0
BOUND_MS = (redis_faults.DEADLINE_S + redis_faults.EPSILON_S) * 1e3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, float]:
    started = time.monotonic()
    report = redis_faults.run(SHORT, tmp_path_factory.mktemp("redis-faults"))
    return report, time.monotonic() - started


@pytest.fixture
def report(run: tuple[Report, float]) -> Report:
    return run[0]


def modes(report: Report, part: str) -> dict[str, dict[str, Any]]:
    return {name: mode for name, mode in report.figures[part].items() if name in FAULTS}


def dram_p99_bound_ms(report: Report, part: str) -> float:
    baseline = report.figures[part]["baseline"]["get_ms"]["dram"]["p99"]
    return max(2 * baseline, DRAM_P99_FLOOR_MS)


def test_the_short_form_passes_within_its_time(run: tuple[Report, float]) -> None:
    report, seconds = run
    assert report.failures() == {}
    assert seconds < SHORT.seconds


def test_every_standalone_mode_reads_right_or_miss_and_recovers(report: Report) -> None:
    standalone = modes(report, "standalone")
    assert list(standalone) == FAULTS
    for name, mode in standalone.items():
        assert mode["wrong_bytes"] == 0, name
        assert mode["errors_raised_to_client"] == 0, name
        assert mode["client_degraded_calls"] == 0, name  # the daemon answered in time
        assert mode["dram_held_not_from_dram"] == 0, name
        assert mode["get_ms"]["dram"]["n"] > 0, name
        assert mode["recovery_s"] is not None, name
        assert mode["recovery_s"] <= redis_faults.RECOVERY_LIMIT_S, name


def test_a_failing_redis_costs_one_deadline_then_fast_misses(report: Report) -> None:
    standalone = modes(report, "standalone")
    for name in ("stall", "reset", "half_open"):
        mode = standalone[name]
        assert mode["redis_held_degraded_share"] > 0.5, name
        assert mode["breaker_trips"] >= 1, name
        assert mode["max_ms"] <= BOUND_MS, name
        assert mode["get_ms"]["miss"]["p50"] < 100, name  # the breaker answers at once
    for name in ("latency", "bandwidth"):  # slow, but within the timeouts: served
        mode = standalone[name]
        assert mode["redis_held_degraded_share"] == 0, name
        assert mode["get_ms"]["redis"]["n"] > 0, name
        assert mode["max_ms"] <= BOUND_MS, name


def test_dram_hits_keep_their_latency_while_redis_fails(report: Report) -> None:
    bound = dram_p99_bound_ms(report, "standalone")
    for name, mode in modes(report, "standalone").items():
        assert mode["get_ms"]["dram"]["p99"] <= bound, name


@pytest.mark.cluster
def test_one_faulty_master_reads_right_or_miss_and_recovers(report: Report) -> None:
    cluster = modes(report, "cluster")
    assert list(cluster) == list(redis_faults.SHORT_CLUSTER_CASES)
    for name, mode in cluster.items():
        assert mode["wrong_bytes"] == 0, name
        assert mode["errors_raised_to_client"] == 0, name
        assert mode["dram_held_not_from_dram"] == 0, name
        assert mode["proxied_chunks_degraded_share"] > 0.5, name
        assert mode["recovery_s"] is not None, name
        assert mode["recovery_s"] <= redis_faults.RECOVERY_LIMIT_S, name


@pytest.mark.cluster
def test_one_faulty_master_leaves_the_others_serving(report: Report) -> None:
    """Its keys are misses; the other masters' are served (a breaker per master)."""
    for name, mode in modes(report, "cluster").items():
        assert mode["healthy_master_chunks_missed"] == 0, name


@pytest.mark.cluster
def test_one_hung_master_does_not_hold_up_dram_hits(report: Report) -> None:
    """Nothing waits on the hung master under the store lock."""
    assert modes(report, "cluster")["stall"]["get_ms"]["dram"]["p99"] <= dram_p99_bound_ms(
        report, "cluster"
    )
