"""A private Redis Cluster on free ports: masters (three by default), each with
replicas or none (the default), joined with ``redis-cli --cluster create``, on the
loopback or on an address that other network namespaces reach. A master can be
killed for its replica to take over (``fail_over``), and slots migrated to exercise
``ASK`` and ``MOVED``. Its nodes are ``redis_server.RedisServer``s, secured alike
(``password``, ``tls``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from kvstore.errors import ConfigError, TierUnavailable
from kvstore.local.processes import HOST, free_port
from kvstore.local.redis_server import (
    REDIS_CLI,
    REDIS_INSTALL,
    RedisServer,
    ServerTLS,
)


def _replication(info: bytes) -> tuple[int, list[int]]:
    """A master's ``INFO replication``: its replication offset, and the offset each
    connected replica acknowledged (``slave0:ip=...,offset=N,lag=0``)."""
    offset, acked = -1, []
    for line in info.decode().splitlines():
        name, _, value = line.partition(":")
        if name == "master_repl_offset":
            offset = int(value)
        elif name.startswith("slave") and name[5:].isdigit():
            fields = dict(field.partition("=")[::2] for field in value.split(","))
            acked.append(int(fields["offset"]))
    return offset, acked


@dataclass(frozen=True, slots=True)
class NodeRole:
    """What a cluster node says of itself (its ``myself`` line of ``CLUSTER NODES``).

    ``master_id``: the master a replica copies (``None`` for a master); ``slots``: the
    ranges a master owns, without the ones it is migrating or importing."""

    node_id: str
    master_id: str | None
    slots: tuple[tuple[int, int], ...]

    @property
    def is_master(self) -> bool:
        return self.master_id is None

    @classmethod
    def parse(cls, nodes_text: str) -> NodeRole:
        for line in nodes_text.splitlines():
            fields = line.split()
            if len(fields) > 7 and "myself" in fields[2].split(","):
                ranges = []
                for item in fields[8:]:
                    if item.startswith("["):  # a slot being migrated, not owned
                        continue
                    lo, _, hi = item.partition("-")
                    ranges.append((int(lo), int(hi or lo)))
                replica = "slave" in fields[2].split(",")
                return cls(fields[0], fields[3] if replica else None, tuple(ranges))
        raise TierUnavailable("redis", f"no myself line in CLUSTER NODES: {nodes_text!r}")


class RedisCluster:
    """``masters`` cluster-enabled masters (three by default), each with ``replicas``
    replicas (none by default), slots spread by ``redis-cli --cluster create``.

    Every node binds ``host`` and announces it (``--cluster-announce-ip``), so that
    what ``CLUSTER SLOTS`` and ``MOVED`` tell clients is an address they can reach:
    the loopback by default, a bridge's address for clients in other network
    namespaces. ``node_timeout_ms`` is ``cluster-node-timeout``: how long a master
    may be silent before it is failed and a replica takes over. ``extra_args`` go
    to every node (``--maxmemory``, ``--cluster-require-full-coverage no``).

    Which node is a master is the cluster's to say, not the list's: after
    ``fail_over`` a replica is one, and the old master, started again, rejoins
    as its replica. ``masters()`` and ``replica_of()`` ask the nodes.
    """

    def __init__(
        self,
        directory: Path | None = None,
        *,
        masters: int = 3,
        replicas: int = 0,
        host: str = HOST,
        node_timeout_ms: int = 15000,
        extra_args: Sequence[str] = (),
        password: str | None = None,
        tls: ServerTLS | None = None,
    ) -> None:
        if REDIS_CLI is None:
            raise ConfigError(f"redis-cli is not installed ({REDIS_INSTALL})")
        self._own_dir = directory is None
        if directory is None:
            directory = Path(tempfile.mkdtemp(prefix="kvs-cluster-"))
        self.directory = directory
        self.host = host
        self.replicas = replicas
        self._master_count = masters
        self.nodes: list[RedisServer] = []
        self.password = password
        self.tls = tls
        self._created = False
        secured = [] if password is None else ["--masterauth", password]
        if tls is not None:
            secured += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        for index in range(masters * (1 + replicas)):
            port = free_port(cluster_bus=True)
            node_args = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", str(node_timeout_ms),
                "--cluster-announce-ip", host,
                # A replica's first sync starts at once, not after the default 5 s.
                "--repl-diskless-sync-delay", "0",
                *secured,
                *extra_args,
            ]  # fmt: skip
            self.nodes.append(
                RedisServer(
                    self.directory / f"node{index}",
                    port=port,
                    host=host,
                    extra_args=node_args,
                    password=password,
                    tls=tls,
                )
            )

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def startup_nodes(self) -> list[str]:
        """``host:port`` of every node, as ``RedisTier(..., cluster=True)`` takes them."""
        return [f"{self.host}:{port}" for port in self.ports]

    def start(self, timeout_s: float = 30.0) -> None:
        """Start every stopped node; join them on the first start; wait until every
        node says ``cluster_state:ok`` and knows them all, and every replica is in sync.

        A node restarted later rejoins from its ``nodes-<port>.conf`` (empty: there
        is no persistence): a master with the same slots, or, if its replica took
        over meanwhile, as that replica's replica.
        """
        for node in self.nodes:
            node.start()
        if not self._created:
            self._cli(
                "create", *self.startup_nodes,
                "--cluster-replicas", str(self.replicas), "--cluster-yes",
                timeout_s=timeout_s,
            )  # fmt: skip
            self._created = True
        self._wait("the cluster did not settle", self._settled, timeout_s)

    def _cli(self, command: str, *args: str, timeout_s: float) -> None:
        """``redis-cli --cluster command args``, logged in and speaking TLS as the nodes do."""
        assert REDIS_CLI is not None
        cli_env = dict(os.environ)
        if self.password is not None:
            cli_env["REDISCLI_AUTH"] = self.password  # not on the command line
        tls = [] if self.tls is None else self.tls.cli_args()
        subprocess.run(
            [REDIS_CLI, *tls, "--cluster", command, *args],
            check=True,
            capture_output=True,
            timeout=timeout_s,
            env=cli_env,
        )

    @staticmethod
    def _wait(what: str, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TierUnavailable("redis", what)
            time.sleep(0.05)

    def _settled(self) -> bool:
        known = f"cluster_known_nodes:{len(self.nodes)}\r\n".encode()
        for node in self.nodes:
            info = self._ask(node, "CLUSTER", "INFO")
            if b"cluster_state:ok" not in info or known not in info:
                return False
        replicas = [node for node in self.nodes if not self.role(node).is_master]
        return len(replicas) == self._master_count * self.replicas and all(
            b"master_link_status:up" in self._ask(node, "INFO", "replication") for node in replicas
        )

    @staticmethod
    def _ask(node: RedisServer, *args: str) -> bytes:
        """A node's reply, or nothing if it does not answer (yet)."""
        with contextlib.suppress(OSError):
            return node.command(*args)
        return b""

    def _running(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.running]

    def role(self, node: RedisServer) -> NodeRole:
        """What ``node`` says it is: master or replica (of which), and its slots."""
        return NodeRole.parse(node.command("CLUSTER", "NODES").decode())

    def masters(self) -> list[RedisServer]:
        """The running nodes that are masters now."""
        return [node for node in self._running() if self.role(node).is_master]

    def replica_of(self, master: RedisServer) -> RedisServer:
        """A running replica of ``master``."""
        master_id = self.role(master).node_id
        return next(n for n in self._running() if self.role(n).master_id == master_id)

    def wait_replicated(self, master: RedisServer, timeout_s: float = 30.0) -> None:
        """Wait until ``master``'s replicas have acknowledged all it has written so far.

        ``WAIT`` cannot say so here: it counts the replicas that acknowledged the
        *calling connection's* last write, and ``command`` opens a fresh connection
        that wrote nothing, so it answers at once even with the replica stopped.
        The master's ``INFO replication`` can: its offset now, and the offset each
        replica acknowledged (replicas acknowledge once a second)."""
        written = _replication(self._ask(master, "INFO", "replication"))[0]

        def acknowledged() -> bool:
            _, acked = _replication(self._ask(master, "INFO", "replication"))
            return len(acked) >= self.replicas and all(offset >= written for offset in acked)

        self._wait(f"the replicas of port {master.port} fell behind", acknowledged, timeout_s)

    def fail_over(self, master: RedisServer, timeout_s: float = 30.0) -> RedisServer:
        """SIGKILL ``master``; wait until its replica has taken over and every running
        node says ``cluster_state:ok``; the promoted replica."""
        replica = self.replica_of(master)
        master.kill()

        def promoted() -> bool:
            return self.role(replica).is_master and all(
                b"cluster_state:ok" in self._ask(node, "CLUSTER", "INFO")
                for node in self._running()
            )

        self._wait(f"no replica took over from port {master.port}", promoted, timeout_s)
        return replica

    def keyslot(self, key: bytes) -> int:
        """The slot of ``key``, as the cluster computes it (``CLUSTER KEYSLOT``)."""
        reply = self._running()[0].command("CLUSTER", "KEYSLOT", key)
        assert reply.startswith(b":"), reply
        return int(reply[1:].strip())

    def port_for_key(self, key: bytes) -> int:
        """Port of the master that owns ``key``'s slot, from each node's ``CLUSTER NODES``."""
        return self._owner(self.keyslot(key)).port

    def _owner(self, slot: int) -> RedisServer:
        for node in self.masters():
            if any(lo <= slot <= hi for lo, hi in self.role(node).slots):
                return node
        raise LookupError(f"slot {slot} is not served")

    @staticmethod
    def node_id(node: RedisServer) -> str:
        return node.command("CLUSTER", "MYID").split(b"\r\n")[1].decode()

    def migrate_slot(self, slot: int, keys: Sequence[bytes], to_port: int) -> Callable[[], None]:
        """Start moving ``slot`` (holding exactly ``keys``) to the master on ``to_port``.

        The keys are migrated but the slot stays ``MIGRATING``/``IMPORTING``, so
        the old owner answers ``ASK``. Call the returned function to finish the
        move (``CLUSTER SETSLOT NODE`` everywhere); from then on ``MOVED``.
        """
        source = self._owner(slot)
        target = next(n for n in self.nodes if n.port == to_port)
        source_id, target_id = self.node_id(source), self.node_id(target)
        steps: list[tuple[RedisServer, tuple[str | bytes, ...]]] = [
            (target, ("CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)),
            (source, ("CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)),
            (source, ("MIGRATE", self.host, str(target.port), "", "0", "5000", "KEYS", *keys)),
        ]
        for node, args in steps:
            reply = node.command(*args)
            if not reply.startswith(b"+OK"):
                raise TierUnavailable("redis", f"{args[:3]} failed: {reply!r}")

        def finish() -> None:
            for node in self.masters():
                node.command("CLUSTER", "SETSLOT", str(slot), "NODE", target_id)

        return finish

    def reshard(
        self, source: RedisServer, target: RedisServer, slots: int, timeout_s: float = 60.0
    ) -> None:
        """Move ``slots`` of ``source``'s slots, with their keys, to master ``target``
        (``redis-cli --cluster reshard``: slot by slot, ``ASK`` while a slot's keys
        move, ``MOVED`` after)."""
        self._cli(
            "reshard", f"{self.host}:{source.port}",
            "--cluster-from", self.node_id(source), "--cluster-to", self.node_id(target),
            "--cluster-slots", str(slots), "--cluster-yes",
            timeout_s=timeout_s,
        )  # fmt: skip

    def flushall(self) -> None:
        """Empty every master (replicas follow; they refuse ``FLUSHALL`` themselves)."""
        for node in self.masters():
            node.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Self:
        """Started; closed again if it fails to start (some nodes may be running)."""
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
