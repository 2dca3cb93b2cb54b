"""Redis tier: blocks as plain string values in a standalone Redis or a Redis Cluster.

Key layout::

    b"{key_prefix}:{namespace digest as 32 hex chars}:" + chunk key (16 raw bytes)

    e.g. b"kvs:6f1c...e2:" b"\\x8a\\x03...\\x1f"      (value = header + payload)

* The namespace sits in the key so several models and tenants can share one
  Redis, and ``SCAN kvs:*`` finds every block for an index rebuild.
* No hash tags (``{...}``): a tag would pin a whole namespace to one slot and
  so to one master. Without one, blocks spread over every master of a cluster,
  and so do their bytes and their traffic.
* Values are content addressed and immutable: a chunk key names the tokens
  and everything before them, and the value under it never changes. That is
  what makes a Redis Cluster failover or resharding safe for a cache: a write
  lost in the failover window reads back as a miss, a redirected read
  (``MOVED``/``ASK``, followed by redis-py) returns the one value ever written,
  and a replayed ``SET`` writes the same bytes again. Readers never see a torn
  value because each block is one ``SET``.

Every batch is one pipelined round trip (``transaction=False``: no
``MULTI``/``EXEC``, which a cluster could not run across slots anyway); in a
cluster, one per master, each master's share sent on its own
(``redis_masters``). A prefix of hundreds of chunks therefore costs one network
round trip per master, not hundreds. Reads use pipelined
``GET`` rather than ``MGET``: measured with 2 MiB values on loopback, the two
run at the same speed (8 keys: 5-9 ms either way; 64 keys: 105-135 ms either
way), and the pipeline also works across cluster slots and reports a bad value
per key instead of failing the whole batch.

Failure model. Redis is the slowest tier and may be remote, so it must never
make a request hang: connect and socket timeouts are always set, the pool waits
a bounded time for a free connection, and a command is retried at most once, and
only after a connection error (a stale pooled socket after a server restart),
never after a timeout. A down or slow Redis therefore costs at most about
``connect_timeout_s + socket_timeout_s`` and surfaces as ``TierUnavailable``,
which the store turns into a miss (a recompute) rather than an error. In a
cluster a master that is down, hung or answering ``CLUSTERDOWN`` fails only its
share of a batch, in about the same time (a hung master: one socket timeout,
plus one more if redis-py refreshes its slot map from it; ``redis_routing`` has
how a batch reaches each master, and the redis-py pipeline behaviour that
avoids): its keys are misses (``get_many``, ``contains_many``), not stored
(``put_many`` stores and accounts the rest, then raises ``TierRefused`` naming
the master) or not deleted, while the other masters' keys are served as usual.
The failure opens that master's breaker (``kvstore.breaker``): until a PING on
the breaker's own thread finds it back, its share of every batch is answered at
once, without a round trip, so a hung master costs one timeout per outage, not
one per batch. It is counted once per master per failed batch
(``node_failures``) and logged once when the master stops answering and once
when it is back. Only when no master of the cluster answers does a batch raise,
and the tier's own breaker takes over. After ``cluster-node-timeout`` the
healthy masters of a cluster without replicas answer ``CLUSTERDOWN`` to
everything unless it runs with ``cluster-require-full-coverage no``. The same
client reconnects by itself once Redis is back. ``-OOM`` replies (``maxmemory``
with ``noeviction``) become ``TierFull``. A refused login (wrong password or
user, no password) is not a down master: it fails the whole batch, saying so.
All redis-py exceptions are translated here and nowhere else.

Credentials and TLS (``RedisAccess``, ``kvstore.tiers.redis_access``) are the
same for every node; redis-py hands them to each master it discovers.

Accounting. ``used_bytes`` is this process's view: bytes this instance wrote,
minus what it deleted or found gone, plus every block a ``scan`` found (a
scan is how a restarted process learns what Redis holds). Other processes sharing the Redis are not
seen, and the server may evict or expire keys behind our back (a miss on an
accounted key drops it). That view is what a write-back tier (one host's
overflow) is kept within. A write-through tier, shared by several hosts, is the
servers' to size: the store never evicts there, and ``server_memory`` (``INFO
memory`` of every master) is what its stats report. Either way, run a cache
Redis with ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (or
``allkeys-lfu``), so it evicts instead of refusing writes; the store warns at
start when a write-through tier's servers do not.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import redis
import redis.cluster
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.block import HEADER_BYTES, Block
from kvstore.errors import ConfigError, TierFull, TierRefused, TierUnavailable
from kvstore.keys import KEY_BYTES, ChunkKey
from kvstore.kinds import TierKind
from kvstore.tiers import redis_routing
from kvstore.tiers.base import BlockDestination, Buffer, ServerMemory, StoredBlockInfo, scatter
from kvstore.tiers.redis_access import RedisAccess, host_port, split_url
from kvstore.tiers.redis_masters import ClusterMasters

log = logging.getLogger(__name__)

_TIER = TierKind.REDIS.label
_NAMESPACE_BYTES = 16
_SCAN_BATCH = 256
# A pooled connection idle longer than this is PINGed before use, so a socket
# silently dropped by a firewall or proxy is replaced instead of timing out.
_HEALTH_CHECK_INTERVAL_S = 15


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, redis.exceptions.OutOfMemoryError) or (
        isinstance(error, redis.exceptions.ResponseError) and str(error).startswith("OOM")
    )


def _is_wrong_type(result: object) -> bool:
    """A per-key ``WRONGTYPE`` reply: someone stored a non-string under our key."""
    return isinstance(result, redis.exceptions.ResponseError) and str(result).startswith(
        "WRONGTYPE"
    )


def _refused_login(error: BaseException | None) -> bool:
    """Whether ``error``, or what it was raised from, is Redis refusing our credentials."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, redis.exceptions.AuthenticationError):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _unavailable(operation: str, error: BaseException) -> TierUnavailable:
    why = f"{type(error).__name__}: {error}"
    if _refused_login(error):
        why = f"Redis refused the login (check username and password): {why}"
    return TierUnavailable(_TIER, f"{operation}: {why}")


@contextlib.contextmanager
def _backend_errors(operation: str) -> Iterator[None]:
    """Translate redis-py exceptions into the kvstore error tree (the one boundary)."""
    try:
        yield
    except redis.exceptions.RedisError as error:
        if _is_oom(error):
            raise TierFull(_TIER, f"{operation}: {error}") from error
        raise _unavailable(operation, error) from error
    except redis.exceptions.RedisClusterException as error:
        # Not a RedisError: raised when no node of the cluster can be reached.
        raise _unavailable(operation, error) from error


class RedisTier:
    """A batched block store in Redis (standalone or cluster); see the module docstring.

    Thread-safe: redis-py clients are safe to share across threads (each
    command or pipeline takes a connection from the pool), and the byte
    accounting is guarded by ``_lock``.
    """

    kind = TierKind.REDIS
    # Bytes come back over a network from a server other processes write to.
    verifies_reads = True

    def __init__(
        self,
        url_or_nodes: str | Sequence[str],
        capacity_bytes: int,
        *,
        cluster: bool = False,
        key_prefix: str = "kvs",
        ttl_s: int | None = None,
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 0.5,
        max_connections: int = 32,
        access: RedisAccess | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ConfigError("redis capacity_bytes must be positive")
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError("redis ttl_s must be positive (or None for no expiry)")
        if not key_prefix or any(c in key_prefix for c in "*?[]\\{}"):
            raise ConfigError(f"redis key_prefix {key_prefix!r} must be non-empty, no glob or {{}}")
        nodes = [url_or_nodes] if isinstance(url_or_nodes, str) else list(url_or_nodes)
        if not nodes:
            raise ConfigError("redis tier needs a URL or at least one node")
        if not cluster and len(nodes) != 1:
            raise ConfigError("a standalone redis tier takes one URL; pass cluster=True for many")
        nodes, access = split_url(nodes, access or RedisAccess())
        access.check()
        self._capacity = capacity_bytes
        self._prefix = key_prefix.encode() + b":"
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._sizes: dict[bytes, int] = {}
        self._used = 0
        self._closed = False
        self._masters = ClusterMasters()  # a cluster's: a breaker per master
        connection_kwargs: dict[str, Any] = {
            "decode_responses": False,
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": connect_timeout_s,
            "health_check_interval": _HEALTH_CHECK_INTERVAL_S,
            "max_connections": max_connections,
            **access.client_kwargs(),
        }
        self._pool: redis.BlockingConnectionPool | None = None
        self._client: redis.Redis | redis.cluster.RedisCluster | None = None
        if cluster:
            # Built on first use: RedisCluster fetches the slot map in its
            # constructor, and a cluster that is down when the store starts
            # should cost misses, not a failed start.
            self._startup_nodes = [redis.cluster.ClusterNode(*host_port(n)) for n in nodes]
            # No cluster-level retry: redis-py would re-run the whole batch after
            # refreshing the slot map, doubling the time a hung master costs.
            # The refresh still happens, so after a failover only the batch
            # that noticed it is lost (as misses).
            self._cluster_kwargs = {
                **connection_kwargs,
                "ssl": access.tls,
                "retry": Retry(NoBackoff(), retries=0),
            }
        else:
            scheme = "rediss" if access.tls else "redis"
            url = nodes[0] if "://" in nodes[0] else f"{scheme}://{nodes[0]}"
            self._pool = redis.BlockingConnectionPool.from_url(
                url,
                # Waiting for a free pooled connection is bounded as well.
                timeout=socket_timeout_s,
                # One connection error (a pooled socket the server closed, e.g.
                # after a restart) is retried at once on a fresh socket; a
                # timeout never is, so the bound stays connect + socket timeout.
                retry=Retry(
                    NoBackoff(), retries=1, supported_errors=(redis.exceptions.ConnectionError,)
                ),
                **connection_kwargs,
            )
            self._client = redis.Redis(connection_pool=self._pool)

    # ------------------------------------------------------------------ plumbing

    def _redis(self) -> redis.Redis | redis.cluster.RedisCluster:
        """The client, connecting to the cluster on first use."""
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._closed:
                raise TierUnavailable(_TIER, "tier is closed")
            if self._client is None:
                with _backend_errors("connect to cluster"):
                    self._client = redis.cluster.RedisCluster(
                        startup_nodes=self._startup_nodes, **self._cluster_kwargs
                    )
            return self._client

    def _key(self, namespace: bytes, key: ChunkKey) -> bytes:
        return b"%s%s:%s" % (self._prefix, namespace.hex().encode(), key)

    def _run(self, operation: str, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` as one pipelined round trip.

        Per-command errors come back as exception objects in the result list
        (so one foreign value does not fail a batch); the callers decide which
        are misses and which are failures. Connection-level errors raise,
        translated.
        """
        if self._closed:
            raise TierUnavailable(_TIER, "tier is closed")
        with _backend_errors(operation):
            client = self._redis()
            if isinstance(client, redis.cluster.RedisCluster):
                return self._masters.run(client, commands)
            pipe = client.pipeline(transaction=False)
            try:
                for command in commands:
                    pipe.execute_command(*command)
                return list(pipe.execute(raise_on_error=False))
            except redis_routing.LINK_LOST:
                redis_routing.drop_connections(client)
                raise
            finally:
                pipe.reset()

    @property
    def node_failures(self) -> int:
        """How many times a cluster master failed its share of a batch (once per master
        per batch, however many keys the share held)."""
        return self._masters.failures

    def unreachable_nodes(self) -> frozenset[str]:
        """The masters (``host:port``) whose breaker is open: their keys are misses."""
        return self._masters.unreachable()

    def _forget(self, redis_keys: Sequence[bytes]) -> None:
        with self._lock:
            for redis_key in redis_keys:
                self._used -= self._sizes.pop(redis_key, 0)

    # ------------------------------------------------------------------ Tier protocol

    def put_many(self, namespace: bytes, items: Sequence[tuple[ChunkKey, Block]]) -> None:
        """One ``SET`` per block (``EX ttl_s`` if configured), all in one round trip.

        Blocks that Redis accepted are accounted even when others in the batch
        were refused, so a ``TierFull`` after a partial batch leaves the
        accounting true.
        """
        if not items:
            return
        ttl = () if self._ttl_s is None else ("EX", self._ttl_s)
        redis_keys = [self._key(namespace, key) for key, _ in items]
        commands = [
            ("SET", redis_key, block.to_bytes(), *ttl)
            for redis_key, (_, block) in zip(redis_keys, items, strict=True)
        ]
        results = self._run("put_many", commands)
        refused: BaseException | None = None
        unreached: list[redis_routing.Unreached] = []
        with self._lock:
            for redis_key, (_, block), result in zip(redis_keys, items, results, strict=True):
                if isinstance(result, redis_routing.Unreached):
                    unreached.append(result)
                    continue
                if isinstance(result, BaseException):
                    refused = refused or result
                    continue
                self._used += block.nbytes - self._sizes.get(redis_key, 0)
                self._sizes[redis_key] = block.nbytes
        if refused is not None:
            with _backend_errors("put_many"):
                raise refused
        if unreached:
            # The cluster is up in part (``ClusterMasters.run`` raised if none was): the
            # tier's breaker (``kvstore.breaker``) must not take the others out with it.
            nodes = ", ".join(sorted({result.node for result in unreached}))
            raise TierRefused(
                _TIER,
                f"put_many: {len(unreached)} of {len(items)} blocks not stored: "
                f"master(s) {nodes} did not answer",
            )

    def get_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> list[Buffer | None]:
        """Pipelined ``GET``s; ``None`` for a miss (or a foreign, non-string value)."""
        if not keys:
            return []
        redis_keys = [self._key(namespace, key) for key in keys]
        results = self._run("get_many", [("GET", rk) for rk in redis_keys])
        values: list[Buffer | None] = []
        gone: list[bytes] = []
        for redis_key, result in zip(redis_keys, results, strict=True):
            if isinstance(result, redis_routing.Unreached):
                values.append(None)  # its master is down: a miss, still accounted
                continue
            if _is_wrong_type(result):
                result = None  # not a string, so not a block we wrote: a miss
            elif isinstance(result, BaseException):
                with _backend_errors("get_many"):
                    raise result
            if result is None:
                gone.append(redis_key)
            values.append(result)
        if gone:
            self._forget(gone)  # evicted or expired by the server
        return values

    def get_many_into(
        self,
        namespace: bytes,
        keys: Sequence[ChunkKey],
        destinations: Sequence[BlockDestination],
    ) -> list[bool]:
        """``get_many``, then each value scattered into the caller's buffers."""
        values = self.get_many(namespace, keys)
        return [
            value is not None and scatter(value, destination)
            for value, destination in zip(values, destinations, strict=True)
        ]

    def contains_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> list[bool]:
        """Pipelined ``EXISTS`` (no value crosses the network)."""
        if not keys:
            return []
        redis_keys = [self._key(namespace, key) for key in keys]
        results = self._run("contains_many", [("EXISTS", rk) for rk in redis_keys])
        for result in results:
            if isinstance(result, BaseException):
                with _backend_errors("contains_many"):
                    raise result
        gone = [rk for rk, result in zip(redis_keys, results, strict=True) if result == 0]
        self._forget(gone)  # an unreached master's keys are not known to be gone
        return [
            not isinstance(result, redis_routing.Unreached) and bool(result) for result in results
        ]

    def delete_many(self, namespace: bytes, keys: Sequence[ChunkKey]) -> int:
        """Pipelined ``DEL``; the count is what Redis reports it removed."""
        if not keys:
            return 0
        redis_keys = [self._key(namespace, key) for key in keys]
        results = self._run("delete_many", [("DEL", rk) for rk in redis_keys])
        for result in results:
            if isinstance(result, BaseException):
                with _backend_errors("delete_many"):
                    raise result
        reached = [(rk, r) for rk, r in zip(redis_keys, results, strict=True) if isinstance(r, int)]
        self._forget([rk for rk, _ in reached])  # an unreached master still holds its keys
        return sum(result for _, result in reached)

    def scan(self) -> Iterator[StoredBlockInfo]:
        """Every block under ``key_prefix``, on every master in cluster mode.

        ``SCAN`` is incremental (it never blocks the server like ``KEYS``);
        lengths and headers are fetched with pipelined ``STRLEN`` and
        ``GETRANGE`` per batch. A key deleted between the scan and the fetch is
        skipped; a value shorter than a header is still reported, so the store
        can recognise it as corrupt and delete it. Keys under the prefix that
        are not shaped like ours are ignored.
        """
        pattern = self._prefix + b"*"
        with _backend_errors("scan"):
            keys = self._redis().scan_iter(match=pattern, count=1000)
            batch: list[bytes] = []
            for redis_key in keys:
                batch.append(redis_key)
                if len(batch) >= _SCAN_BATCH:
                    yield from self._describe(batch)
                    batch = []
            if batch:
                yield from self._describe(batch)

    def _describe(self, redis_keys: list[bytes]) -> Iterator[StoredBlockInfo]:
        commands: list[tuple[Any, ...]] = []
        parsed: list[tuple[bytes, bytes, ChunkKey]] = []
        for redis_key in redis_keys:
            split = self._split(redis_key)
            if split is not None:
                parsed.append((redis_key, *split))
                commands.append(("STRLEN", redis_key))
                commands.append(("GETRANGE", redis_key, 0, HEADER_BYTES - 1))
        results = self._run("scan", commands)
        for index, (_, namespace, key) in enumerate(parsed):
            nbytes, header = results[2 * index], results[2 * index + 1]
            if isinstance(nbytes, redis_routing.Unreached) or isinstance(
                header, redis_routing.Unreached
            ):
                continue  # its master went away between the SCAN and now
            if _is_wrong_type(nbytes) or _is_wrong_type(header):
                continue  # a foreign value type under our prefix
            for result in (nbytes, header):
                if isinstance(result, BaseException):
                    with _backend_errors("scan"):
                        raise result
            if nbytes:
                self._note_existing(namespace, key, int(nbytes))
                yield StoredBlockInfo(namespace, key, int(nbytes), bytes(header))

    def _split(self, redis_key: bytes) -> tuple[bytes, ChunkKey] | None:
        """``prefix ns_hex : key`` -> ``(namespace, key)``, or None if not ours."""
        rest = redis_key[len(self._prefix) :]
        if len(rest) != 2 * _NAMESPACE_BYTES + 1 + KEY_BYTES or rest[2 * _NAMESPACE_BYTES] != 58:
            return None
        try:
            namespace = bytes.fromhex(rest[: 2 * _NAMESPACE_BYTES].decode("ascii"))
        except ValueError:
            return None
        return namespace, ChunkKey(rest[2 * _NAMESPACE_BYTES + 1 :])

    def _note_existing(self, namespace: bytes, key: ChunkKey, nbytes: int) -> None:
        """Account a block this process did not write (found by ``scan``)."""
        redis_key = self._key(namespace, key)
        with self._lock:
            self._used += nbytes - self._sizes.get(redis_key, 0)
            self._sizes[redis_key] = nbytes

    def used_bytes(self) -> int:
        """This process's view of the bytes stored; see "Accounting" above."""
        with self._lock:
            return self._used

    def capacity_bytes(self) -> int:
        return self._capacity

    def server_memory(self) -> ServerMemory:
        """``INFO memory`` of the server, or of every master of a cluster (a master that
        does not answer is left out of the sums); ``TierUnavailable`` if none answers."""
        if self._closed:
            raise TierUnavailable(_TIER, "tier is closed")
        with _backend_errors("info memory"):
            client = self._redis()
            if isinstance(client, redis.cluster.RedisCluster):
                masters = client.get_primaries()
                infos = []
                for node in masters:
                    node_client = redis_routing.node_client(client, node.name)
                    if node_client is None or not self._masters.allows(client, node.name):
                        continue
                    with contextlib.suppress(redis.exceptions.RedisError):
                        infos.append(node_client.info("memory"))
                if not infos:
                    raise redis.exceptions.ConnectionError("no master answered INFO memory")
                count = len(masters)
            else:
                infos, count = [client.info("memory")], 1
        limits = [int(info.get("maxmemory", 0)) for info in infos]
        return ServerMemory(
            used_bytes=sum(int(info.get("used_memory", 0)) for info in infos),
            max_bytes=0 if 0 in limits else sum(limits),
            policies=frozenset(str(info.get("maxmemory_policy", "unknown")) for info in infos),
            masters=count,
            answered=len(infos),
        )

    def close(self) -> None:
        """Close every pooled connection. Idempotent; later calls raise TierUnavailable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        self._masters.close()
        if client is not None:
            client.close()
        if self._pool is not None:
            self._pool.disconnect()
