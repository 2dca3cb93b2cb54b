"""Redis slow, hung, reset, throttled or half-open under a running daemon: every read
is right or a miss, DRAM hits do not notice, and Redis is used again once it is back.

::

    client ──unix──► kvstore serve ──► DRAM (8 MiB: the newest chains)
     2 threads                    └──► Redis tier ──► FaultProxy ──► redis-server
     (DRAM-held, Redis-held gets)      0.5 s socket, 0.5 s connect timeout

The daemon holds a known set of chains: the newest in DRAM, the oldest
written down to Redis by eviction (placement checked with ``lookup``; no
promotion on hit, so it stays put). Then, for each fault (``CASES``), for one
window (short form) or ``scale.cycles`` windows: one thread gets DRAM-held
chains and another looks up and gets Redis-held ones, at a steady pace, while
the proxy misbehaves; every chunk read is compared byte for byte with what was
written. The fault is cleared and the Redis-held chain is read until it is
served from Redis again (the recovery time).

The bounds expected, and reported next to the figures:

* **Deadline**: a call that meets a failing Redis costs at most about
  ``connect_timeout_s + socket_timeout_s`` (``DEADLINE_S``, 1 s): the Redis
  tier never retries after a timeout (``tiers/redis_tier.py``). That first
  failure opens the tier's breaker (``kvstore.store.breaker``), and from then
  on a Redis-held get is answered as a miss at once, without touching Redis.
  ``over_deadline`` counts requests slower than ``DEADLINE_S + EPSILON_S``.
* **Recovery**: the breaker's probe asks again after 0.5 s, doubling while
  Redis stays down, to ``breaker_max_open_s`` (10 s); so recovery takes at
  most about that plus one deadline (``RECOVERY_LIMIT_S``).
* **DRAM hits**: unchanged; ``dram_p99_ratio`` is the DRAM-hit p99 during a
  fault over the one before any fault (should be at most 2).

Then the same against a real three-master Redis Cluster, with the proxy in
front of ONE master only. A cluster node tells clients its own address (in
``CLUSTER SLOTS`` and in ``MOVED``), so a proxy in front of it would be
bypassed; here the master announces the proxy's port instead
(``CONFIG SET cluster-announce-port``; ``cluster-announce-bus-port`` keeps the
cluster bus on the real port, so the masters keep seeing each other and the
cluster stays ``ok``). Clients then reach that master only through the proxy,
and its faults are the network's, not the server's. Only chunks on that
master are expected to degrade; ``healthy_master_chunks_missed`` counts the
others. A master that fails alone does not open the tier's breaker (the
other masters answer: ``tiers/redis_tier.py`` fails only its share of a
batch), so each batch touching it pays its timeout again.

Figures that must be zero: ``wrong_bytes`` (a chunk read back that differs
from what was written), ``errors_raised_to_client`` (the client must degrade,
never raise), ``dram_held_not_from_dram`` (a DRAM-held read not served whole
from DRAM during any fault), ``modes_not_recovered`` and ``modes_skipped``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from common import redis_key

import kvstore
from faults.campaign import SHORT, DaemonSpec, Report, Scale
from faults.proxy import Fault, FaultProxy
from kvstore.client.api import KVClientAPI
from kvstore.keys import ChunkKey, KVLayout, Namespace, chunk_keys
from kvstore.kinds import TierKind
from kvstore.local.processes import CLUSTER_BUS_OFFSET, HOST
from kvstore.local.redis_cluster import RedisCluster
from kvstore.local.redis_server import RedisServer
from kvstore.store.chunk import KVChunk

SCENARIO = "redis_faults"

# 64 KiB chunks (fp16: 4 layers x K,V x 16 tokens x 4 heads x 64): 120 fit in 8 MiB
# of DRAM, so of 48 chains of 4 the oldest 18 or so are written down to Redis.
LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", chunk_tokens=16)
CHAIN_CHUNKS = 4
CHAINS = 48
DRAM_CAPACITY = "8MiB"
MIN_CHAINS_EACH = 4  # DRAM-held and Redis-held chains a run needs, at least

SOCKET_TIMEOUT_S = 0.5
CONNECT_TIMEOUT_S = 0.5
BREAKER_MIN_OPEN_S = 0.5  # the store's defaults, written out so the figures name them
BREAKER_MAX_OPEN_S = 10.0
DEADLINE_S = SOCKET_TIMEOUT_S + CONNECT_TIMEOUT_S
EPSILON_S = 0.25  # scheduling, the daemon's HTTP hop, a shared machine
RECOVERY_LIMIT_S = BREAKER_MAX_OPEN_S + DEADLINE_S + 2.0
RECOVERY_POLL_S = 0.05
# A mode is skipped (and the run fails) unless a window and this much more are left.
MIN_RECOVERY_TIME_S = 2.0
# Each driver thread sends a request every PACE_S: a window of ``scale.requests``
# requests lasts requests x PACE_S (1.2 s short), long enough for a probe; where
# requests are slower than the pace, a window ends after WINDOW_PACES paces anyway.
PACE_S = 0.03
WINDOW_PACES = 2.0


@dataclass(frozen=True)
class FaultCase:
    """One fault mode as the proxy is set for it."""

    name: str
    fault: Fault
    delay_s: float = 0.0
    bytes_per_s: int = 0


CASES = (
    # 0.05 s each way: a round trip of 0.1 s, under the socket timeout (slow, served).
    FaultCase("latency", Fault.LATENCY, delay_s=0.05),
    FaultCase("stall", Fault.STALL),
    FaultCase("reset", Fault.RESET),
    # 2 MB/s each way: a chain of 256 KiB takes ~0.13 s (slow, served).
    FaultCase("bandwidth", Fault.BANDWIDTH, bytes_per_s=2_000_000),
    FaultCase("half_open", Fault.HALF_OPEN),
)
# The short form's cluster part: a hung master and a dead one.
SHORT_CLUSTER_CASES = ("stall", "reset")


# -- the data written, and what reading it back found ---------------------------------


@dataclass(frozen=True)
class Chain:
    """One chain the scenario wrote: its tokens, keys and the exact payload of each."""

    tokens: np.ndarray
    keys: tuple[ChunkKey, ...]
    payloads: tuple[bytes, ...]


@dataclass
class Corpus:
    """What the daemon holds, by where it was placed; ``behind_proxy``: the Redis-held
    chunks whose reads go through the proxy (all of them, or one master's)."""

    namespace: Namespace
    dram_held: list[Chain]
    redis_held: list[Chain]
    behind_proxy: frozenset[ChunkKey] = frozenset()


@dataclass(frozen=True, slots=True)
class Read:
    """One request and what came back. ``source``: ``dram`` or ``redis`` (the slowest
    tier that served a chunk), or ``miss`` if any chunk was missing."""

    held: str  # "dram" or "redis": where the chain was placed
    op: str  # "get" or "lookup"
    seconds: float
    source: str = "miss"
    wrong_chunks: int = 0
    raised: bool = False
    proxied_chunks: int = 0  # chunks behind the proxy asked for...
    proxied_missed: int = 0  # ...and answered as misses
    other_missed: int = 0  # Redis-held chunks not behind the proxy, missed


def _write(client: KVClientAPI, namespace: Namespace, seed: int) -> list[Chain]:
    rng = np.random.default_rng(seed)
    chains = []
    for index in range(CHAINS):
        tokens = np.arange(CHAIN_CHUNKS * LAYOUT.chunk_tokens, dtype=np.int64) + index * 100_000
        payloads = tuple(
            rng.integers(0, 256, size=LAYOUT.chunk_nbytes, dtype=np.uint8).tobytes()
            for _ in range(CHAIN_CHUNKS)
        )
        client.put(namespace, tokens, list(payloads))
        chains.append(Chain(tokens, tuple(chunk_keys(namespace, tokens)), payloads))
    return chains


def _placed(client: KVClientAPI, namespace: Namespace, chains: Sequence[Chain]) -> Corpus:
    """The chains held whole in DRAM and those held whole in Redis (``lookup``)."""
    by_tier: dict[TierKind, list[Chain]] = {TierKind.DRAM: [], TierKind.REDIS: []}
    for chain in chains:
        tiers = set(client.lookup(namespace, chain.tokens).tiers)
        if len(tiers) == 1 and (tier := tiers.pop()) in by_tier:
            by_tier[tier].append(chain)
    corpus = Corpus(namespace, by_tier[TierKind.DRAM], by_tier[TierKind.REDIS])
    if min(len(corpus.dram_held), len(corpus.redis_held)) < MIN_CHAINS_EACH:
        raise RuntimeError(
            f"placement gave {len(corpus.dram_held)} DRAM-held and {len(corpus.redis_held)} "
            f"Redis-held chains; the scenario needs {MIN_CHAINS_EACH} of each"
        )
    return corpus


def _checked(corpus: Corpus, chain: Chain, held: str, seconds: float, got: Sequence[Any]) -> Read:
    """A get's answer against what was written: right, missing, or wrong."""
    wrong = proxied = proxied_missed = other_missed = 0
    sources: set[TierKind] = set()
    for key, payload, chunk in zip(chain.keys, chain.payloads, got, strict=True):
        behind = key in corpus.behind_proxy
        proxied += behind
        if chunk is None:
            proxied_missed += behind
            other_missed += held == "redis" and not behind
            continue
        assert isinstance(chunk, KVChunk)
        if chunk.key != key or bytes(chunk.payload) != payload:
            wrong += 1
        sources.add(chunk.tier)
    missing = sum(chunk is None for chunk in got)
    source = "miss" if missing else max(sources).label if sources else "miss"
    return Read(held, "get", seconds, source, wrong, False, proxied, proxied_missed, other_missed)


# -- driving requests ----------------------------------------------------------------


def _timed(call: Callable[..., Any], *args: Any) -> tuple[float, Any, bool]:
    """``call(*args)``'s seconds, result and ``False``; or seconds, ``None`` and ``True``
    if it raised."""
    started = time.monotonic()
    try:
        result = call(*args)
    except Exception:  # noqa: BLE001 - any exception out of the client is a failure
        return time.monotonic() - started, None, True
    return time.monotonic() - started, result, False


def _drive(
    client: KVClientAPI, corpus: Corpus, held: str, requests: int, until: float
) -> list[Read]:
    """``requests`` reads of the ``held`` chains in turn, one every ``PACE_S``; for
    Redis-held chains a lookup too, as an engine asks before it loads."""
    chains = corpus.dram_held if held == "dram" else corpus.redis_held
    reads: list[Read] = []
    next_at = time.monotonic()
    for index in range(requests):
        if time.monotonic() >= until:
            break
        chain = chains[index % len(chains)]
        if held == "redis":
            seconds, prefix, raised = _timed(client.lookup, corpus.namespace, chain.tokens)
            whole = not raised and prefix.num_chunks == CHAIN_CHUNKS
            reads.append(Read(held, "lookup", seconds, "redis" if whole else "miss", raised=raised))
        seconds, got, raised = _timed(client.get, corpus.namespace, list(chain.keys))
        if raised:
            reads.append(Read(held, "get", seconds, raised=True))
        else:
            reads.append(_checked(corpus, chain, held, seconds, got))
        next_at += PACE_S
        time.sleep(max(0.0, next_at - time.monotonic()))
    return reads


def _window(client: KVClientAPI, corpus: Corpus, requests: int, until: float) -> list[Read]:
    """DRAM-held and Redis-held reads at once, on two threads (a hung Redis read
    must not hold up a DRAM hit)."""
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="redis-faults") as pool:
        drivers = [
            pool.submit(_drive, client, corpus, held, requests, until) for held in ("dram", "redis")
        ]
        return [read for driver in drivers for read in driver.result()]


def _recovery_s(client: KVClientAPI, corpus: Corpus) -> float | None:
    """Seconds until a Redis-held chain's chunks behind the proxy are served from
    Redis again; ``None`` if not within ``RECOVERY_LIMIT_S``. Always given the whole
    limit, whatever is left of the scenario's time: a recovery cut short by the
    scenario's own clock would read as one that never came."""
    chain = next(c for c in corpus.redis_held if corpus.behind_proxy.intersection(c.keys))
    started = time.monotonic()
    give_up = started + RECOVERY_LIMIT_S
    while time.monotonic() < give_up:
        _, got, raised = _timed(client.get, corpus.namespace, list(chain.keys))
        if not raised and all(
            chunk is not None and chunk.tier is TierKind.REDIS
            for key, chunk in zip(chain.keys, got, strict=True)
            if key in corpus.behind_proxy
        ):
            return time.monotonic() - started
        time.sleep(RECOVERY_POLL_S)
    return None


# -- figures ---------------------------------------------------------------------------


def _percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def _latency_ms(seconds: Sequence[float]) -> dict[str, float | int]:
    if not seconds:
        return {"n": 0}
    return {
        "n": len(seconds),
        "p50": round(_percentile(seconds, 0.50) * 1e3, 2),
        "p99": round(_percentile(seconds, 0.99) * 1e3, 2),
        "max": round(max(seconds) * 1e3, 2),
    }


def _dram_p99_s(reads: Sequence[Read]) -> float | None:
    hits = [r.seconds for r in reads if r.op == "get" and r.held == "dram" and r.source == "dram"]
    return _percentile(hits, 0.99) if hits else None


def _summary(reads: Sequence[Read], baseline_dram_p99_s: float | None) -> dict[str, Any]:
    """A mode's figures from its reads (see the module docstring)."""
    gets = [r for r in reads if r.op == "get" and not r.raised]
    redis_gets = [r for r in gets if r.held == "redis"]
    proxied = sum(r.proxied_chunks for r in redis_gets)
    dram_p99 = _dram_p99_s(reads)
    ratio = (
        round(dram_p99 / baseline_dram_p99_s, 2)
        if dram_p99 is not None and baseline_dram_p99_s
        else None
    )
    return {
        "get_ms": {
            source: _latency_ms([r.seconds for r in gets if r.source == source])
            for source in ("dram", "redis", "miss")
        },
        "redis_held_lookup_ms": _latency_ms([r.seconds for r in reads if r.op == "lookup"]),
        "redis_held_gets": len(redis_gets),
        "redis_held_degraded_share": round(
            sum(r.source == "miss" for r in redis_gets) / len(redis_gets), 3
        )
        if redis_gets
        else None,
        "proxied_chunks_degraded_share": round(
            sum(r.proxied_missed for r in redis_gets) / proxied, 3
        )
        if proxied
        else None,
        "healthy_master_chunks_missed": sum(r.other_missed for r in redis_gets),
        "max_ms": round(max((r.seconds for r in reads), default=0.0) * 1e3, 2),
        "over_deadline": sum(r.seconds > DEADLINE_S + EPSILON_S for r in reads),
        "dram_p99_ratio": ratio,
        "dram_held_not_from_dram": sum(r.held == "dram" and r.source != "dram" for r in gets),
        "wrong_bytes": sum(r.wrong_chunks for r in reads),
        "errors_raised_to_client": sum(r.raised for r in reads),
    }


@dataclass
class Totals:
    """The must-be-zero figures, summed over every mode of every target."""

    wrong_bytes: int = 0
    errors_raised_to_client: int = 0
    dram_held_not_from_dram: int = 0
    modes_not_recovered: int = 0
    modes_skipped: int = 0
    skipped: list[str] = field(default_factory=list)

    def add(self, figures: dict[str, Any]) -> None:
        self.wrong_bytes += figures["wrong_bytes"]
        self.errors_raised_to_client += figures["errors_raised_to_client"]
        self.dram_held_not_from_dram += figures["dram_held_not_from_dram"]
        self.modes_not_recovered += figures["recovery_s"] is None


# -- one target (a standalone Redis, or one master of a cluster) -----------------------


def _redis_counters(client: KVClientAPI) -> dict[str, int]:
    """The daemon's Redis tier counters that say what the breaker did."""
    with contextlib.suppress(Exception):
        tier = client.stats().tiers[TierKind.REDIS]
        return {"breaker_trips": tier.breaker_trips, "calls_refused": tier.calls_refused}
    return {"breaker_trips": -1, "calls_refused": -1}


def _windows(scale: Scale) -> int:
    """Fault windows per mode: one in the short form (the test's budget), else cycles."""
    return 1 if scale.name == SHORT.name else scale.cycles


def _faults(
    client: KVClientAPI,
    corpus: Corpus,
    proxy: FaultProxy,
    cases: Sequence[FaultCase],
    scale: Scale,
    until: float,
    totals: Totals,
    label: str,
) -> dict[str, Any]:
    """A baseline window, then each case's windows and recovery; its figures."""
    figures: dict[str, Any] = {}
    baseline = _window(client, corpus, scale.requests, until)
    baseline_p99 = _dram_p99_s(baseline)
    figures["baseline"] = _summary(baseline, baseline_p99)
    totals.add({**figures["baseline"], "recovery_s": 0.0})
    for position, case in enumerate(cases):
        started = time.monotonic()
        # This mode's share of the time left, so every mode gets its turn.
        mode_until = started + (until - started) / (len(cases) - position)
        if until - started < scale.requests * PACE_S + MIN_RECOVERY_TIME_S:
            totals.modes_skipped += 1
            totals.skipped.append(f"{label}:{case.name}")
            continue
        before = _redis_counters(client)
        degraded_before = client.client_stats()
        reads: list[Read] = []
        recovery: float | None = None
        for window in range(_windows(scale)):
            if window and time.monotonic() >= mode_until:
                break
            proxy.set(case.fault, delay_s=case.delay_s, bytes_per_s=case.bytes_per_s)
            try:
                window_s = WINDOW_PACES * scale.requests * PACE_S
                window_until = min(mode_until, time.monotonic() + window_s)
                reads += _window(client, corpus, scale.requests, window_until)
            finally:
                proxy.clear()
            recovery = _recovery_s(client, corpus)
            if recovery is None:
                break
        after = _redis_counters(client)
        degraded_after = client.client_stats()
        mode = _summary(reads, baseline_p99)
        mode["recovery_s"] = None if recovery is None else round(recovery, 2)
        mode["breaker_trips"] = after["breaker_trips"] - before["breaker_trips"]
        mode["calls_refused"] = after["calls_refused"] - before["calls_refused"]
        # Calls the client answered itself: the daemon did not answer in time.
        mode["client_degraded_calls"] = (
            degraded_after.gets_failed
            - degraded_before.gets_failed
            + degraded_after.lookups_failed
            - degraded_before.lookups_failed
        )
        figures[case.name] = mode
        totals.add(mode)
    return figures


def _daemon(root: Path, redis_table: str) -> DaemonSpec:
    return DaemonSpec(
        root,
        tiers=(
            f'[tiers.dram]\ncapacity = "{DRAM_CAPACITY}"\n\n[tiers.redis]\n'
            f'capacity = "256MiB"\n{redis_table}'
            f"socket_timeout_s = {SOCKET_TIMEOUT_S}\nconnect_timeout_s = {CONNECT_TIMEOUT_S}\n"
        ),
        store={
            # A Redis hit stays a Redis hit, so placement is the same in every window.
            "promote_on_hit": False,
            "breaker_min_open_s": BREAKER_MIN_OPEN_S,
            "breaker_max_open_s": BREAKER_MAX_OPEN_S,
        },
    )


@contextlib.contextmanager
def _serving(spec: DaemonSpec, seed: int) -> Iterator[tuple[KVClientAPI, Corpus]]:
    """The daemon started, the chains written, placement checked."""
    namespace = Namespace("redis-faults", LAYOUT)
    with spec.process(), contextlib.closing(kvstore.connect(spec.url)) as client:
        chains = _write(client, namespace, seed)
        yield client, _placed(client, namespace, chains)


def _standalone(scale: Scale, workdir: Path, until: float, totals: Totals) -> dict[str, Any]:
    with (
        RedisServer(workdir / "redis") as server,
        FaultProxy(server.port) as proxy,
        _serving(_daemon(workdir / "daemon", f'url = "redis://{proxy.address}/0"\n'), seed=1) as (
            client,
            corpus,
        ),
    ):
        corpus.behind_proxy = frozenset(k for c in corpus.redis_held for k in c.keys)
        return _faults(client, corpus, proxy, CASES, scale, until, totals, "standalone")


def _announce_through(cluster: RedisCluster, master: RedisServer, proxy: FaultProxy) -> None:
    """Make ``master`` tell clients the proxy's port, keeping its bus port; wait until
    every master's view of the cluster says so."""
    for name, port in (
        ("cluster-announce-bus-port", master.port + CLUSTER_BUS_OFFSET),
        ("cluster-announce-port", proxy.port),
    ):
        reply = master.command("CONFIG", "SET", name, str(port))
        if not reply.startswith(b"+OK"):
            raise RuntimeError(f"CONFIG SET {name} failed: {reply!r}")
    announced = f"{HOST}:{proxy.port}@".encode()
    deadline = time.monotonic() + 15.0
    while not all(announced in node.command("CLUSTER", "NODES") for node in cluster.nodes):
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster did not learn the proxy's address")
        time.sleep(0.05)


def _cluster(scale: Scale, workdir: Path, until: float, totals: Totals) -> dict[str, Any]:
    cluster = RedisCluster(workdir / "cluster")
    try:
        cluster.start()
        victim, healthy = cluster.nodes[0], cluster.nodes[1:]
        with FaultProxy(victim.port) as proxy:
            _announce_through(cluster, victim, proxy)
            nodes = [f"{HOST}:{node.port}" for node in healthy] + [proxy.address]
            table = "cluster = true\nnodes = [" + ", ".join(f'"{n}"' for n in nodes) + "]\n"
            with _serving(_daemon(workdir / "cluster-daemon", table), seed=2) as (
                client,
                corpus,
            ):
                corpus.behind_proxy = frozenset(
                    key
                    for chain in corpus.redis_held
                    for key in chain.keys
                    if cluster.port_for_key(redis_key(corpus.namespace, key)) == victim.port
                )
                if not corpus.behind_proxy:
                    raise RuntimeError("no Redis-held chunk is on the proxied master")
                names = SHORT_CLUSTER_CASES if scale.name == SHORT.name else None
                cases = [case for case in CASES if names is None or case.name in names]
                figures = _faults(client, corpus, proxy, cases, scale, until, totals, "cluster")
                figures["proxied_master_chunks"] = len(corpus.behind_proxy)
                return figures
    finally:
        cluster.close()


def run(scale: Scale, workdir: Path) -> Report:
    """The scenario at ``scale``: a standalone Redis behind the proxy, then one master
    of a cluster behind it (see the module docstring)."""
    until = scale.until()
    totals = Totals()
    # The standalone part first, with about 60% of the time: it runs every mode.
    standalone_until = time.monotonic() + 0.6 * scale.seconds
    figures: dict[str, Any] = {
        "deadline_ms": DEADLINE_S * 1e3,
        "epsilon_ms": EPSILON_S * 1e3,
        "recovery_limit_s": RECOVERY_LIMIT_S,
        "socket_timeout_s": SOCKET_TIMEOUT_S,
        "connect_timeout_s": CONNECT_TIMEOUT_S,
        "breaker_open_s": [BREAKER_MIN_OPEN_S, BREAKER_MAX_OPEN_S],
        "windows_per_mode": _windows(scale),
        "requests_per_window": scale.requests,
    }
    figures["standalone"] = _standalone(scale, workdir / "standalone", standalone_until, totals)
    figures["cluster"] = _cluster(scale, workdir / "cluster", until, totals)
    figures.update(
        wrong_bytes=totals.wrong_bytes,
        errors_raised_to_client=totals.errors_raised_to_client,
        dram_held_not_from_dram=totals.dram_held_not_from_dram,
        modes_not_recovered=totals.modes_not_recovered,
        modes_skipped=totals.modes_skipped,
        skipped=totals.skipped,
    )
    return Report(
        SCENARIO,
        figures,
        must_be_zero=(
            "wrong_bytes",
            "errors_raised_to_client",
            "dram_held_not_from_dram",
            "modes_not_recovered",
            "modes_skipped",
        ),
    )
