"""The per-tier circuit breaker: one failure opens it, a probe on its own thread closes
it, and while it is open a hung Redis costs a DRAM hit nothing (a real, SIGSTOPped
redis-server)."""

from __future__ import annotations

import threading
import time

import numpy as np
from support import kv
from support.redis_servers import RedisServer

from kvstore.breaker import BreakerConfig, CircuitBreaker
from kvstore.kinds import TierKind
from kvstore.store.tiered_store import TieredStore

DRAM, REDIS = TierKind.DRAM, TierKind.REDIS


class Backend:
    """A probe target that fails while ``down``; counts the probes."""

    def __init__(self) -> None:
        self.down = True
        self.probes = 0

    def probe(self) -> None:
        self.probes += 1
        if self.down:
            raise ConnectionError("down")


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_one_failure_opens_it_and_calls_are_refused_until_a_probe_succeeds() -> None:
    backend = Backend()
    breaker = CircuitBreaker("test", backend.probe, BreakerConfig(0.05, 0.2))
    assert breaker.allow() and not breaker.is_open
    breaker.failed()
    breaker.failed()  # already open: one trip, one probing thread
    assert breaker.is_open and breaker.trips == 1
    assert not breaker.allow() and breaker.refused == 1
    wait_for(lambda: backend.probes >= 3)
    assert breaker.is_open  # probes fail while the backend is down
    backend.down = False
    wait_for(lambda: not breaker.is_open)
    assert breaker.allow()
    breaker.close()


def test_the_pause_between_probes_doubles_up_to_its_limit() -> None:
    backend = Backend()
    breaker = CircuitBreaker("test", backend.probe, BreakerConfig(0.02, 0.08))
    breaker.failed()
    time.sleep(0.6)
    breaker.close()
    # 0.02 + 0.04 + 0.08 + 0.08 ... : about 8 probes in 0.6 s, not the 30 of a fixed 0.02 s.
    assert 4 <= backend.probes <= 12
    probes = backend.probes
    time.sleep(0.2)
    assert backend.probes == probes  # closing stopped the prober


def test_a_dram_hit_does_not_wait_on_a_hung_redis(redis_server_factory) -> None:
    """While Redis is SIGSTOPped and another thread keeps asking it for chains, lookups
    and gets of a DRAM-held chain stay as fast as before the outage: after the first
    timeout the breaker answers for Redis, and nothing waits on its socket."""
    server: RedisServer = redis_server_factory()
    ns = kv.namespace()
    with TieredStore(kv.config(kv.dram(4), kv.redis(server.url))) as store:
        hot = kv.tokens(2)
        store.put(ns, hot, kv.chunks(2))
        hot_keys = store.keys_for(ns, hot)
        cold = [kv.tokens(2, start=1000 * (i + 1)) for i in range(4)]
        for i, tokens in enumerate(cold):
            store.put(ns, tokens, kv.chunks(2, seed=i + 1))
        kv.written_through(store)
        store.demote(ns, [key for tokens in cold for key in store.keys_for(ns, tokens)], to=REDIS)
        store.promote(ns, hot_keys)  # the hot chain in DRAM, the cold ones only in Redis
        assert store.lookup(ns, hot).tiers == (DRAM, DRAM)
        assert store.lookup(ns, cold[0]).tiers == (REDIS, REDIS)

        def dram_hits(count: int) -> list[float]:
            times = []
            for _ in range(count):
                started = time.perf_counter()
                assert store.lookup(ns, hot).num_chunks == 2
                assert all(c is not None for c in store.get(ns, hot_keys))
                times.append(time.perf_counter() - started)
            return times

        normal = dram_hits(300)
        server.pause()
        stop = threading.Event()
        cold_calls: list[float] = []

        def read_cold() -> None:
            while not stop.is_set() and len(cold_calls) < 2000:
                started = time.perf_counter()
                store.lookup(ns, cold[len(cold_calls) % 4])
                cold_calls.append(time.perf_counter() - started)

        reader = threading.Thread(target=read_cold)
        try:
            reader.start()
            wait_for(lambda: store.stats().tiers[REDIS].down, timeout_s=3.0)
            # Hits go on until the reader has asked Redis several times since the trip: on
            # a loaded machine the reader may not run again before 300 hits are done.
            during: list[float] = []
            deadline = time.monotonic() + 5.0
            while (len(during) < 300 or len(cold_calls) <= 10) and time.monotonic() < deadline:
                during += dram_hits(50)
        finally:
            stop.set()
            reader.join(timeout=10)
            server.resume()
        assert len(cold_calls) > 10
        assert max(cold_calls) < 1.5, "only the first call waits, for one socket timeout"
        assert sorted(cold_calls)[len(cold_calls) // 2] < 0.05, "the rest are answered at once"
        p99_normal = float(np.percentile(normal, 99))
        p99_during = float(np.percentile(during, 99))
        # Twice normal, or well under one socket timeout (0.5 s) on a noisy machine: a DRAM
        # hit that waited on Redis would take that long. ``redis_faults`` reports the ratio.
        assert p99_during <= max(2 * p99_normal, 0.1), (p99_normal, p99_during)
        assert max(during) < 0.25
        kv.wait_until_up(store, REDIS)
        assert store.lookup(ns, cold[0]).tiers == (REDIS, REDIS)


def test_a_redis_down_at_start_is_reported_and_joins_when_it_comes_up(
    redis_server_factory, caplog
) -> None:
    server: RedisServer = redis_server_factory()
    server.stop()  # its port stays reserved for it: nothing listens there now
    ns = kv.namespace()
    caplog.set_level("WARNING", logger="kvstore.store.guarded")
    with TieredStore(kv.config(kv.dram(2), kv.redis(server.url))) as store:
        assert any("does not answer at start" in r.getMessage() for r in caplog.records)
        assert store.stats().tiers[REDIS].down
        assert store.put(ns, kv.tokens(2), kv.chunks(2)) == 2  # DRAM serves meanwhile
        server.start()
        kv.wait_until_up(store, REDIS)
        store.put(ns, kv.tokens(3, start=100), kv.chunks(3))  # pushes DRAM's two down
        assert store.lookup(ns, kv.tokens(2)).tiers == (REDIS, REDIS)
