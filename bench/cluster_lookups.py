"""The cost of consulting the shared tier, a figure of ``bench/cluster.py``: B's lookup
of a 128-chunk chain held in its own DRAM, nowhere, or only in Redis, against the
same question asked by redis-py itself; and the Redis commands each kind of call
costs the masters (``INFO commandstats``)."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster_hosts import DRAIN_WITHIN_S, Bench, wait_written, written
from common import Chain, ChunkSize, KeySpace, format_table, make_chunks, percentile, redis_key

from kvstore.client import StoreClient
from kvstore.keys import KVLayout, Namespace
from kvstore.local.redis_cluster import RedisCluster

EXTRA_LOOKUP_GOAL_MS = 1.0  # the issue's: consulting the shared tier adds < 1 ms p50
# A lookup does not read payloads, so its chains have tiny chunks (512 B); 16 tokens a
# chunk (vLLM's block), 128 chunks a chain.
LOOKUP_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=16)
LOOKUP_CHUNKS = 128
HELD_PUT_BATCH = 32  # lookup chains put between waits: 4096 blocks, half the write queue


LOOKUP_CASES = {
    "local": "B, chain in its own DRAM (baseline)",
    "absent_first": "B, chain held nowhere: first lookup",
    "absent_again": "B, held nowhere: again at once",
    "held_first": "B, chain only in Redis: first lookup",
    "held_again": "B, only in Redis: again",
    "no_shared_tier": "a daemon with no shared tier, its DRAM",
    "raw_exists": "raw redis-py: EXISTS of the 128 keys",
}
# Cases that are not a daemon's lookup: no "extra" over the local one.
PEER_CASES = ("raw_exists",)
GOAL_CASES = ("absent_first", "held_first")


@dataclass
class LookupCost:
    """Each case's lookup latencies (seconds), and the Redis commands one call costs."""

    seconds: dict[str, list[float]]
    commands: dict[str, dict[str, int]]

    def p_ms(self, case: str, q: float) -> float:
        return 1e3 * percentile(self.seconds[case], q)

    def extra_ms(self, case: str, q: float) -> float:
        return self.p_ms(case, q) - self.p_ms("local", q)


def redis_commands(cluster: RedisCluster, call: Callable[[], object]) -> dict[str, int]:
    """``EXISTS``, ``GET`` and ``SET`` calls the masters counted while ``call`` ran
    (``INFO commandstats``, reset first; nothing else talks to the cluster meanwhile)."""
    for node in cluster.nodes:
        node.command("CONFIG", "RESETSTAT")
    call()
    totals = {"exists": 0, "get": 0, "set": 0}
    for node in cluster.nodes:
        for name, calls in re.findall(
            rb"cmdstat_(\w+):calls=(\d+)", node.command("INFO", "commandstats")
        ):
            if name.decode() in totals:
                totals[name.decode()] += int(calls)
    return totals


def measure_lookup_cost(bench: Bench, solo: StoreClient, cluster: RedisCluster) -> LookupCost:
    """B's lookups of 128-chunk chains held in its DRAM, nowhere, or only in Redis
    (A put them), interleaved; then the Redis commands of one call of each kind."""
    a, b = bench.hosts[0], bench.hosts[1]
    namespace = Namespace("bench-cluster-lookup", LOOKUP_LAYOUT)
    space = KeySpace(namespace, LOOKUP_CHUNKS, seed=2)
    chunks = make_chunks(ChunkSize("512B", LOOKUP_LAYOUT), LOOKUP_CHUNKS, seed=3)
    count = bench.settings.lookup_samples
    local, solo_chain = space.fresh(), space.fresh()
    held = [space.fresh() for _ in range(count + 3)]  # 3 more for the command counts
    before = written([b])
    for client, chain in ((b.client, local), (solo, solo_chain)):
        if client.put(namespace, chain.tokens, chunks) != LOOKUP_CHUNKS:
            raise RuntimeError("a lookup chain was not stored")
    wait_written([b], [before[0] + LOOKUP_CHUNKS], DRAIN_WITHIN_S)  # B's own, in Redis too
    for start in range(0, len(held), HELD_PUT_BATCH):
        before = written([a])
        batch = held[start : start + HELD_PUT_BATCH]
        for chain in batch:
            if a.client.put(namespace, chain.tokens, chunks) != LOOKUP_CHUNKS:
                raise RuntimeError("a lookup chain was not stored")
        wait_written([a], [before[0] + len(batch) * LOOKUP_CHUNKS], DRAIN_WITHIN_S)

    seconds: dict[str, list[float]] = {case: [] for case in LOOKUP_CASES}

    def timed(case: str | None, client: StoreClient, chain: Chain, want: int) -> None:
        start = time.perf_counter()
        found = client.lookup(namespace, chain.tokens).num_chunks
        elapsed = time.perf_counter() - start
        if found != want:
            raise RuntimeError(f"{case}: a lookup found {found} chunks, not {want}")
        if case is not None:
            seconds[case].append(elapsed)

    for _ in range(5):  # warm-up: connections, the namespace registered
        timed(None, b.client, local, LOOKUP_CHUNKS)
        timed(None, solo, solo_chain, LOOKUP_CHUNKS)
    for index in range(count):
        absent = space.fresh()
        timed("local", b.client, local, LOOKUP_CHUNKS)
        timed("no_shared_tier", solo, solo_chain, LOOKUP_CHUNKS)
        timed("absent_first", b.client, absent, 0)
        timed("absent_again", b.client, absent, 0)
        timed("held_first", b.client, held[index], LOOKUP_CHUNKS)
        timed("held_again", b.client, held[index], LOOKUP_CHUNKS)
        # The peer: the same question asked by redis-py itself, one cluster pipeline.
        redis_keys = [redis_key(namespace, key) for key in held[index].keys]
        start = time.perf_counter()
        if not bench.raws[0].exists_all(redis_keys):
            raise RuntimeError("raw_exists: a held chain's keys are not all in Redis")
        seconds["raw_exists"].append(time.perf_counter() - start)

    absent, fresh_held, for_gets = space.fresh(), held[count], held[count + 1 :]

    def lookup(chain: Chain) -> Callable[[], object]:
        return functools.partial(b.client.lookup, namespace, chain.tokens)

    def get(client: StoreClient, chain: Chain) -> Callable[[], object]:
        return functools.partial(client.get, namespace, chain.keys)

    commands = {
        "lookup_local": redis_commands(cluster, lookup(local)),
        "lookup_absent_first": redis_commands(cluster, lookup(absent)),
        "lookup_absent_again": redis_commands(cluster, lookup(absent)),
        "lookup_held_first": redis_commands(cluster, lookup(fresh_held)),
        "lookup_held_again": redis_commands(cluster, lookup(fresh_held)),
        "get_shm_client_held": redis_commands(cluster, get(b.client, for_gets[0])),
        "get_bytes_client_held": redis_commands(cluster, get(b.bytes_client, for_gets[1])),
    }
    for chain in held:
        a.client.delete(namespace, chain.keys)
        b.client.delete(namespace, chain.keys)
    return LookupCost(seconds, commands)


def lookup_table(cost: LookupCost) -> str:
    exists = {
        "local": cost.commands["lookup_local"]["exists"],
        "absent_first": cost.commands["lookup_absent_first"]["exists"],
        "absent_again": cost.commands["lookup_absent_again"]["exists"],
        "held_first": cost.commands["lookup_held_first"]["exists"],
        "held_again": cost.commands["lookup_held_again"]["exists"],
    }
    rows = []
    for case, label in LOOKUP_CASES.items():
        extra = cost.extra_ms(case, 0.5)
        goal = None
        if case in GOAL_CASES:
            goal = (
                f"{'ok' if extra < EXTRA_LOOKUP_GOAL_MS else 'MISS'} (< {EXTRA_LOOKUP_GOAL_MS} ms)"
            )
        rows.append(
            [
                label,
                f"{cost.p_ms(case, 0.5):.2f}",
                f"{cost.p_ms(case, 0.99):.2f}",
                None if case == "local" or case in PEER_CASES else f"{extra:+.2f}",
                None
                if case == "local" or case in PEER_CASES
                else f"{cost.extra_ms(case, 0.99):+.2f}",
                exists.get(case),
                goal,
            ]
        )
    return format_table(
        ["lookup of 128 chunks", "p50 ms", "p99 ms", "extra p50", "extra p99", "EXISTS", "goal"],
        rows,
    )


def lookup_json(cost: LookupCost) -> dict[str, Any]:
    return {
        case: {
            "p50_ms": round(cost.p_ms(case, 0.5), 3),
            "p99_ms": round(cost.p_ms(case, 0.99), 3),
            "extra_p50_ms": round(cost.extra_ms(case, 0.5), 3),
            "extra_p99_ms": round(cost.extra_ms(case, 0.99), 3),
            "samples": len(cost.seconds[case]),
            **({"goal_extra_p50_ms": EXTRA_LOOKUP_GOAL_MS} if case in GOAL_CASES else {}),
        }
        for case in LOOKUP_CASES
    }
