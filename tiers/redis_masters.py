"""The masters of a Redis Cluster, each answering for itself (``redis_tier``'s
cluster mode): a batch goes out as one share per master, all at once, and a breaker
per master answers for one that is down, so its share costs nothing and the rest of
the batch is served. How a share reaches its master is ``redis_routing``."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any

import redis.cluster

from kvstore.breaker import BreakerConfig, CircuitBreaker
from kvstore.errors import TierUnavailable
from kvstore.kinds import TierKind
from kvstore.tiers import redis_routing

_FAN_OUT_THREADS = 16  # masters a batch is sent to at once


class ClusterMasters:
    """Per-master breakers, failure count and the threads shares go out on, for one
    tier. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        # Under ``_lock``: how many shares have failed in all (one per master per batch),
        # and a breaker per master (``_breaker``).
        self._failures = 0
        self._breakers: dict[str, CircuitBreaker] = {}
        self._breaker_config = BreakerConfig(min_open_s=0.5, max_open_s=10.0)
        self._fan_out: concurrent.futures.ThreadPoolExecutor | None = None

    def run(
        self, client: redis.cluster.RedisCluster, commands: Sequence[tuple[Any, ...]]
    ) -> list[Any]:
        """``commands`` split by master, one pipelined round trip per master's share.

        A master that is down or hung fails only its share: those results are
        ``redis_routing.Unreached``, and the rest of the batch is served. Its failure opens its
        breaker: while open, its shares are ``redis_routing.Unreached`` at once, without a round
        trip, until a probe (PING, on the breaker's thread) finds it answering. Only
        when no master of the cluster answers does the batch raise, as a standalone
        Redis that is down does (and the tier's own breaker takes over). A refused
        login raises whatever the other masters said.

        Shares go to the masters at once, each on a thread of the tier's own, so a
        batch waits for its slowest master, not for the sum of them: a host cut off
        from the cluster pays one timeout per call, not one per master.
        """
        results: list[Any] = [None] * len(commands)
        answered = 0
        failed: dict[str, BaseException] = {}
        asked: dict[str, list[int]] = {}
        for node, positions in redis_routing.shares(client, commands).items():
            if self._breaker(client, node).allow():
                asked[node] = positions
            else:
                for i in positions:
                    results[i] = redis_routing.Unreached(node)
        shares = {node: [commands[i] for i in positions] for node, positions in asked.items()}
        for node, answers in self._send(client, shares).items():
            positions = asked[node]
            breaker = self._breaker(client, node)
            if any(isinstance(answer, redis_routing.LINK_LOST) for answer in answers):
                redis_routing.drop_node_connections(client, node)
            for i, answer in zip(positions, answers, strict=True):
                if isinstance(answer, redis_routing.REFUSED):
                    raise answer
                if redis_routing.is_node_down(answer):
                    failed.setdefault(node, answer)
                    answer = redis_routing.Unreached(node)
                results[i] = answer
            if node in failed:
                breaker.failed()
            else:
                answered += 1
        with self._lock:
            self._failures += len(failed)
        if failed and not answered and self._all_down(client):
            raise next(iter(failed.values()))
        return results

    def _send(
        self, client: redis.cluster.RedisCluster, shares: dict[str, list[tuple[Any, ...]]]
    ) -> dict[str, list[Any]]:
        """Each master's share sent at once (``redis_routing.send_share``), answers by master."""
        if len(shares) <= 1:
            return {
                node: redis_routing.send_share(client, node, share)
                for node, share in shares.items()
            }
        with self._lock:
            if self._closed:
                raise TierUnavailable(TierKind.REDIS.label, "tier is closed")
            if self._fan_out is None:
                self._fan_out = concurrent.futures.ThreadPoolExecutor(
                    max_workers=_FAN_OUT_THREADS, thread_name_prefix="kvstore-redis-master"
                )
            fan_out = self._fan_out
        futures = {
            node: fan_out.submit(redis_routing.send_share, client, node, share)
            for node, share in shares.items()
        }
        return {node: future.result() for node, future in futures.items()}

    def _breaker(self, client: redis.cluster.RedisCluster, node: str) -> CircuitBreaker:
        """Master ``node``'s breaker (made on first use); its probe PINGs the master."""
        with self._lock:
            breaker = self._breakers.get(node)
            if breaker is None:
                breaker = self._breakers[node] = CircuitBreaker(
                    f"redis master {node}",
                    lambda: redis_routing.ping(client, node),
                    self._breaker_config,
                )
            return breaker

    def allows(self, client: redis.cluster.RedisCluster, node: str) -> bool:
        """Whether master ``node`` may be asked now (its breaker is closed, or probing)."""
        return self._breaker(client, node).allow()

    def _all_down(self, client: redis.cluster.RedisCluster) -> bool:
        """Whether every master the slot map knows has its breaker open."""
        with self._lock:
            breakers = dict(self._breakers)
        masters = {node.name for node in client.get_primaries()} or set(breakers)
        return all(node in breakers and breakers[node].is_open for node in masters)

    @property
    def failures(self) -> int:
        """How many times a master failed its share of a batch (once per master per
        batch, however many keys the share held)."""
        with self._lock:
            return self._failures

    def unreachable(self) -> frozenset[str]:
        """The masters (``host:port``) whose breaker is open: their keys are misses."""
        with self._lock:
            return frozenset(node for node, breaker in self._breakers.items() if breaker.is_open)

    def close(self) -> None:
        """Stop every breaker's probe and the fan-out threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            breakers = list(self._breakers.values())
        for breaker in breakers:
            breaker.close()
        if self._fan_out is not None:
            self._fan_out.shutdown(wait=True)
