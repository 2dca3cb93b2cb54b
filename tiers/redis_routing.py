"""How one pipelined batch of ``redis_tier`` reaches the masters of a Redis Cluster.

A batch is split by the client's slot map into one share per master (``shares``);
each share goes as a plain pipeline on that master's own connection
(``send_share``), and only what comes back ``MOVED``/``ASK``/``TRYAGAIN`` goes
through a cluster pass that follows the redirection (``follow_redirections``). A
master that is down, hung or answering ``CLUSTERDOWN`` answers its error for each
command of its share (``is_node_down``), which the tier turns into ``Unreached``:
a miss or a failed put, never a value. ``ping`` is the probe of a master's breaker.
The redis-py behaviour relied on, and why its own cluster pipeline is not used as
is, is in ``run_cluster``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.cluster
import redis.exceptions
from redis.cluster import PipelineCommand

REDIRECTIONS = (
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
)


def run_cluster(
    client: redis.cluster.RedisCluster, commands: Sequence[tuple[Any, ...]]
) -> list[Any]:
    """One cluster pipeline pass without redirections, then one pass for the redirected.

    ``ClusterPipeline.execute`` re-sends every command that failed with a
    timeout or connection error *one at a time*, each with its own timeout:
    against a hung master, a batch took about (its keys on that master) x
    the socket timeout (measured: 33 s for 90 keys over 3 masters at 0.5 s).
    The first pass here
    disables that (``allow_redirections=False``), so a hung or dead master
    costs one timeout and surfaces as an error result. Only the commands
    answered with ``MOVED``/``ASK``/``TRYAGAIN`` (a resharding or failover in
    progress; the node answered, so this is fast) go through the second pass,
    where redis-py follows the redirection and updates its slot map.
    ``send_cluster_commands`` and ``PipelineCommand`` are redis-py names without
    a leading underscore but undocumented; the cluster tests (hung master,
    ``ASK``/``MOVED`` during a slot migration) pin the behaviour relied on.
    """
    results = cluster_pass(client, commands, allow_redirections=False)
    return follow_redirections(client, commands, results)


def cluster_pass(
    client: redis.cluster.RedisCluster,
    commands: Sequence[tuple[Any, ...]],
    *,
    allow_redirections: bool,
) -> list[Any]:
    """``commands`` through one redis-py cluster pipeline, errors as results."""
    pipe = client.pipeline(transaction=False)
    try:
        stack = [PipelineCommand(command, {}, i) for i, command in enumerate(commands)]
        return list(
            pipe.send_cluster_commands(
                stack, raise_on_error=False, allow_redirections=allow_redirections
            )
        )
    finally:
        pipe.reset()


def follow_redirections(
    client: redis.cluster.RedisCluster, commands: Sequence[tuple[Any, ...]], results: list[Any]
) -> list[Any]:
    """``results`` with every ``MOVED``/``ASK``/``TRYAGAIN`` answer replaced by the answer
    of a cluster pass that follows the redirection (and corrects the slot map)."""
    redirected = [i for i, result in enumerate(results) if isinstance(result, REDIRECTIONS)]
    if redirected:
        answers = cluster_pass(client, [commands[i] for i in redirected], allow_redirections=True)
        for i, answer in zip(redirected, answers, strict=True):
            results[i] = answer
    return results


# A node that raised or answered one of these did not serve its share of a batch:
# down (connection refused), hung (timeout) or cut off by the cluster (CLUSTERDOWN).
NODE_DOWN: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.RedisClusterException,
)
# ...except these ConnectionErrors: a node that refuses our credentials is not down,
# the tier is misconfigured, and that fails the batch whatever the other nodes say.
REFUSED: tuple[type[BaseException], ...] = (
    redis.exceptions.AuthenticationError,
    redis.exceptions.AuthorizationError,
)


# A connection that timed out or broke: after a hang or a half-open link every pooled
# socket to that server is suspect, and each would cost a timeout (its breaker's probe
# included) before redis-py dropped it, so all of them are dropped at once.
LINK_LOST: tuple[type[BaseException], ...] = (
    redis.exceptions.TimeoutError,
    redis.exceptions.ConnectionError,
)


def send_share(
    client: redis.cluster.RedisCluster, node: str, share: Sequence[tuple[Any, ...]]
) -> list[Any]:
    """One master's share of a batch; a master that is down or hung answers its error
    for every command. A refused login raises.

    The share goes as a plain pipeline on that master's own connection, the slot
    map having routed it already (``shares``): redis-py's cluster pipeline routes
    and parses every command again, which measured 2.7 ms for 128 ``EXISTS`` on
    three loopback masters against 0.9 ms this way. Only what comes back
    ``MOVED``/``ASK``/``TRYAGAIN`` (a resharding or failover) goes through a
    cluster pass that follows redirections and corrects the map."""
    try:
        master = node_client(client, node)
        if master is None:  # a slot no master serves: redis-py reports it per command
            return run_cluster(client, share)
        pipe = master.pipeline(transaction=False)
        try:
            for command in share:
                pipe.execute_command(*command)
            results = list(pipe.execute(raise_on_error=False))
        finally:
            pipe.reset()
        return follow_redirections(client, share, results)
    except NODE_DOWN as error:
        if isinstance(error, REFUSED):
            raise
        return [error] * len(share)


def drop_connections(client: redis.Redis) -> None:
    """Close every pooled connection of ``client``; the next call opens a fresh one."""
    client.connection_pool.disconnect()


def node_client(client: redis.cluster.RedisCluster, node: str) -> redis.Redis | None:
    """The client of master ``node`` (``host:port``), if the slot map knows it."""
    host, _, port = node.rpartition(":")
    found = client.get_node(host=host, port=int(port))
    return None if found is None else found.redis_connection


def drop_node_connections(client: redis.cluster.RedisCluster, node: str) -> None:
    """``drop_connections`` for one master of a cluster (``host:port``)."""
    master = node_client(client, node)
    if master is not None:
        drop_connections(master)


def is_node_down(result: object) -> bool:
    return isinstance(result, NODE_DOWN) and not isinstance(result, REFUSED)


def ping(client: redis.cluster.RedisCluster, node: str) -> None:
    """The probe of master ``node``'s breaker (``host:port``): PING it; if it does not
    answer, read the slot map again, and succeed if ``node`` is no longer a master
    there: its replica was promoted and serves its slots, so batches are split over
    the new master and this breaker has nothing left to guard. Raises otherwise.

    Without the refresh nothing would ever learn of the failover: while the breaker
    is open, the node's share of a batch is answered without a round trip, so no
    ``MOVED`` reply comes back to make redis-py read the map again."""
    try:
        master = node_client(client, node)
        if master is None:
            raise redis.exceptions.ConnectionError(f"{node} is not in the slot map")
        master.ping()
    except redis.exceptions.RedisError:
        with contextlib.suppress(redis.exceptions.RedisError):
            client.nodes_manager.initialize()
        if any(primary.name == node for primary in client.get_primaries()):
            raise


@dataclass(frozen=True, slots=True)
class Unreached:
    """The result of a command whose node did not answer: a miss or a failed put, never
    a value. ``node`` is the master's ``host:port``."""

    node: str


def shares(
    client: redis.cluster.RedisCluster, commands: Sequence[tuple[Any, ...]]
) -> dict[str, list[int]]:
    """The positions of ``commands``, grouped by the master that owns each one's key
    (the client's slot map; a stale map is corrected by ``MOVED`` in ``run_cluster``)."""
    shares: dict[str, list[int]] = {}
    for i, command in enumerate(commands):
        try:
            node = client.get_node_from_key(command[1]).name
        except redis.exceptions.SlotNotCoveredError:
            node = "(no master)"  # sent anyway; redis-py fails it, as a share of its own
        shares.setdefault(node, []).append(i)
    return shares
