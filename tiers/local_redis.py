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
* ``RedisCluster``: masters (three by default), no replicas, joined with
  ``redis-cli --cluster create``; slots can be migrated to exercise ``ASK``
  and ``MOVED``.

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
def _connect(port: int, timeout_s: float, tls: ServerTLS | None) -> Iterator[socket.socket]:
    with socket.create_connection((HOST, port), timeout=timeout_s) as sock:
        if tls is None:
            yield sock
            return
        with tls.client_context().wrap_socket(sock, server_hostname=HOST) as secure:
            yield secure


def resp_command(
    port: int,
    *args: str | bytes,
    timeout_s: float = 1.0,
    password: str | None = None,
    tls: ServerTLS | None = None,
) -> bytes:
    """Send one command over a raw socket (``AUTH password`` first, if given); return
    the raw reply (simple, error, integer, bulk), or ``AUTH``'s if it was refused."""
    with _connect(port, timeout_s, tls) as sock:
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


class RedisServer:
    """One ``redis-server`` on a loopback port, restartable on the same port.

    Persistence is off (``--save ''``, ``--appendonly no``): a restart comes back
    empty, which is what a cache tier must survive anyway.
    """

    def __init__(
        self,
        directory: Path | None = None,
        *,
        port: int | None = None,
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
        self.extra_args = list(extra_args)
        self.password = password
        self.tls = tls
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://`` (``rediss://`` under TLS) without credentials."""
        scheme = "redis" if self.tls is None else "rediss"
        return f"{scheme}://{HOST}:{self.port}/0"

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
            "--bind", HOST,
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
        return resp_command(self.port, *args, password=self.password, tls=self.tls)

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


class RedisCluster:
    """Three cluster-enabled masters, no replicas, slots spread by ``redis-cli``."""

    def __init__(
        self,
        directory: Path | None = None,
        *,
        masters: int = 3,
        password: str | None = None,
        tls: ServerTLS | None = None,
    ) -> None:
        if REDIS_CLI is None:
            raise ConfigError(f"redis-cli is not installed ({_INSTALL})")
        self._own_dir = directory is None
        if directory is None:
            directory = Path(tempfile.mkdtemp(prefix="kvs-cluster-"))
        self.directory = directory
        self.nodes: list[RedisServer] = []
        self.password = password
        self.tls = tls
        self._created = False
        secured = [] if password is None else ["--masterauth", password]
        if tls is not None:
            secured += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        for index in range(masters):
            node_dir = self.directory / f"node{index}"
            port = free_port(cluster_bus=True)
            self.nodes.append(
                RedisServer(
                    node_dir,
                    port=port,
                    extra_args=(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        f"nodes-{port}.conf",
                        "--cluster-node-timeout",
                        "15000",
                        *secured,
                    ),
                    password=password,
                    tls=tls,
                )  # fmt: skip
            )

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def startup_nodes(self) -> list[str]:
        """``host:port`` of every master, as ``RedisTier(..., cluster=True)`` takes them."""
        return [f"{HOST}:{port}" for port in self.ports]

    def start(self, timeout_s: float = 30.0) -> None:
        """Start every stopped node; join them on the first start; wait for ``cluster_state:ok``.

        A node restarted later rejoins from its ``nodes-<port>.conf`` with the
        same slots (empty: there is no persistence).
        """
        assert REDIS_CLI is not None
        for node in self.nodes:
            node.start()
        if not self._created:
            cli_env = dict(os.environ)
            if self.password is not None:
                cli_env["REDISCLI_AUTH"] = self.password  # not on the command line
            subprocess.run(
                [
                    REDIS_CLI, *([] if self.tls is None else self.tls.cli_args()),
                    "--cluster", "create",
                    *self.startup_nodes,
                    "--cluster-replicas", "0", "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=timeout_s,
                env=cli_env,
            )  # fmt: skip
            self._created = True
        deadline = time.monotonic() + timeout_s
        pending = list(self.nodes)
        while pending:
            if time.monotonic() > deadline:
                raise TierUnavailable("redis", "the cluster did not reach cluster_state:ok")
            pending = [node for node in pending if b"cluster_state:ok" not in self._info(node)]
            if pending:
                time.sleep(0.05)

    @staticmethod
    def _info(node: RedisServer) -> bytes:
        with contextlib.suppress(OSError):
            return node.command("CLUSTER", "INFO")
        return b""

    def keyslot(self, key: bytes) -> int:
        """The slot of ``key``, as the cluster computes it (``CLUSTER KEYSLOT``)."""
        reply = self.nodes[0].command("CLUSTER", "KEYSLOT", key)
        assert reply.startswith(b":"), reply
        return int(reply[1:].strip())

    def port_for_key(self, key: bytes) -> int:
        """Port of the master that owns ``key``'s slot, from each node's ``CLUSTER NODES``."""
        return self._owner_port(self.keyslot(key))

    def _owner_port(self, slot: int) -> int:
        for node in self.nodes:
            for lo, hi in self._own_slots(node):
                if lo <= slot <= hi:
                    return node.port
        raise LookupError(f"slot {slot} is not served")

    @staticmethod
    def _own_slots(node: RedisServer) -> list[tuple[int, int]]:
        text = node.command("CLUSTER", "NODES").decode()
        for line in text.splitlines():
            fields = line.split()
            if len(fields) > 2 and "myself" in fields[2]:
                ranges = []
                for item in fields[8:]:
                    if item.startswith("["):  # a slot being migrated, not owned
                        continue
                    lo, _, hi = item.partition("-")
                    ranges.append((int(lo), int(hi or lo)))
                return ranges
        return []

    @staticmethod
    def node_id(node: RedisServer) -> str:
        return node.command("CLUSTER", "MYID").split(b"\r\n")[1].decode()

    def migrate_slot(self, slot: int, keys: Sequence[bytes], to_port: int) -> Callable[[], None]:
        """Start moving ``slot`` (holding exactly ``keys``) to the master on ``to_port``.

        The keys are migrated but the slot stays ``MIGRATING``/``IMPORTING``, so
        the old owner answers ``ASK``. Call the returned function to finish the
        move (``CLUSTER SETSLOT NODE`` everywhere); from then on ``MOVED``.
        """
        source = next(n for n in self.nodes if n.port == self._owner_port(slot))
        target = next(n for n in self.nodes if n.port == to_port)
        source_id, target_id = self.node_id(source), self.node_id(target)
        steps: list[tuple[RedisServer, tuple[str | bytes, ...]]] = [
            (target, ("CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)),
            (source, ("CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)),
            (source, ("MIGRATE", HOST, str(target.port), "", "0", "5000", "KEYS", *keys)),
        ]
        for node, args in steps:
            reply = node.command(*args)
            if not reply.startswith(b"+OK"):
                raise TierUnavailable("redis", f"{args[:3]} failed: {reply!r}")

        def finish() -> None:
            for node in self.nodes:
                node.command("CLUSTER", "SETSLOT", str(slot), "NODE", target_id)

        return finish

    def flushall(self) -> None:
        for node in self.nodes:
            node.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
