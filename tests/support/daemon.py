"""Real ``kvstore serve`` daemons for tests: subprocesses with DRAM and LMDB in a temp dir.

No in-process shortcuts: the daemon is started exactly as an operator would
(``python -m kvstore serve --config FILE``), so signals, socket files, exit
codes and the LMDB files on disk are the real ones.

Fixtures (registered in ``tests/conftest.py``):

``daemon``          function-scoped handle on one daemon shared by the session
                    (DRAM 64 MiB + LMDB, Unix socket plus TCP with a token),
                    restarted first if an earlier test stopped it. Its data
                    persists between tests: use a namespace of your own
                    (``kv.namespace(salt=request.node.name)``).
``daemon_factory``  function-scoped ``make(config_text=None, *, daemon=None,
                    tcp=False, token=AUTO_TOKEN, launcher=(), start=True) -> Daemon``
                    for a private daemon (small DRAM, short leases, stop/kill/restart);
                    every daemon it made is stopped after the test.

``launcher`` is an argv prefix the daemon is started under: ``ip netns exec
NAME`` (``support.netns.Host.launcher``) runs it in a network namespace of its
own. ``ip netns exec`` execs the command in place, so ``proc`` is the daemon
itself and signals reach it; its Unix socket is a path, not namespaced, so
the health check and every client here reach it as usual.

``Daemon`` exposes ``socket_path``, ``url`` (``unix://...``), ``tcp_url``,
``token``, ``proc``, ``data_dir``, ``config_path``; ``start()`` (``launch()``
then ``wait_ready()``; ``start_all(daemons)`` starts several at once),
``stop(signal) -> exit code``, ``kill()`` (SIGKILL), ``restart()``; and
``client()`` / ``tcp_client(token=...)``: httpx clients to close after use.

Daemons never outlive the session: the fixtures stop them in ``finally``,
an ``atexit`` hook kills leftovers, and each is started with
``PR_SET_PDEATHSIG`` so the kernel stops it if pytest itself is killed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.local.processes import LIVE, free_port, spawn

HOST = "127.0.0.1"
AUTO_TOKEN = "auto"  # token= default: a random token when TCP is on, none otherwise
# Store part of the default config; {data_dir} is replaced by the daemon's directory.
DEFAULT_STORE_TOML = """\
data_dir = "{data_dir}"
max_batch_chunks = 1024
max_lookup_chunks = 2048

[tiers.dram]
capacity = "64MiB"

[tiers.ssd]
capacity = "256MiB"
"""
DEFAULT_DAEMON: dict[str, Any] = {
    "max_body_bytes": 64 << 20,
    "drain_timeout_s": 5.0,
    "workers": 4,
}


class DaemonStartError(RuntimeError):
    """The daemon exited (or never answered) while starting; carries its output."""

    def __init__(self, message: str, returncode: int | None, output: str) -> None:
        super().__init__(f"{message} (exit code {returncode}):\n{output}")
        self.returncode = returncode
        self.output = output


class Daemon:
    """One ``kvstore serve`` subprocess over a directory of its own."""

    def __init__(
        self,
        data_dir: Path,
        socket_dir: Path,
        *,
        config_text: str | None = None,
        daemon: Mapping[str, Any] | None = None,
        tcp: bool = False,
        token: str | None = AUTO_TOKEN,
        launcher: Sequence[str] = (),
    ) -> None:
        self.data_dir = data_dir
        self.launcher = list(launcher)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Unix socket paths are limited to 107 bytes; pytest's tmp paths can be longer.
        self.socket_path = Path((daemon or {}).get("socket_path", socket_dir / "kvstore.sock"))
        self.config_path = data_dir / "kvstore.toml"
        self.log_path = data_dir / "daemon.log"
        if token == AUTO_TOKEN:
            token = secrets.token_hex(16) if tcp else None
        self.token = token
        self.tcp_port = free_port() if tcp else None
        settings = {**DEFAULT_DAEMON, **(daemon or {}), "socket_path": str(self.socket_path)}
        if self.tcp_port is not None:
            settings["tcp_host"] = HOST
            settings["tcp_port"] = self.tcp_port
        if token is not None:
            settings["auth_token"] = token
        store_text = (config_text or DEFAULT_STORE_TOML).replace("{data_dir}", str(data_dir))
        self.write_config(store_text, settings)
        self.proc: subprocess.Popen[bytes] | None = None

    def write_config(self, store_text: str, settings: Mapping[str, Any]) -> None:
        """(Re)write the config file: the store part, then the ``[daemon]`` table."""
        lines = [store_text.rstrip(), "", "[daemon]"]
        lines += [f"{name} = {_toml_value(value)}" for name, value in settings.items()]
        self.config_path.write_text("\n".join(lines) + "\n")
        self._store_text, self._settings = store_text, dict(settings)

    def update_daemon_settings(self, **changes: Any) -> None:
        """Change ``[daemon]`` fields in the file (then ``reload()`` or restart)."""
        settings = {**self._settings, **changes}
        self.write_config(self._store_text, {k: v for k, v in settings.items() if v is not None})

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def tcp_url(self) -> str | None:
        return None if self.tcp_port is None else f"http://{HOST}:{self.tcp_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- lifecycle ------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> None:
        """Start ``python -m kvstore serve`` and wait until ``/healthz`` answers."""
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process without waiting for it (``wait_ready`` does).

        Call it from a thread that outlives the daemon: the kernel's
        ``PR_SET_PDEATHSIG`` fires when the *thread* that started a child exits,
        so a daemon launched from a pool's worker is stopped with that worker.
        ``start_all`` below launches several on this thread, then waits for all."""
        if self.running:
            return
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        argv = [*self.launcher, sys.executable, "-m", "kvstore", "serve"]
        argv += ["--config", str(self.config_path)]
        self.proc = spawn(argv, self.log_path, env=env)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until ``/healthz`` answers; raise ``DaemonStartError`` if it exits first
        or stays silent for ``timeout_s``."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                self._forget()
                raise DaemonStartError("kvstore serve exited", code, self.log())
            if self._healthy():
                return
            time.sleep(0.05)
        self.kill()
        raise DaemonStartError("kvstore serve did not answer /healthz", None, self.log())

    def _healthy(self) -> bool:
        """Whether ``/healthz`` answers 200 (raw HTTP: a refused connection must
        not leave a half-made client behind)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(1.0)
                sock.connect(str(self.socket_path))
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: kvstore\r\nConnection: close\r\n\r\n")
                return sock.recv(64).startswith(b"HTTP/1.1 200")
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int | None:
        """Send ``sig`` and wait for the exit; return the exit code (None if not running)."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout_s)
        code = proc.returncode
        self._forget()
        return code

    def kill(self) -> int | None:
        """SIGKILL: no drain, no flush, no cleanup (a crash)."""
        return self.stop(signal.SIGKILL)

    def restart(self, timeout_s: float = 30.0) -> None:
        self.stop()
        self.start(timeout_s)

    def reload(self) -> None:
        """SIGHUP: re-read the config file."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def _forget(self) -> None:
        if self.proc is not None:
            LIVE.discard(self.proc)
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()

    # -- talking to it --------------------------------------------------------------

    def client(self, timeout_s: float = 10.0) -> httpx.Client:
        """An httpx client over the Unix socket (close it, or use ``with``)."""
        return httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.socket_path)),
            base_url="http://kvstore",
            timeout=timeout_s,
        )

    def tcp_client(self, token: str | None = AUTO_TOKEN, timeout_s: float = 10.0) -> httpx.Client:
        """An httpx client over TCP, sending ``token`` (default: the daemon's; None: none)."""
        assert self.tcp_url is not None, "this daemon has no TCP site"
        if token == AUTO_TOKEN:
            token = self.token
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        return httpx.Client(base_url=self.tcp_url, headers=headers, timeout=timeout_s)

    def log(self, nbytes: int = 8000) -> str:
        if not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")


def start_all(daemons: Sequence[Daemon], timeout_s: float = 30.0) -> None:
    """Start several daemons at once: each spends seconds importing, so they are all
    launched before any is waited for."""
    for daemon in daemons:
        daemon.launch()
    for daemon in daemons:
        daemon.wait_ready(timeout_s)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


@contextlib.contextmanager
def socket_dir() -> Iterator[Path]:
    """A short private directory for daemons' sockets (Unix socket paths are limited to
    ~100 bytes), removed on exit."""
    path = Path(tempfile.mkdtemp(prefix="kvs-sock-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- fixtures


@contextlib.contextmanager
def running_daemon(data_dir: Path, **options: Any) -> Iterator[Daemon]:
    """A started ``Daemon`` over ``data_dir`` (its socket in a short private
    directory: Unix socket paths are limited to ~100 bytes), closed on exit."""
    with socket_dir() as sockets:
        started = Daemon(data_dir, sockets, **options)
        try:
            started.start()
            yield started
        finally:
            started.close()


@pytest.fixture(scope="session")
def _shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("daemon"), tcp=True) as shared:
        yield shared


@pytest.fixture
def daemon(_shared_daemon: Daemon) -> Daemon:
    """The session's daemon, started again if an earlier test stopped it."""
    _shared_daemon.start()
    return _shared_daemon


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    made: list[Daemon] = []
    with socket_dir() as sockets:

        def make(
            config_text: str | None = None,
            *,
            daemon: Mapping[str, Any] | None = None,
            tcp: bool = False,
            token: str | None = AUTO_TOKEN,
            launcher: Sequence[str] = (),
            start: bool = True,
        ) -> Daemon:
            index = len(made)
            instance = Daemon(
                tmp_path / f"daemon{index}",
                sockets / str(index),
                config_text=config_text,
                daemon=daemon,
                tcp=tcp,
                token=token,
                launcher=launcher,
            )
            instance.socket_path.parent.mkdir(mode=0o700, exist_ok=True)
            made.append(instance)
            if start:
                instance.start()
            return instance

        try:
            yield make
        finally:
            for instance in made:
                instance.close()
