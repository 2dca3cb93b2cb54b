"""The offline bound: Belady's MIN counted right, and never above what a policy spends."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvstore.predictor.replay.bound import (
    min_hits,
    nominal_calls,
    offline_bound,
    placement_floor,
)
from kvstore.predictor.replay.config import ReplayConfig
from kvstore.predictor.replay.conversations import Call, Conversation, Stop
from kvstore.predictor.replay.costs import Sizing
from kvstore.predictor.replay.parallel import replay
from kvstore.predictor.replay.policies import parse_policies
from kvstore.predictor.replay.workload import Workload, compose_users
from kvstore.wire.events import Trigger

BLOCK = 512
CHUNK_GB = BLOCK * 131072 / 1e9


def test_min_evicts_the_block_used_furthest_in_the_future() -> None:
    # With 2 slots: a b (miss miss) c -> evicts b (next used last) ... the textbook run.
    accesses = [1, 2, 3, 1, 3, 2]
    assert min_hits(accesses, 2) == 2  # 1 and 3 hit; 2 was evicted for 3
    assert min_hits(accesses, 3) == 3
    assert min_hits(accesses, 0) == 0
    rng = np.random.default_rng(0)
    sequence = [int(x) for x in rng.integers(0, 30, 2000)]
    for capacity in (1, 5, 12):
        assert min_hits(sequence, capacity) >= _lru_hits(sequence, capacity)  # MIN is optimal


def _lru_hits(accesses: list[int], capacity: int) -> int:
    cached: dict[int, None] = {}
    hits = 0
    for block in accesses:
        if block in cached:
            hits += 1
            del cached[block]
        elif len(cached) >= capacity:
            del cached[next(iter(cached))]
        cached[block] = None
    return hits


def workload(seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    conversations = []
    for i in range(10):
        steps = []
        blocks = 2
        for turn in range(int(rng.integers(3, 8))):
            blocks += int(rng.integers(1, 4))
            human = turn == 0 or bool(rng.random() < 0.3)
            steps.append(
                Call(
                    blocks=tuple(f"c{i}/{b}" for b in range(blocks)),
                    prompt_tokens=blocks * BLOCK - int(rng.integers(0, 300)),
                    output_tokens=20,
                    trigger=Trigger.USER if human else Trigger.TOOL,
                    stop=Stop.TOOL_USE,
                    think_s=float(rng.uniform(60, 900)) if human else float(rng.uniform(1, 5)),
                    api_s=float(rng.uniform(1, 10)),
                )
            )
        conversations.append(Conversation(f"c{i}", BLOCK, tuple(steps)))
    return compose_users(conversations, users=4, seed=seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_bound_is_never_above_any_policys_cost(seed: int) -> None:
    work = workload(seed)
    sizing = Sizing(6.5 * CHUNK_GB, 12.5 * CHUNK_GB, 200.5 * CHUNK_GB)
    config = ReplayConfig(sizing, horizons=(60.0, 600.0))
    bound = offline_bound(work, config)
    specs = parse_policies("lru,ttl:60,tool-aware,predictor,oracle")
    runs = replay(work, specs, config)
    assert bound.calls == runs[0].requests
    assert bound.floor_gpu_seconds <= bound.gpu_seconds_prefetch <= bound.gpu_seconds
    assert placement_floor(work, config) == bound.floor_gpu_seconds
    for run in runs:
        assert bound.gpu_seconds <= run.gpu_seconds, run.name
    # Counting: MIN's hits grow with the capacity, and first accesses are all misses.
    hits = list(bound.hits.values())
    assert hits == sorted(hits) and hits[-1] == bound.accesses - bound.first_accesses


def test_nominal_calls_are_in_order_of_their_nominal_arrival() -> None:
    work = workload(0)
    calls = nominal_calls(work)
    arrivals = [arrival for arrival, _ in calls]
    assert arrivals == sorted(arrivals)
    assert len(calls) == work.calls()


def test_the_floor_is_what_every_policy_recomputes_at_any_capacity() -> None:
    """First accesses and prompt tails are recomputed whatever the tiers hold: with room
    for everything, a replay recomputes exactly the floor; and a replay that charges
    only part of the calls has no floor to compare with."""
    tail = 100  # tokens past the last hashed block of every prompt
    conversations = []
    for i in range(3):
        steps = [
            Call(
                blocks=tuple(f"c{i}/{b}" for b in range(blocks)),
                prompt_tokens=blocks * BLOCK + tail,
                output_tokens=20,
                trigger=Trigger.USER,
                stop=Stop.END_TURN,
                think_s=30.0,
                api_s=2.0,
            )
            for blocks in (2, 3, 5)
        ]
        conversations.append(Conversation(f"c{i}", BLOCK, tuple(steps)))
    work = compose_users(conversations, users=2, seed=0)
    huge = Sizing(1e4 * CHUNK_GB, 1e4 * CHUNK_GB, 1e4 * CHUNK_GB)
    config = ReplayConfig(huge, horizons=(60.0, 600.0))
    bound = offline_bound(work, config)
    recomputed = (3 * 5 + 9 * tail / BLOCK) * BLOCK  # each chunk once, every tail
    assert bound.first_accesses == 15
    assert bound.floor_gpu_seconds == pytest.approx(config.costs.recompute_seconds(recomputed))
    (run,) = replay(work, parse_policies("lru"), config)
    assert run.recomputed_tokens == recomputed
    assert placement_floor(work, dataclasses.replace(config, score_from=100.0)) is None
