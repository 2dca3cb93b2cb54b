"""An offline lower bound on the GPU-seconds any placement policy spends on a workload.

The argument. Take the calls in their nominal order (``workload``: every
response as long as the trace measured, nothing waiting), each reading its
prompt's chunks head first: ``N`` chunk accesses. Whatever a policy does, at
every moment HBM holds at most ``C1`` chunks, HBM and DRAM at most ``C2``, the
three local tiers at most ``C3``. Belady's MIN is optimal for the number of
hits at a given capacity, so the accesses any policy serves from

    HBM                  number at most  h1 = hits of MIN with C1 slots
    HBM or DRAM                          h2 = hits of MIN with C2 slots
    HBM, DRAM or SSD                     h3 = hits of MIN with C3 slots

and every other access is recomputed (a first access always is). An access
served from tier ``t`` costs at least ``c_t = min(load_t, recompute)`` (one
chunk's load at ``t``'s rate, or its prefill), with ``c_HBM <= c_DRAM <= c_SSD
<= recompute``; so the cheapest assignment the counts allow is

    bound = N c_R - h3 (c_R - c_SSD) - h2 (c_SSD - c_DRAM) - h1 (c_DRAM - c_HBM)

plus the tail of every prompt past its last full chunk, which is always
recomputed. Nothing the engine adds on top (write-back, queueing, loading only
a cached *prefix*) can make a policy cheaper than that. With perfect prefetch
every access found anywhere costs ``c_HBM`` (the copy ran ahead of the call):
``h3 c_HBM + (N - h3) c_R``, a bound on a policy that may prefetch for free.

The floor. Whatever the tiers hold, each block's first access and every prompt's
tail are recomputed: ``floor = F c_R + tail`` (``F`` first accesses), which every
policy spends at any capacity. Only what a policy spends above it is placement's
to save; on the agentic traces the floor is most of every policy's GPU-seconds.

It counts every call (``score_from`` does not apply: MIN maximises the hits
of the whole sequence, not of a part of it). What the bound assumes: the
calls in nominal order. A closed-loop replay
serves them later the slower a policy is, which can interleave users'
accesses differently; the bound is exact for the nominal interleaving and
only close for the others. Tiers below SSD (Redis) are left out: they only
lower the bound where reloading from them beats recomputing, which with the
default rates it does not.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstore.keys import Namespace
from kvstore.kinds import TierKind
from kvstore.predictor.replay.config import ReplayConfig
from kvstore.predictor.replay.conversations import Call
from kvstore.predictor.replay.costs import stand_in_layout
from kvstore.predictor.replay.replay_store import ChunkChains
from kvstore.predictor.replay.workload import Step, Workload, nominal_seconds

LOCAL_TIERS = (TierKind.HBM, TierKind.DRAM, TierKind.SSD)


@dataclass(frozen=True)
class Bound:
    """The bound on one workload at one sizing (module docstring)."""

    gpu_seconds: float
    gpu_seconds_prefetch: float
    floor_gpu_seconds: float
    calls: int
    accesses: int
    first_accesses: int
    hits: dict[str, int]  # MIN's hits with the slots of HBM, then HBM + DRAM, then + SSD

    def to_dict(self) -> dict[str, object]:
        return {
            "gpu_seconds": self.gpu_seconds,
            "gpu_seconds_prefetch": self.gpu_seconds_prefetch,
            "floor_gpu_seconds": self.floor_gpu_seconds,
            "calls": self.calls,
            "accesses": self.accesses,
            "first_accesses": self.first_accesses,
            "min_hits": self.hits,
        }


def nominal_calls(workload: Workload) -> list[tuple[float, Call]]:
    """Every call with its nominal arrival, in that order (ties keep the workload's)."""
    calls: list[tuple[float, int, Call]] = []
    order = 0
    for lane in workload.lanes:
        start = lane.start
        for script in lane.scripts:
            if script.arrivals is not None:
                for arrival, step in zip(script.arrivals, script.steps, strict=True):
                    assert isinstance(step, Call)
                    calls.append((arrival, order, step))
                    order += 1
                continue
            for arrival, step in _timed(script.steps, start):
                calls.append((arrival, order, step))
                order += 1
            start += nominal_seconds(script.steps)
    calls.sort(key=lambda item: (item[0], item[1]))
    return [(arrival, call) for arrival, _, call in calls]


def _timed(steps: Sequence[Step], start: float) -> Iterator[tuple[float, Call]]:
    now = start
    for step in steps:
        if isinstance(step, Call):
            yield now + step.think_s, step
            now += step.think_s + step.api_s
        else:
            for child in step.conversations:
                yield from _timed(child.steps, now + step.think_s)
            now += step.think_s + max(nominal_seconds(c.steps) for c in step.conversations)


def min_hits(accesses: Sequence[int], capacity: int) -> int:
    """Hits of Belady's MIN (evict the block used furthest in the future) with ``capacity``
    slots over ``accesses``."""
    if capacity <= 0:
        return 0
    upcoming = _next_uses(accesses)
    cached: dict[int, int] = {}  # block -> its next use
    furthest: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hits = 0
    for position, block in enumerate(accesses):
        following = upcoming[position]
        if block in cached:
            hits += 1
        elif len(cached) >= capacity:
            while True:
                use, victim = heapq.heappop(furthest)
                if cached.get(victim) == -use:
                    del cached[victim]
                    break
        cached[block] = following
        heapq.heappush(furthest, (-following, block))
    return hits


def _next_uses(accesses: Sequence[int]) -> list[int]:
    """For each access, the position of the next access to the same block (a large
    number, beyond the end, when there is none)."""
    never = len(accesses) + 1
    upcoming = [never] * len(accesses)
    last: dict[int, int] = {}
    for position in range(len(accesses) - 1, -1, -1):
        block = accesses[position]
        upcoming[position] = last.get(block, never)
        last[block] = position
    return upcoming


@dataclass(frozen=True)
class _Accesses:
    """The chunk accesses of the calls in nominal order, and the tokens past their chunks."""

    calls: int
    chunks: list[int]
    chunk_tokens: int
    tail_tokens: int

    @staticmethod
    def of(workload: Workload, config: ReplayConfig) -> _Accesses:
        chunk_tokens = workload.block_tokens * config.chunk_blocks
        layout = stand_in_layout(chunk_tokens)
        chains = ChunkChains(Namespace("bound", layout), config.chunk_blocks)
        accesses: list[int] = []
        tail_tokens = 0
        calls = nominal_calls(workload)[: config.max_requests]
        for _, call in calls:
            chunks = chains.ids(call)
            accesses += chunks
            tail_tokens += call.prompt_tokens - len(chunks) * chunk_tokens
        return _Accesses(len(calls), accesses, chunk_tokens, tail_tokens)

    @functools.cached_property
    def first(self) -> int:
        return len(set(self.chunks))

    def floor(self, config: ReplayConfig) -> float:
        tokens = self.first * self.chunk_tokens + self.tail_tokens
        return config.costs.recompute_seconds(tokens)


def placement_floor(
    workload: Workload, config: ReplayConfig, bound: Bound | None = None
) -> float | None:
    """The GPU-seconds every policy spends on ``workload`` at any capacity (the floor in
    the module docstring): ``bound``'s if given, else counted without its MIN runs.
    None when the replay charges only the calls from ``score_from`` on: the floor
    counts every call."""
    if math.isfinite(config.score_from):
        return None
    if bound is not None:
        return bound.floor_gpu_seconds
    return _Accesses.of(workload, config).floor(config)


def offline_bound(workload: Workload, config: ReplayConfig) -> Bound:
    """The bound on ``workload`` at ``config``'s sizing and costs (module docstring)."""
    seen = _Accesses.of(workload, config)
    accesses, chunk_tokens, tail_tokens = seen.chunks, seen.chunk_tokens, seen.tail_tokens
    costs, per_token = config.costs, config.kv_bytes_per_token
    recompute = costs.recompute_seconds(chunk_tokens)
    load = {
        kind: min(costs.load_seconds(kind, chunk_tokens, per_token), recompute)
        for kind in LOCAL_TIERS
    }
    capacity = 0
    hits: dict[str, int] = {}
    for kind in LOCAL_TIERS:
        capacity += config.sizing.slots(kind, chunk_tokens, per_token)
        hits[kind.label] = min_hits(accesses, capacity)
    h1, h2, h3 = (hits[kind.label] for kind in LOCAL_TIERS)
    total = len(accesses)
    demand = (
        total * recompute
        - h3 * (recompute - load[TierKind.SSD])
        - h2 * (load[TierKind.SSD] - load[TierKind.DRAM])
        - h1 * (load[TierKind.DRAM] - load[TierKind.HBM])
    )
    prefetch = h3 * load[TierKind.HBM] + (total - h3) * recompute
    tail = costs.recompute_seconds(tail_tokens)
    return Bound(
        gpu_seconds=demand + tail,
        gpu_seconds_prefetch=prefetch + tail,
        floor_gpu_seconds=seen.floor(config),
        calls=seen.calls,
        accesses=total,
        first_accesses=seen.first,
        hits=hits,
    )
