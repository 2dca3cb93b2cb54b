"""Private ``redis-server`` processes on free loopback ports: the replay's Redis tier
(``--redis-gb``), the benchmarks', and the tests'.

Never the shared ``127.0.0.1:6379``: each server gets a port of its own
(``kvstore.local.processes.free_port``), runs without persistence (``--save ''``,
``--appendonly no``: a restart comes back empty, which a cache tier must
survive anyway) and dies with the process that started it
(``kvstore.local.processes.spawn``).

* ``RedisServer``: one standalone server. ``stop()`` and ``start()`` again on
  the same port, so a caller can take Redis away and bring it back;
  ``pause()`` leaves the port open with nobody answering (a hung server).
* ``RedisCluster`` (``redis_cluster``): masters, replicas, fail-over and
  slot migration, on servers started here.

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
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from kvstore.errors import ConfigError, TierUnavailable
from kvstore.local.processes import HOST, free_port, spawn, stop_process

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
REDIS_INSTALL = "apt-get install redis-server"  # what to run when either is missing


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
            raise ConfigError(f"redis-server is not installed ({REDIS_INSTALL})")
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
