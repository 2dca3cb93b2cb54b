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

The hosts and ``Bench`` are ``cluster_hosts.py``; the visibility and lookup figures
are measured in ``cluster_visibility.py`` and ``cluster_lookups.py``; this module
measures throughput and prints every figure.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ceilings import RawRedisCluster  # noqa: E402
from cluster_hosts import (  # noqa: E402
    FULL,
    MASTER_MAXMEMORY,
    QUICK,
    SIZE,
    Bench,
    Round,
    daemon_spec,
    start_cluster,
    start_hosts,
)
from cluster_lookups import (  # noqa: E402
    EXTRA_LOOKUP_GOAL_MS,
    LOOKUP_CASES,
    LOOKUP_CHUNKS,
    lookup_json,
    lookup_table,
    measure_lookup_cost,
)
from cluster_visibility import (  # noqa: E402
    Look,
    measure_visibility,
    visibility_json,
    visibility_table,
)
from common import (  # noqa: E402
    BatchThroughput,
    Case,
    MiB,
    Sample,
    bench_arguments,
    bench_session,
    check_chunks,
    emit_json,
    format_table,
    log,
    machine_info,
    percentile,
    store_client,
    temp_dir,
    time_interleaved,
    verdict,
)

from kvstore.kinds import TierKind  # noqa: E402
from kvstore.tiers.registry import TierConfig  # noqa: E402

THROUGHPUT_GOAL = 0.8  # the issue's: aggregate store throughput over raw redis-py


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


# -- puts ------------------------------------------------------------------------------


def measure_puts(bench: Bench) -> Throughput:
    returned: list[float] = []  # per repetition, warm-up first: until the puts returned

    def through_daemons(round_: Round) -> None:
        start = time.perf_counter()
        returned.append(bench.put_all(round_) - start)

    def raw_keys() -> list[list[bytes]]:
        return [
            [b"raw:" + k for k in bench.keys_in_redis(bench.space.fresh())] for _ in bench.hosts
        ]

    def raw_put(keys: list[list[bytes]]) -> None:
        bench.all_at_once(
            [
                functools.partial(raw.set_many, mine, host.payloads)
                for raw, host, mine in zip(bench.raws, bench.hosts, keys, strict=True)
            ]
        )

    def raw_delete(keys: list[list[bytes]]) -> None:
        for mine in keys:
            bench.raws[0].delete(mine)

    samples = time_interleaved(
        {
            "store": Case(run=through_daemons, before=bench.fresh, after=bench.delete_all),
            "raw": Case(run=raw_put, before=raw_keys, after=raw_delete),
        },
        bench.settings.reps,
        warmup=bench.settings.warmup,
    )
    return throughput(
        bench, "put", samples, put_returned_s=percentile(returned[bench.settings.warmup :], 0.5)
    )


# -- gets ------------------------------------------------------------------------------


def measure_gets(bench: Bench) -> list[Throughput]:
    """Gets of chains another daemon put, with either client, and raw GETs of the
    same Redis keys; every case puts its own fresh chains first (untimed)."""
    settings = bench.settings
    counted_before = [host.redis_counters()["hits"] for host in bench.hosts]

    def put_round() -> Round:
        round_ = bench.fresh()
        bench.put_all(round_)
        return round_

    def through(bytes_client: bool) -> Callable[[Round], None]:
        def run(round_: Round) -> None:
            round_.results = bench.all_at_once(
                [
                    functools.partial(
                        (host.bytes_client if bytes_client else host.client).get,
                        bench.namespace,
                        round_.chains[bench.reader_of(index)].keys,
                    )
                    for index, host in enumerate(bench.hosts)
                ]
            )

        return run

    def checked(round_: Round) -> None:
        for index, got in enumerate(round_.results):
            owner = bench.hosts[bench.reader_of(index)]
            payloads = [chunk.view(torch.uint8).numpy() for chunk in owner.chunks]
            check_chunks(bench.hosts[index].name, got, payloads, full=True)
        round_.results = []
        bench.delete_all(round_)

    def raw_get(round_: Round) -> None:
        round_.results = bench.all_at_once(
            [
                functools.partial(
                    raw.get_many, bench.keys_in_redis(round_.chains[bench.reader_of(index)])
                )
                for index, raw in enumerate(bench.raws)
            ]
        )

    def raw_checked(round_: Round) -> None:
        if any(value is None for values in round_.results for value in values):
            raise RuntimeError("a raw GET missed a block the daemons had written")
        round_.results = []
        bench.delete_all(round_)

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
        for host, before in zip(bench.hosts, counted_before, strict=True)
    ]
    if hits != [expected] * len(bench.hosts):
        raise RuntimeError(f"Redis served {hits} chunks to the daemons, not {expected} each")
    return [
        throughput(bench, op, {"store": samples[op], "raw": samples["raw"]})
        for op in ("get", "get_bytes")
    ]


def throughput(
    bench: Bench, op: str, samples: dict[str, Sample], put_returned_s: float | None = None
) -> Throughput:
    return Throughput(
        op=op,
        chunk_bytes=SIZE.nbytes,
        batch_chunks=len(bench.hosts) * bench.settings.chain_chunks,
        store=samples["store"],
        ceiling=samples["raw"],
        daemons=len(bench.hosts),
        put_returned_s=put_returned_s,
    )


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
        results = [measure_puts(bench)]
        log(f"  gets: {len(hosts)} daemons x {chain_mib} MiB ...")
        results += measure_gets(bench)
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
