"""Cross-host visibility, a figure of ``bench/cluster.py``: how soon B finds whole a
chain A just put (the three ways of looking are in that module's docstring), against
a raw ``EXISTS`` poll of the same keys in Redis."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from cluster_hosts import DRAIN_WITHIN_S, Bench, Host, wait_written, written
from common import Chain, format_table, percentile

VISIBLE_WITHIN_S = 5.0  # a chain not visible on B this long after A's put is a failure


class Look(enum.Enum):
    """When B looks for a chain A puts (``cluster.py``'s docstring)."""

    AFTER_LANDING = "after_landing"
    POLLING = "polling"
    LOOKED_BEFORE = "looked_before"


LOOK_LABELS = {
    Look.AFTER_LANDING: "B first looks once the copy landed",
    Look.POLLING: "B never looked before; polls from A's put",
    Look.LOOKED_BEFORE: "B looked just before A's put; polls",
}


@dataclass(frozen=True, slots=True)
class Visibility:
    """One sample: A's put, then B's lookups until the whole chain is a hit. Times in
    seconds from A's put returning."""

    put_s: float  # A's put itself
    landed_s: float  # until every block of the chain EXISTS in Redis (the raw poll)
    hit_s: float  # until B's first lookup that found the whole chain
    first_found: int  # chunks B's first lookup after the put found
    lookups: int  # B's lookups after the put, the full hit included


def visible_on_b(bench: Bench, a: Host, b: Host, chain: Chain, look: Look) -> Visibility:
    """A puts ``chain``; B looks it up as ``look`` says until it is all a hit. The raw
    poll and B's lookups alternate on this thread, about every half millisecond. Once
    A's counters say its copy is made, A deletes the chain (and its Redis copy)."""
    namespace, want = bench.namespace, len(chain.keys)
    before = written([a])
    keys = bench.keys_in_redis(chain)
    raw = bench.raws[0]
    if look is Look.LOOKED_BEFORE and b.client.lookup(namespace, chain.tokens).num_chunks:
        raise RuntimeError("a fresh chain was found before it was put")
    start = time.perf_counter()
    if a.client.put(namespace, chain.tokens, a.chunks) != want:
        raise RuntimeError("A's put did not store the whole chain")
    returned = time.perf_counter()
    landed: float | None = None
    found: list[int] = []
    while not found or found[-1] != want:
        if time.perf_counter() - returned > VISIBLE_WITHIN_S:
            raise RuntimeError(f"{look.value}: not visible on B within {VISIBLE_WITHIN_S} s")
        if landed is None and raw.exists_all(keys):
            landed = time.perf_counter() - returned
        if landed is not None or look is not Look.AFTER_LANDING:
            found.append(b.client.lookup(namespace, chain.tokens).num_chunks)
        time.sleep(0.0005)
    hit = time.perf_counter() - returned
    wait_written([a], [before[0] + want], DRAIN_WITHIN_S)
    a.client.delete(namespace, chain.keys)
    return Visibility(
        put_s=returned - start,
        landed_s=hit if landed is None else landed,  # B's hit came first: it had landed
        hit_s=hit,
        first_found=found[0],
        lookups=len(found),
    )


def measure_visibility(bench: Bench) -> dict[Look, list[Visibility]]:
    """``visibility_samples`` of each way of looking, interleaved, fresh chains."""
    a, b = bench.hosts[0], bench.hosts[1]
    samples: dict[Look, list[Visibility]] = {look: [] for look in Look}
    visible_on_b(bench, a, b, bench.space.fresh(), Look.AFTER_LANDING)  # warm-up
    for _ in range(bench.settings.visibility_samples):
        for look in Look:
            samples[look].append(visible_on_b(bench, a, b, bench.space.fresh(), look))
    return samples


def visibility_json(samples: list[Visibility]) -> dict[str, Any]:
    def ms(values: list[float]) -> dict[str, float]:
        return {
            "p50_ms": round(1e3 * percentile(values, 0.5), 2),
            "p99_ms": round(1e3 * percentile(values, 0.99), 2),
            "max_ms": round(1e3 * max(values), 2),
        }

    return {
        "hit": ms([s.hit_s for s in samples]),
        "landed": ms([s.landed_s for s in samples]),
        "put": ms([s.put_s for s in samples]),
        "first_lookup_found_median": percentile([s.first_found for s in samples], 0.5),
        "lookups_median": percentile([s.lookups for s in samples], 0.5),
        "samples": len(samples),
    }


def visibility_table(samples: dict[Look, list[Visibility]], chain_chunks: int) -> str:
    rows = []
    for look, values in samples.items():
        figures = visibility_json(values)
        rows.append(
            [
                LOOK_LABELS[look],
                f"{figures['hit']['p50_ms']:.1f}",
                f"{figures['hit']['p99_ms']:.1f}",
                f"{figures['landed']['p50_ms']:.1f}",
                f"{figures['put']['p50_ms']:.1f}",
                f"{figures['first_lookup_found_median']}/{chain_chunks}",
                figures["lookups_median"],
                figures["samples"],
            ]
        )
    return format_table(
        [
            "B's full hit, from A's put returning",
            "p50 ms",
            "p99 ms",
            "landed p50",
            "A's put p50",
            "first lookup found",
            "lookups",
            "samples",
        ],
        rows,
    )
