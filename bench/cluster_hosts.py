"""The hosts of ``bench/cluster.py``: a real 3-master Redis Cluster, the daemons that
share it as their shared tier (one daemon stands for one host), and ``Bench``, which
drives them all at once from one thread per host. Each figure's module measures with
these: ``cluster.py`` (throughput), ``cluster_visibility.py``, ``cluster_lookups.py``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ceilings import RawRedisCluster
from common import (
    CHUNK_2MIB,
    Chain,
    DaemonStats,
    KeySpace,
    MiB,
    make_chunks,
    redis_key,
    store_client,
)
from faults.campaign import DaemonSpec

from kvstore.client import StoreClient
from kvstore.keys import Namespace
from kvstore.kinds import TierKind
from kvstore.local.redis_cluster import RedisCluster

SIZE = CHUNK_2MIB
REDIS = TierKind.REDIS.label
MASTER_MAXMEMORY = 768 * MiB  # per master, above what the bench ever holds there
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
