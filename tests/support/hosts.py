"""Several hosts, one cache: what the multi-host tests share.

::

    host h0 (netns)          host h1 (netns)          host h2 (netns)
    kvstore serve A          kvstore serve B          kvstore serve C
    DRAM, write-through      DRAM, write-through      DRAM, write-through
          │ eth0                   │ eth0                   │ eth0
    ──────┴────────────────────────┴───── bridge ───────────┴──────────
                                   │ gateway (root namespace)
             Redis Cluster: 3 masters + 3 replicas, bound and announced here

A daemon's config (``daemon_config``) names every cluster node at the
gateway's address and copies every put to Redis (``write = "through"``), so
what host A puts reaches host B through the cluster only: B's DRAM never
held it. Hits are not promoted into DRAM (``promote_on_hit = false``), so
every read on B goes to the cluster, which is what the fault tests need a
read to do. The tier's timeouts are short (0.5 s socket and connect): a
master that stops answering costs a read about that once, and then its
breaker answers for it (the masters' shares go one after another, so a cut
link costs the first read after it about three socket timeouts).

``Chain`` is what a test wrote (tokens, keys, the exact payload of each chunk);
``ReadLoop`` reads chains back on a thread of its own, bounded in reads and in
time, and records each read (``Read``): what hit, what missed, what came back
wrong, what raised. A wrong chunk is the one outcome no fault excuses.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

import kvstore
from kvstore.client.api import KVClientAPI
from kvstore.keys import ChunkKey, KVLayout, Namespace, chunk_keys
from kvstore.local.redis_cluster import RedisCluster
from kvstore.store.chunk import KVChunk
from support.daemon import Daemon
from support.redis_tiers import redis_key

# 2 KiB chunks: a read loop's batch of a few hundred stays well under the client's timeout.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=16)
CHAIN_CHUNKS = 4
SOCKET_TIMEOUT_S = 0.5
CONNECT_TIMEOUT_S = 0.5
VISIBLE_WITHIN_S = 5.0  # a put on one host is seen on another within this


def daemon_config(cluster: RedisCluster) -> str:
    """The store part of a host's config: DRAM, then the shared cluster, written through."""
    nodes = ", ".join(f'"{node}"' for node in cluster.startup_nodes)
    return (
        'data_dir = "{data_dir}"\n'
        "promote_on_hit = false\n\n"
        '[tiers.dram]\ncapacity = "64MiB"\n\n'
        '[tiers.redis]\ncapacity = "1GiB"\ncluster = true\n'
        f"nodes = [{nodes}]\n"
        'write = "through"\n'
        f"socket_timeout_s = {SOCKET_TIMEOUT_S}\nconnect_timeout_s = {CONNECT_TIMEOUT_S}\n"
    )


@contextlib.contextmanager
def connected(*daemons: Daemon) -> Iterator[list[KVClientAPI]]:
    """A client of each daemon (over its Unix socket, from the root namespace), closed
    on exit."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(kvstore.connect(daemon.url)) for daemon in daemons]


@dataclass(frozen=True)
class Chain:
    """One chain a host put: its tokens, its keys, and the exact payload of each chunk."""

    tokens: np.ndarray
    keys: tuple[ChunkKey, ...]
    payloads: tuple[bytes, ...]


def make_chains(
    namespace: Namespace, count: int, seed: int, payload_seed: int | None = None
) -> list[Chain]:
    """``count`` chains of ``CHAIN_CHUNKS`` chunks, none sharing a key: tokens drawn from
    ``seed``, random payloads from ``payload_seed`` (default: ``seed`` too), so the
    same tokens can be given other bytes."""
    layout = namespace.layout
    token_rng = np.random.default_rng([seed, 0])
    payload_rng = np.random.default_rng([seed if payload_seed is None else payload_seed, 1])
    chains = []
    for _ in range(count):
        tokens = token_rng.integers(0, 1 << 30, size=CHAIN_CHUNKS * layout.chunk_tokens)
        payloads = tuple(
            payload_rng.integers(0, 256, size=layout.chunk_nbytes, dtype=np.uint8).tobytes()
            for _ in range(CHAIN_CHUNKS)
        )
        chains.append(Chain(tokens, tuple(chunk_keys(namespace, tokens)), payloads))
    return chains


def put_chains(client: KVClientAPI, namespace: Namespace, chains: Sequence[Chain]) -> None:
    for chain in chains:
        assert client.put(namespace, chain.tokens, list(chain.payloads)) == CHAIN_CHUNKS


def shared_chains(
    writer: KVClientAPI, reader: KVClientAPI, namespace: Namespace, count: int, seed: int
) -> list[Chain]:
    """``count`` chains put through ``writer``, once ``reader`` (a daemon on another
    host) reads every one back exactly (``wait_visible``)."""
    chains = make_chains(namespace, count, seed)
    put_chains(writer, namespace, chains)
    wait_visible(reader, namespace, chains)
    return chains


def degraded_calls(client: KVClientAPI) -> int:
    """Calls ``client`` answered itself because the daemon did not (down, too slow, a
    5xx). Not ``corrupt_blocks``: a block the daemon announced and then found gone
    (evicted from Redis mid-get) is sent as zeros, by design, and counted there."""
    stats = client.client_stats()
    return stats.lookups_failed + stats.gets_failed + stats.puts_dropped


def wrong_chunks(chains: Sequence[Chain], got: Sequence[KVChunk | None]) -> int:
    """How many chunks of ``got`` (a get of every chain's keys, in order) are not None
    and not exactly what was put under their key."""
    expected = [
        (key, payload) for c in chains for key, payload in zip(c.keys, c.payloads, strict=True)
    ]
    return sum(
        chunk is not None and (chunk.key != key or bytes(chunk.payload) != payload)
        for (key, payload), chunk in zip(expected, got, strict=True)
    )


def all_keys(chains: Sequence[Chain]) -> list[ChunkKey]:
    return [key for chain in chains for key in chain.keys]


def wait_visible(
    client: KVClientAPI,
    namespace: Namespace,
    chains: Sequence[Chain],
    timeout_s: float = VISIBLE_WITHIN_S,
) -> float:
    """Seconds until every chain is found whole through ``client`` (another host's
    daemon) and reads back exactly; fails after ``timeout_s``."""
    started = time.monotonic()
    keys = all_keys(chains)
    while True:
        got = client.get(namespace, keys)
        assert wrong_chunks(chains, got) == 0
        if all(chunk is not None for chunk in got):
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            missing = sum(chunk is None for chunk in got)
            raise AssertionError(f"{missing} of {len(keys)} chunks unseen after {timeout_s} s")
        time.sleep(0.05)


def keys_on(
    cluster: RedisCluster, namespace: Namespace, port: int, chains: Sequence[Chain]
) -> frozenset[ChunkKey]:
    """The chunk keys of ``chains`` whose slot the master on ``port`` owns now."""
    return frozenset(
        key for key in all_keys(chains) if cluster.port_for_key(redis_key(namespace, key)) == port
    )


@dataclass(frozen=True, slots=True)
class Read:
    """One pass of a read loop: a lookup of one chain, then a get of every chain.

    ``at``: when it started (monotonic); ``seconds``: both calls together;
    ``found``: the chunks the lookup found; ``missed``: chunks the get answered
    None; ``watched_missed``: those among the watched keys; ``wrong``: chunks with
    other bytes or another key; ``raised``: a call raised out of the client (it
    must degrade instead)."""

    at: float
    seconds: float
    found: int = 0
    missed: int = 0
    watched_missed: int = 0
    wrong: int = 0
    raised: bool = False


@dataclass
class ReadLoop:
    """Reads ``chains`` through ``client`` until stopped, ``max_reads`` or ``max_s``.

    ``watched``: keys whose reads a test times (a killed master's, say). ``reads``
    is appended to by the loop's thread only; the test looks at copies of it while
    the loop runs (``wait_for``) and at the list itself after ``stop()``.
    """

    client: KVClientAPI
    namespace: Namespace
    chains: Sequence[Chain]
    watched: frozenset[ChunkKey] = frozenset()
    pace_s: float = 0.02
    max_reads: int = 2000
    max_s: float = 30.0
    reads: list[Read] = field(default_factory=list, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="read-loop", daemon=True)
        self._thread.start()

    def stop(self) -> list[Read]:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=self.max_s + 10)
        assert not self._thread.is_alive(), "the read loop did not stop"
        return self.reads

    def _run(self) -> None:
        keys = all_keys(self.chains)
        watched = [key in self.watched for key in keys]
        until = time.monotonic() + self.max_s
        for index in range(self.max_reads):
            if self._stop.is_set() or time.monotonic() > until:
                return
            chain = self.chains[index % len(self.chains)]
            started = time.monotonic()
            try:
                found = self.client.lookup(self.namespace, chain.tokens).num_chunks
                got = self.client.get(self.namespace, keys)
            except Exception:  # noqa: BLE001 - anything out of the client is a failure
                self.reads.append(Read(started, time.monotonic() - started, raised=True))
                continue
            missing = [chunk is None for chunk in got]
            self.reads.append(
                Read(
                    started,
                    time.monotonic() - started,
                    found=found,
                    missed=sum(missing),
                    watched_missed=sum(m and w for m, w in zip(missing, watched, strict=True)),
                    wrong=wrong_chunks(self.chains, got),
                    raised=False,
                )
            )
            self._stop.wait(self.pace_s)

    def wait_for(self, done: Callable[[list[Read]], bool], timeout_s: float) -> bool:
        """Wait until ``done(reads so far)``, at most ``timeout_s``; whether it came."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if done(list(self.reads)):
                return True
            time.sleep(0.05)
        return False


@contextlib.contextmanager
def reading(loop: ReadLoop) -> Iterator[ReadLoop]:
    """``loop`` running for the block, stopped after it (also on failure)."""
    loop.start()
    try:
        yield loop
    finally:
        loop.stop()


def recovered_at(reads: Sequence[Read], since: float) -> float | None:
    """When the reads started hitting every watched key again for good: the start of the
    first read after ``since`` from which no read missed one; None if the last did."""
    recovered = None
    for read in reads:
        if read.at < since:
            continue
        if read.raised or read.watched_missed:
            recovered = None
        elif recovered is None:
            recovered = read.at
    return recovered
