"""Private ``redis-server`` processes on free loopback ports: the replay's Redis tier
(``--redis-gb``), the benchmarks', and the tests'.

Never the shared ``127.0.0.1:6379``: each server gets a port of its own
(``kvstore.processes.free_port``), runs without persistence (``--save ''``,
``--appendonly no``: a restart comes back empty, which a cache tier must
survive anyway) and dies with the process that started it
(``kvstore.processes.spawn``).

* ``RedisServer``: one standalone server. ``stop()`` and ``start()`` again on
  the same port, so a caller can take Redis away and bring it back;
  ``pause()`` leaves the port open with nobody answering (a hung server).
* ``RedisCluster``: masters (three by default), each with replicas or none
  (the default), joined with ``redis-cli --cluster create``, on the loopback
  or on an address that other network namespaces reach; a master can be
  killed for its replica to take over (``fail_over``), and slots migrated to
  exercise ``ASK`` and ``MOVED``.

Either may be secured: ``password`` starts it with ``--requirepass`` (and
``--masterauth`` in a cluster), ``tls`` (a ``ServerTLS``) serves TLS only
(``--port 0``, ``--tls-port``), on the cluster bus too.

Health checks and set-up commands speak RESP over a raw socket
(``resp_command``, which logs in and speaks TLS as the server needs) rather
than through redis-py, so no client (and no ``ResourceWarning``) is left
behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from kvstore.errors import ConfigError, TierUnavailable
from kvstore.processes import HOST, free_port, spawn, stop_process

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
_INSTALL = "apt-get install redis-server"


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """What a TLS ``redis-server`` is started with: its certificate and key, and the CA
    that signed them. ``client_certs``: clients must show a certificate signed by that
    CA (``--tls-auth-clients yes``); this helper's own checks then show the server's."""

    cert_file: Path
    key_file: Path
    ca_file: Path
    client_certs: bool = False

    def server_args(self, port: int) -> list[str]:
        return [
            "--port", "0",
            "--tls-port", str(port),
            "--tls-cert-file", str(self.cert_file),
            "--tls-key-file", str(self.key_file),
            "--tls-ca-cert-file", str(self.ca_file),
            "--tls-auth-clients", "yes" if self.client_certs else "no",
        ]  # fmt: skip

    def cli_args(self) -> list[str]:
        """``redis-cli``'s flags to reach such a server."""
        return [
            "--tls",
            "--cacert", str(self.ca_file),
            "--cert", str(self.cert_file),
            "--key", str(self.key_file),
        ]  # fmt: skip

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.load_cert_chain(str(self.cert_file), str(self.key_file))
        return context


def _encode(*args: str | bytes) -> bytes:
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        raw = arg.encode() if isinstance(arg, str) else arg
        parts.append(f"${len(raw)}\r\n".encode() + raw + b"\r\n")
    return b"".join(parts)


def _reply(sock: socket.socket) -> bytes:
    reply = b""
    while not _complete(reply):
        chunk = sock.recv(65536)
        if not chunk:
            break
        reply += chunk
    return reply


@contextlib.contextmanager
def _connect(
    host: str, port: int, timeout_s: float, tls: ServerTLS | None
) -> Iterator[socket.socket]:
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        if tls is None:
            yield sock
            return
        with tls.client_context().wrap_socket(sock, server_hostname=host) as secure:
            yield secure


def resp_command(
    port: int,
    *args: str | bytes,
    host: str = HOST,
    timeout_s: float = 1.0,
    password: str | None = None,
    tls: ServerTLS | None = None,
) -> bytes:
    """Send one command over a raw socket (``AUTH password`` first, if given); return
    the raw reply (simple, error, integer, bulk), or ``AUTH``'s if it was refused."""
    with _connect(host, port, timeout_s, tls) as sock:
        if password is not None:
            sock.sendall(_encode("AUTH", password))
            login = _reply(sock)
            if not login.startswith(b"+OK"):
                return login
        sock.sendall(_encode(*args))
        return _reply(sock)


def _complete(reply: bytes) -> bool:
    """Whether a simple, error, integer or bulk reply has fully arrived."""
    head, sep, rest = reply.partition(b"\r\n")
    if not sep:
        return False
    if head[:1] != b"$":
        return True
    length = int(head[1:])
    return length < 0 or len(rest) >= length + 2


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


class RedisServer:
    """One ``redis-server`` on a loopback port (or on ``host``, an address of this
    machine), restartable on the same port.

    Persistence is off (``--save ''``, ``--appendonly no``): a restart comes back
    empty, which is what a cache tier must survive anyway.
    """

    def __init__(
        self,
        directory: Path | None = None,
        *,
        port: int | None = None,
        host: str = HOST,
        extra_args: Sequence[str] = (),
        password: str | None = None,
        tls: ServerTLS | None = None,
    ) -> None:
        if REDIS_SERVER is None:
            raise ConfigError(f"redis-server is not installed ({_INSTALL})")
        self._own_dir = directory is None
        if directory is None:
            directory = Path(tempfile.mkdtemp(prefix="kvs-redis-"))
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        if port is None:
            port = free_port(cluster_bus="--cluster-enabled" in extra_args)
        self.port = port
        self.host = host
        self.extra_args = list(extra_args)
        self.password = password
        self.tls = tls
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://`` (``rediss://`` under TLS) without credentials."""
        scheme = "redis" if self.tls is None else "rediss"
        return f"{scheme}://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server (again) on ``self.port`` and wait until PING answers."""
        if self.running:
            return
        assert REDIS_SERVER is not None
        listen = ["--port", str(self.port)] if self.tls is None else self.tls.server_args(self.port)
        login = [] if self.password is None else ["--requirepass", self.password]
        argv = [
            REDIS_SERVER,
            *listen,
            "--bind", self.host,
            # Protected mode refuses every client but the loopback's when there is no
            # password; bound to one private address, the bind is the protection.
            "--protected-mode", "no",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", str(self.directory),
            *login,
            *self.extra_args,
        ]  # fmt: skip
        # A session of its own: a Ctrl-C at the terminal reaches only the parent, which
        # stops the server itself, so it never vanishes in the middle of a cleanup.
        self._proc = spawn(argv, self.directory / f"redis-{self.port}.log", new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._forget()
                raise TierUnavailable(
                    "redis", f"redis-server on port {self.port} exited: {self.log_tail()}"
                )
            with contextlib.suppress(OSError):
                if self.command("PING").startswith(b"+PONG"):
                    return
            time.sleep(0.02)
        self.stop()
        raise TierUnavailable("redis", f"redis-server on port {self.port} did not answer PING")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM and wait (SIGKILL if it lingers). Idempotent."""
        if self._proc is not None:
            stop_process(self._proc, timeout_s)
        self._proc = None

    def _forget(self) -> None:
        if self._proc is not None:
            stop_process(self._proc)
        self._proc = None

    def kill(self) -> None:
        """SIGKILL: the server dies as in a crash, its clients' sockets reset."""
        assert self._proc is not None
        self._proc.kill()
        self._forget()

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers (a hung server)."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def command(self, *args: str | bytes) -> bytes:
        """Raw RESP reply of one command (for test set-up: FLUSHALL, CONFIG SET...)."""
        return resp_command(self.port, *args, host=self.host, password=self.password, tls=self.tls)

    def flushall(self) -> None:
        reply = self.command("FLUSHALL")
        if not reply.startswith(b"+OK"):
            raise TierUnavailable("redis", f"FLUSHALL failed: {reply!r}")

    def log_tail(self, nbytes: int = 2000) -> str:
        path = self.directory / f"redis-{self.port}.log"
        return path.read_bytes()[-nbytes:].decode(errors="replace") if path.exists() else ""

    def close(self) -> None:
        """Stop and remove the temporary directory if this helper made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


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
            raise ConfigError(f"redis-cli is not installed ({_INSTALL})")
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
