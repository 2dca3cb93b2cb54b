#!/usr/bin/env python3
"""Several hosts, one cache: daemons sharing a Redis Cluster, against raw redis-py.

The bench starts a real 3-master Redis Cluster (``maxmemory`` above what it
writes, ``allkeys-lru``) and 2-3 ``kvstore serve`` daemons, each with a DRAM
tier and the cluster as its shared tier (``write = "through"``, the default),
each driven by its own ``kvstore.connect("unix://...")`` clients, all on
loopback: one "host" is one daemon. What it measures, each against a peer
measured in the same run:

    figure           the daemons                                   the peer
    ---------------  --------------------------------------------  --------------------------
    put throughput   each client puts a fresh chain (2 MiB chunks)  as many threads, each its
                     into its daemon; timed from the first put      own redis-py cluster client,
                     until every daemon's write-through has copied  pipelining SETs of the same
                     it (``write_through_written`` in /v1/stats)    bytes
    get throughput   each client gets a fresh chain another daemon  the same threads pipelining
                     put, so it is served from Redis (its daemon    GETs of the same Redis keys
                     never held it): shm client (the default) and
                     bytes client
    cross-host       A puts a fresh chain; B's client looks it up   when every block of it
    visibility       until the whole chain is a hit: from A's put   EXISTS in Redis (a raw
                     returning to B's first full hit                poll of the same chain)
    lookup cost      B looks up a 128-chunk chain nobody holds      B looks up a 128-chunk
                     (first, and again within the negative cache's  chain held in its own DRAM
                     window), and one Redis holds (first, again)    (no round trip)

Cross-host visibility is measured three ways, interleaved:

* ``after_landing``: B's first lookup comes once the raw poll saw every block in
  Redis: the write-through delay, plus one lookup.
* ``polling``: B never looked before A's put, and looks from the moment it
  returns, as an engine asked for that prefix would. A lookup that comes before
  A's copy has fully landed finds the landed part, and the keys Redis lacks at
  that moment are taken as missing for ``shared_miss_ttl_s`` (0.25 s): the
  full hit comes that long after that lookup, not when the copy lands.
* ``looked_before``: B looked the chain up (a miss) just before A's put, so its
  keys are taken as missing for ``shared_miss_ttl_s`` from that lookup: the full
  hit comes about that long after it, less A's put.

How many Redis commands each kind of call costs (``INFO commandstats`` on every
master, reset before the call) is reported beside the timings: a lookup's
``EXISTS`` per chunk (one pipelined round trip per master), and a get's
``EXISTS`` and ``GET`` per chunk.

Throughput counts payload bytes (decimal GB/s; the 128-byte block header each
Redis value carries is not counted), medians of the timed repetitions, the
daemons and the raw clients interleaved. Latencies are nearest-rank
percentiles. On a shared 2-core machine the absolute figures are noise: the
ratios and differences are the result.

    python bench/cluster.py            # table on stdout
    python bench/cluster.py --json     # one JSON object on stdout, table on stderr
    python bench/cluster.py --quick    # 2 daemons, smaller chains, fewer samples (~1 min)
"""

from __future__ import annotations

import enum
import functools
import re
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ceilings import RawRedisCluster  # noqa: E402
from common import (  # noqa: E402
    CHUNK_2MIB,
    BatchThroughput,
    Case,
    Chain,
    ChunkSize,
    DaemonStats,
    KeySpace,
    MiB,
    Sample,
    bench_arguments,
    bench_session,
    check_chunks,
    emit_json,
    format_table,
    log,
    machine_info,
    make_chunks,
    percentile,
    redis_key,
    store_client,
    temp_dir,
    time_interleaved,
    verdict,
)
from faults.campaign import DaemonSpec  # noqa: E402

from kvstore.client import StoreClient  # noqa: E402
from kvstore.keys import KVLayout, Namespace  # noqa: E402
from kvstore.tiers.kinds import TierKind  # noqa: E402
from kvstore.tiers.local_redis import RedisCluster  # noqa: E402
from kvstore.tiers.registry import TierConfig  # noqa: E402

SIZE = CHUNK_2MIB
REDIS = TierKind.REDIS.label
THROUGHPUT_GOAL = 0.8  # the issue's: aggregate store throughput over raw redis-py
EXTRA_LOOKUP_GOAL_MS = 1.0  # the issue's: consulting the shared tier adds < 1 ms p50
MASTER_MAXMEMORY = 768 * MiB  # per master, above what the bench ever holds there
# A lookup does not read payloads, so its chains have tiny chunks (512 B); 16 tokens a
# chunk (vLLM's block), 128 chunks a chain.
LOOKUP_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=16)
LOOKUP_CHUNKS = 128
HELD_PUT_BATCH = 32  # lookup chains put between waits: 4096 blocks, half the write queue
VISIBLE_WITHIN_S = 5.0  # a chain not visible on B this long after A's put is a failure
DRAIN_WITHIN_S = 60.0


@dataclass(frozen=True)
class Settings:
    daemons: int
    chain_chunks: int  # 2 MiB chunks of each daemon's chain, per repetition
    reps: int
    warmup: int
    visibility_samples: int  # per mode
    lookup_samples: int  # per case

    @property
    def dram_bytes(self) -> int:
        # A daemon's own chain plus one it read from Redis (promoted), twice over.
        return max(256 * MiB, 4 * self.chain_chunks * SIZE.nbytes + 64 * MiB)


FULL = Settings(
    daemons=3, chain_chunks=32, reps=7, warmup=1, visibility_samples=40, lookup_samples=300
)
QUICK = Settings(
    daemons=2, chain_chunks=16, reps=3, warmup=1, visibility_samples=6, lookup_samples=60
)


# -- the hosts -------------------------------------------------------------------------


@dataclass
class Host:
    """One daemon, standing for one host: its clients, its stats, its chains' payloads."""

    name: str
    client: StoreClient  # the default over the Unix socket: gets through shared memory
    bytes_client: StoreClient  # transfer="bytes": gets as frames over the socket
    stats: DaemonStats
    chunks: list[torch.Tensor] = field(repr=False)  # the K/V of every chain it puts
    payloads: list[bytes] = field(repr=False)  # the same, as the raw clients write them

    def redis_counters(self) -> dict[str, int]:
        return self.stats.tier(REDIS)


def start_cluster(stack: ExitStack, root: Path) -> RedisCluster:
    """Three masters, each with ``maxmemory`` and ``allkeys-lru`` (what docs/multihost.md
    asks of a shared tier's servers), stopped when ``stack`` closes."""
    cluster = RedisCluster(root / "cluster")
    stack.callback(cluster.close)
    cluster.start()
    for node in cluster.nodes:
        for name, value in (
            ("maxmemory", str(MASTER_MAXMEMORY)),
            ("maxmemory-policy", "allkeys-lru"),
        ):
            reply = node.command("CONFIG", "SET", name, value)
            if not reply.startswith(b"+OK"):
                raise RuntimeError(f"CONFIG SET {name} on {node.port}: {reply!r}")
    return cluster


def daemon_spec(root: Path, dram_bytes: int, cluster: RedisCluster | None) -> DaemonSpec:
    """DRAM (prefaulted) and, with ``cluster``, the cluster as the shared tier."""
    tiers = f"[tiers.dram]\ncapacity = {dram_bytes}\nprefault = true\n"
    if cluster is not None:
        nodes = ", ".join(f'"{node}"' for node in cluster.startup_nodes)
        tiers += (
            f'\n[tiers.redis]\ncluster = true\nnodes = [{nodes}]\ncapacity = "4GiB"\n'
            'write = "through"\n'
        )
    return DaemonSpec(root, tiers=tiers, daemon={"flush_on_exit": False})


def start_hosts(
    stack: ExitStack, root: Path, cluster: RedisCluster, settings: Settings
) -> list[Host]:
    hosts = []
    for index in range(settings.daemons):
        spec = daemon_spec(root / f"host{index}", settings.dram_bytes, cluster)
        stack.enter_context(spec.process())
        stats = DaemonStats(spec.socket_path)
        stack.callback(stats.close)
        chunks = make_chunks(SIZE, settings.chain_chunks, seed=index)
        hosts.append(
            Host(
                f"host{index}",
                store_client(stack, spec.url),
                store_client(stack, spec.url, transfer="bytes"),
                stats,
                chunks,
                [chunk.view(torch.uint8).numpy().tobytes() for chunk in chunks],
            )
        )
    for host in hosts:
        host.stats.wait_prefaulted()
    return hosts


def wait_written(hosts: Sequence[Host], targets: Sequence[int], deadline_s: float) -> None:
    """Poll each daemon's ``/v1/stats`` until its ``write_through_written`` reaches its
    target; a block dropped (queue full) or refused by Redis fails the bench.

    /v1/stats has no "pending" figure, and ``queued - written - failed`` is not one:
    a copy the write-through skips (its block deleted meanwhile) is counted nowhere.
    So the bench waits for the count it knows it put."""
    deadline = time.monotonic() + deadline_s
    waiting = dict(enumerate(hosts))
    while waiting:
        for index, host in list(waiting.items()):
            counters = host.redis_counters()
            if counters["write_through_dropped"] or counters["write_through_failed"]:
                raise RuntimeError(f"{host.name}: write-through dropped or failed: {counters}")
            if counters["write_through_written"] >= targets[index]:
                del waiting[index]
        if waiting and time.monotonic() > deadline:
            late = {host.name: host.redis_counters() for host in waiting.values()}
            raise RuntimeError(f"write-through not done in {deadline_s:.0f} s: {late}")
        if waiting:
            time.sleep(0.002)


def written(hosts: Sequence[Host]) -> list[int]:
    return [host.redis_counters()["write_through_written"] for host in hosts]


# -- throughput ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Throughput(BatchThroughput):
    """The daemons' aggregate throughput against raw redis-py's, same bytes, same run."""

    daemons: int
    put_returned_s: float | None = None  # puts only: median time until every put returned

    def as_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "daemons": self.daemons,
            "chunk_bytes": self.chunk_bytes,
            "chunks": self.batch_chunks,
            "bytes": self.batch_bytes,
            "gbps": round(self.gbps, 4),
            "raw_gbps": round(self.ceiling_gbps, 4),
            "ratio": round(self.ratio, 4),
            "spread": [round(self.store.spread, 3), round(self.ceiling.spread, 3)],
            "goal": THROUGHPUT_GOAL,
            **(
                {}
                if self.put_returned_s is None
                else {"put_returned_ms": round(1e3 * self.put_returned_s, 1)}
            ),
        }


@dataclass
class Round:
    """One repetition's chains (``chains[i]`` put by host ``i``) and what it returned."""

    chains: list[Chain]
    written_before: list[int]  # each host's write_through_written before the puts
    results: list[Any] = field(default_factory=list)


class Bench:
    """The hosts, a raw cluster client per host (each used by one thread), and the
    threads that drive them all at once."""

    def __init__(self, hosts: list[Host], raws: list[RawRedisCluster], settings: Settings):
        self.hosts = hosts
        self.raws = raws
        self.settings = settings
        self.namespace = Namespace(f"bench-cluster-{SIZE.label}", SIZE.layout)
        self.space = KeySpace(self.namespace, settings.chain_chunks, seed=1)
        self.pool = ThreadPoolExecutor(max_workers=len(hosts), thread_name_prefix="bench-host")

    def all_at_once(self, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run call ``i`` on thread ``i``, all at once; their results, in order."""
        futures = [self.pool.submit(call) for call in calls]
        return [future.result() for future in futures]

    def fresh(self) -> Round:
        return Round([self.space.fresh() for _ in self.hosts], written(self.hosts))

    def keys_in_redis(self, chain: Chain) -> list[bytes]:
        return [redis_key(self.namespace, key) for key in chain.keys]

    def put_all(self, round_: Round) -> float:
        """Every host puts its chain of ``round_``, then wait for every write-through;
        when (``time.perf_counter``) the last put returned."""
        stored = self.all_at_once(
            [
                functools.partial(host.client.put, self.namespace, chain.tokens, host.chunks)
                for host, chain in zip(self.hosts, round_.chains, strict=True)
            ]
        )
        returned = time.perf_counter()
        if stored != [len(chain.keys) for chain in round_.chains]:
            raise RuntimeError(f"the puts stored {stored} chunks")
        targets = [
            count + len(chain.keys)
            for count, chain in zip(round_.written_before, round_.chains, strict=True)
        ]
        wait_written(self.hosts, targets, DRAIN_WITHIN_S)
        return returned

    def delete_all(self, round_: Round) -> None:
        """Every chain of ``round_`` deleted through every host (the owner's delete takes
        its Redis copy too; a reader's, the copy its get promoted to DRAM)."""
        for host in self.hosts:
            for chain in round_.chains:
                host.client.delete(self.namespace, chain.keys)

    def reader_of(self, index: int) -> int:
        """Host ``index`` reads the chain host ``index - 1`` put (never its own)."""
        return (index - 1) % len(self.hosts)

    # -- puts --------------------------------------------------------------------------

    def measure_puts(self) -> Throughput:
        returned: list[float] = []  # per repetition, warm-up first: until the puts returned

        def through_daemons(round_: Round) -> None:
            start = time.perf_counter()
            returned.append(self.put_all(round_) - start)

        def raw_keys() -> list[list[bytes]]:
            return [
                [b"raw:" + k for k in self.keys_in_redis(self.space.fresh())] for _ in self.hosts
            ]

        def raw_put(keys: list[list[bytes]]) -> None:
            self.all_at_once(
                [
                    functools.partial(raw.set_many, mine, host.payloads)
                    for raw, host, mine in zip(self.raws, self.hosts, keys, strict=True)
                ]
            )

        def raw_delete(keys: list[list[bytes]]) -> None:
            for mine in keys:
                self.raws[0].delete(mine)

        samples = time_interleaved(
            {
                "store": Case(run=through_daemons, before=self.fresh, after=self.delete_all),
                "raw": Case(run=raw_put, before=raw_keys, after=raw_delete),
            },
            self.settings.reps,
            warmup=self.settings.warmup,
        )
        return self._result(
            "put", samples, put_returned_s=percentile(returned[self.settings.warmup :], 0.5)
        )

    # -- gets --------------------------------------------------------------------------

    def measure_gets(self) -> list[Throughput]:
        """Gets of chains another daemon put, with either client, and raw GETs of the
        same Redis keys; every case puts its own fresh chains first (untimed)."""
        settings = self.settings
        counted_before = [host.redis_counters()["hits"] for host in self.hosts]

        def put_round() -> Round:
            round_ = self.fresh()
            self.put_all(round_)
            return round_

        def through(bytes_client: bool) -> Callable[[Round], None]:
            def run(round_: Round) -> None:
                round_.results = self.all_at_once(
                    [
                        functools.partial(
                            (host.bytes_client if bytes_client else host.client).get,
                            self.namespace,
                            round_.chains[self.reader_of(index)].keys,
                        )
                        for index, host in enumerate(self.hosts)
                    ]
                )

            return run

        def checked(round_: Round) -> None:
            for index, got in enumerate(round_.results):
                owner = self.hosts[self.reader_of(index)]
                payloads = [chunk.view(torch.uint8).numpy() for chunk in owner.chunks]
                check_chunks(self.hosts[index].name, got, payloads, full=True)
            round_.results = []
            self.delete_all(round_)

        def raw_get(round_: Round) -> None:
            round_.results = self.all_at_once(
                [
                    functools.partial(
                        raw.get_many, self.keys_in_redis(round_.chains[self.reader_of(index)])
                    )
                    for index, raw in enumerate(self.raws)
                ]
            )

        def raw_checked(round_: Round) -> None:
            if any(value is None for values in round_.results for value in values):
                raise RuntimeError("a raw GET missed a block the daemons had written")
            round_.results = []
            self.delete_all(round_)

        samples = time_interleaved(
            {
                "get": Case(run=through(False), before=put_round, after=checked),
                "get_bytes": Case(run=through(True), before=put_round, after=checked),
                "raw": Case(run=raw_get, before=put_round, after=raw_checked),
            },
            settings.reps,
            warmup=settings.warmup,
        )
        # Every get was served from Redis: each daemon read 2 chains a repetition there.
        expected = 2 * (settings.reps + settings.warmup) * settings.chain_chunks
        hits = [
            host.redis_counters()["hits"] - before
            for host, before in zip(self.hosts, counted_before, strict=True)
        ]
        if hits != [expected] * len(self.hosts):
            raise RuntimeError(f"Redis served {hits} chunks to the daemons, not {expected} each")
        return [
            self._result(op, {"store": samples[op], "raw": samples["raw"]})
            for op in ("get", "get_bytes")
        ]

    def _result(
        self, op: str, samples: dict[str, Sample], put_returned_s: float | None = None
    ) -> Throughput:
        return Throughput(
            op=op,
            chunk_bytes=SIZE.nbytes,
            batch_chunks=len(self.hosts) * self.settings.chain_chunks,
            store=samples["store"],
            ceiling=samples["raw"],
            daemons=len(self.hosts),
            put_returned_s=put_returned_s,
        )


# -- cross-host visibility -------------------------------------------------------------


class Look(enum.Enum):
    """When B looks for a chain A puts (the module docstring)."""

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


# -- the cost of consulting the shared tier --------------------------------------------


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


# -- output ----------------------------------------------------------------------------


OP_LABELS = {
    "put": "put (write-through)",
    "get": "get (shm client)",
    "get_bytes": "get (bytes client)",
}


def throughput_table(results: list[Throughput]) -> str:
    rows = [
        [
            OP_LABELS[r.op],
            r.daemons,
            f"{r.batch_chunks // r.daemons} x {SIZE.label}",
            f"{r.gbps:.2f}",
            f"{r.ceiling_gbps:.2f}",
            f"{r.ratio:.3f}",
            f"{r.store.spread:.0%}/{r.ceiling.spread:.0%}",
            verdict(r.ratio, THROUGHPUT_GOAL),
        ]
        for r in results
    ]
    return format_table(
        ["op", "daemons", "chain each", "GB/s", "raw GB/s", "ratio", "spread", "goal"], rows
    )


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


NOTES = [
    "One host = one kvstore serve (DRAM, prefaulted, + the Redis Cluster as its shared tier, "
    "write = 'through'), all on loopback and on the same CPUs as the cluster's 3 masters and "
    "the bench's clients.",
    "put: from the first client's put until every daemon's /v1/stats says its write-through "
    "copied the whole chain (polled every ~2 ms); raw: one thread per daemon, each its own "
    "redis-py RedisCluster, one pipeline of SETs of the same bytes (threads of one process: "
    "measured here as fast as one process each). The daemons' figure includes the puts into "
    "DRAM, and a block's copy starts only once its put is published: put_returned_ms is when "
    "the last put returned.",
    "get: each daemon's client gets the fresh chain the previous daemon put, so every chunk "
    "comes from Redis (checked: the daemons' Redis hit counters), is verified by the daemon "
    "and the client, and is promoted to the reader's DRAM; raw: the same threads pipelining "
    "GETs of the same Redis keys, checking nothing. The shm client (the default) asks for a "
    "lease first and then fetches the blocks DRAM does not hold as bytes: two requests.",
    "Visibility: A = the first daemon, B = the second; the chain is as long as a put's above. "
    "'landed' is when a raw EXISTS poll saw every block in Redis; a lookup before then finds "
    "part of the chain and the daemon takes the rest as missing for shared_miss_ttl_s (0.25 s).",
    "raw_exists: the peer, redis-py's own cluster pipeline of one EXISTS per key of a chain "
    "held in Redis, from the bench's process: what asking the cluster costs a redis-py client "
    "with nothing of the store around it (the daemon's tier sends each master's share as a "
    "plain pipeline on that master's connection, all masters at once).",
    "Lookups pass token ids (the client hashes them); 128 chunks of 16 tokens (tiny payloads: "
    "a lookup reads none). 'extra' = the case's percentile minus the local one's. The "
    "'no shared tier' row is a daemon with DRAM only: with a shared tier every lookup goes "
    "through a worker thread (TieredStore.lookup_nowait never answers on the event loop).",
    "EXISTS/GET/SET: what one call cost the masters (INFO commandstats, summed).",
]


def main(argv: list[str] | None = None) -> None:
    parser = bench_arguments(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    out: Callable[..., None] = log if args.json else print
    started = time.perf_counter()

    with bench_session() as stack:
        # Under /tmp: a Unix socket path must stay under 108 bytes.
        root = stack.enter_context(temp_dir("kvs-bench-cluster-", "/tmp"))
        cluster = start_cluster(stack, root)
        log(f"  cluster: masters on {', '.join(cluster.startup_nodes)}")
        hosts = start_hosts(stack, root, cluster, settings)
        solo_spec = daemon_spec(root / "solo", 64 * MiB, None)
        stack.enter_context(solo_spec.process())
        solo = store_client(stack, solo_spec.url)
        tier = TierConfig(
            TierKind.REDIS, capacity_bytes=1, cluster=True, nodes=tuple(cluster.startup_nodes)
        )
        raws = []
        for _ in hosts:
            raws.append(RawRedisCluster(cluster.startup_nodes, tier))
            stack.callback(raws[-1].close)
        bench = Bench(hosts, raws, settings)
        stack.callback(bench.pool.shutdown)
        chain_mib = settings.chain_chunks * SIZE.nbytes // MiB
        log(f"  puts: {len(hosts)} daemons x {chain_mib} MiB ...")
        results = [bench.measure_puts()]
        log(f"  gets: {len(hosts)} daemons x {chain_mib} MiB ...")
        results += bench.measure_gets()
        log(f"  cross-host visibility: {settings.visibility_samples} x {len(Look)} ...")
        visibility = measure_visibility(bench)
        log(f"  lookups: {settings.lookup_samples} x {len(LOOKUP_CASES)} ...")
        cost = measure_lookup_cost(bench, solo, cluster)
        for host in hosts:
            for client in (host.client, host.bytes_client):
                degraded = client.client_stats()
                if degraded.gets_failed or degraded.lookups_failed or degraded.corrupt_blocks:
                    raise RuntimeError(f"{host.name}: the client degraded: {degraded}")
    elapsed = time.perf_counter() - started

    mode = "quick" if args.quick else "full"
    out(throughput_table(results))
    out()
    out(visibility_table(visibility, settings.chain_chunks))
    out()
    out(lookup_table(cost))
    out()
    out("Redis commands of one call (EXISTS/GET/SET over the masters):")
    for name, counts in cost.commands.items():
        out(f"  {name}: {counts['exists']}/{counts['get']}/{counts['set']}")
    for note in NOTES:
        out(f"* {note}")
    out(
        f"{mode} run: {len(hosts)} daemons, chains of {settings.chain_chunks} x {SIZE.label}, "
        f"{settings.warmup} warmup + {settings.reps} timed reps; {elapsed:.1f} s"
    )
    if args.json:
        emit_json(
            {
                "machine": machine_info(),
                "config": {
                    "mode": mode,
                    "daemons": len(hosts),
                    "chain_chunks": settings.chain_chunks,
                    "chunk_bytes": SIZE.nbytes,
                    "reps": settings.reps,
                    "warmup": settings.warmup,
                    "dram_bytes": settings.dram_bytes,
                    "redis_masters": len(cluster.nodes),
                    "master_maxmemory": MASTER_MAXMEMORY,
                    "visibility_samples": settings.visibility_samples,
                    "lookup_samples": settings.lookup_samples,
                    "lookup_chunks": LOOKUP_CHUNKS,
                    "throughput_goal": THROUGHPUT_GOAL,
                    "extra_lookup_goal_ms": EXTRA_LOOKUP_GOAL_MS,
                },
                "throughput": [r.as_json() for r in results],
                "cross_host": {look.value: visibility_json(v) for look, v in visibility.items()},
                "lookup": lookup_json(cost),
                "redis_commands": cost.commands,
                "notes": NOTES,
                "elapsed_s": round(elapsed, 1),
            }
        )


if __name__ == "__main__":
    main()
