"""``Server``: runs the daemon from start to a clean exit (uvicorn's ``Server``).

Life of a daemon::

    check    refuse at once if a daemon listens on the socket or the TCP port
             (before anything of the store is opened or created)
    start    make the predictor (``[predictor]``; its placement policy is the
             store's eviction policy), then open the store (LMDB, the DRAM
             arena) on a worker thread
             bind the Unix socket (mode 0600; a stale socket file is removed,
             a live one is an error) and, if configured, TCP; print where
    serve    until SIGTERM or SIGINT; SIGHUP reloads the token, the lease TTL
             and the log level from the config file. First, on a worker thread,
             the predictor loads its model (events wait in its queue until it
             has); a ``weights`` file it cannot use stops the daemon (exit 1)
    drain    stop listening; new requests on open connections get 503;
             requests in flight get ``drain_timeout_s`` to finish (bodies
             still arriving included), then ``_STRAGGLER_TIMEOUT_S`` more
             while connections close, then are cancelled
    stop     release every lease; stop the predictor and save its model;
             flush what only DRAM holds down to LMDB
             (``flush_timeout_s``); close the store; remove the socket file

A second SIGTERM or SIGINT while draining is logged and ignored: the
deadlines already bound how long the exit takes.

Nothing before the sockets listen imports torch, which takes most of a second:
the store is handed bytes (``kvstore.tensors``), and the predictor's model, a
torch module, is loaded once the daemon serves
(``tests/server/test_lifecycle.py`` keeps it so).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import logging
import os
import signal
import socket
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web

from kvstore.errors import ConfigError, KVStoreError, StartupError
from kvstore.predictor.service import PredictorService
from kvstore.server.app import create_app
from kvstore.server.collector import (
    defer_full_passes,
    freeze_heap,
    full_passes,
    skip_exit_pass,
)
from kvstore.server.config import RELOADABLE, DaemonConfig, ServiceConfig
from kvstore.server.state import LEASES, STATE, DaemonState
from kvstore.store.tiered_store import TieredStore

log = logging.getLogger("kvstore.server")

# aiohttp's own graceful shutdown stops reading from a connection as soon as it
# starts, so a request whose body is still arriving could never finish. The
# Server therefore drains first (sites stopped, connections still read) and
# only then lets aiohttp close connections, giving stragglers this long.
_STRAGGLER_TIMEOUT_S = 1.0
_DRAIN_POLL_S = 0.02
# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Allocations up to this size come from the heap, so freed ones are reused:
# blocks of 16 MiB of KV and their headers fit. The most glibc's own dynamic
# threshold grows to.
_HEAP_ALLOCATIONS_UP_TO = 32 << 20


class Server:
    """One daemon: a store, one app, a Unix site and an optional TCP site."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.store: TieredStore | None = None
        self.app: web.Application | None = None
        self.runner: web.AppRunner | None = None
        self.listening: list[str] = []
        self._should_exit = asyncio.Event()
        self._socket_inode: int | None = None
        self._loading: asyncio.Task[None] | None = None  # the predictor's model, once listening
        self._collecting: asyncio.Task[None] | None = None  # full_passes
        self._failure: StartupError | None = None  # what stopped the daemon, raised by serve()

    @property
    def daemon(self) -> DaemonConfig:
        return self.config.daemon

    def run(self) -> int:
        """Serve until told to stop; the process exit status."""
        asyncio.run(self.serve())
        return 0

    async def serve(self) -> None:
        _reuse_freed_memory(min(self.daemon.max_body_bytes, 1 << 30))
        defer_full_passes()
        loop = asyncio.get_running_loop()
        executor = ThreadPoolExecutor(self.daemon.workers, thread_name_prefix="kvstore-io")
        loop.set_default_executor(executor)
        self._install_signal_handlers(loop)
        try:
            await self.startup()
            await self._should_exit.wait()
        finally:
            await self.shutdown()
            executor.shutdown(wait=True)
        if self._failure is not None:
            raise self._failure

    # -- startup ------------------------------------------------------------------

    async def startup(self) -> None:
        # Before anything is opened or created: a second daemon started by mistake
        # must not map the store's LMDB files or make a shared-memory arena first.
        _remove_stale_socket(self.daemon.socket_path)
        if self.daemon.tcp_port:
            _check_port_free(self.daemon.tcp_host, self.daemon.tcp_port)
        # The store opens LMDB inside these; it does not create their parents.
        for directory in _store_directories(self.config):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        config = self.config
        predictor = (
            PredictorService(config.predictor, config.store.data_dir)
            if config.predictor.enabled
            else None
        )
        # The daemon flushes on its way out, within ``flush_timeout_s`` (``stop``); its
        # store's own close must not flush again past that deadline.
        store_config = dataclasses.replace(self.config.store, flush_on_close=False)
        self.store = await asyncio.to_thread(
            TieredStore, store_config, policy=predictor.policy if predictor else None
        )
        if predictor is not None:
            predictor.attach(self.store)
        self.app = create_app(self.store, self.daemon, predictor)
        self.runner = web.AppRunner(
            self.app,
            shutdown_timeout=_STRAGGLER_TIMEOUT_S,
            access_log=logging.getLogger("kvstore.access") if self.daemon.access_log else None,
        )
        await self.runner.setup()
        await self._start_unix_site(self.runner, self.daemon.socket_path)
        if self.daemon.tcp_port is not None:
            await self._start_tcp_site(self.runner)
        self.app[STATE].listening = list(self.listening)
        for address in self.listening:
            print(f"kvstore: listening on {address}", flush=True)
        log.info(
            "serving %s (pid %d)",
            ", ".join(kind.label for kind in self.store.tier_kinds),
            os.getpid(),
        )
        self._collecting = asyncio.create_task(full_passes(), name="kvstore-gc")
        if predictor is not None:
            self._loading = asyncio.create_task(self._load_model(predictor))
        else:
            freeze_heap()

    async def _load_model(self, predictor: PredictorService) -> None:
        """The predictor's model, loaded while the daemon serves; ``weights`` it cannot
        use stop the daemon (the operator named them), any other failure only the
        predictor's learning (``PredictorService.load``)."""
        try:
            await predictor.load()
        except ConfigError as error:
            self._failure = StartupError(f"predictor: {error}")  # raised by serve()
            log.error("%s; stopping", self._failure)
            self._should_exit.set()
            return
        freeze_heap()  # torch is imported now (not when stopping: nothing to keep then)
        model = predictor.model
        if model is None:  # unavailable: the service has said why
            return
        log.info(
            "predictor: model from %s (horizons %s s)",
            predictor.source if predictor.source != "weights" else self.config.predictor.weights,
            ", ".join(f"{h:g}" for h in model.horizons),
        )

    async def _start_unix_site(self, runner: web.AppRunner, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_socket(path)
        # Bind with no permissions for group and others, so there is no window
        # in which another user could connect; chmod makes 0600 explicit.
        previous = os.umask(0o177)
        try:
            await web.UnixSite(runner, str(path)).start()
        finally:
            os.umask(previous)
        os.chmod(path, 0o600)
        self._socket_inode = path.stat().st_ino
        self.listening.append(f"unix://{path}")

    async def _start_tcp_site(self, runner: web.AppRunner) -> None:
        host, port = self.daemon.tcp_host, self.daemon.tcp_port
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as error:
            raise StartupError(f"cannot listen on {host}:{port}: {error.strerror}") from error
        bound = {sock[1] for sock in runner.addresses if isinstance(sock, tuple)}
        for actual in sorted(bound):
            shown = f"[{host}]" if ":" in host else host
            self.listening.append(f"http://{shown}:{actual}")

    # -- signals ------------------------------------------------------------------

    def _install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_stop_signal, signum)
        loop.add_signal_handler(signal.SIGHUP, self.reload)

    def _on_stop_signal(self, signum: int) -> None:
        if self._should_exit.is_set():
            log.warning("%s while shutting down: already draining", signal.Signals(signum).name)
            return
        log.info("%s: draining", signal.Signals(signum).name)
        self._should_exit.set()

    def reload(self) -> None:
        """Re-read the config file; apply what is safe to change while serving."""
        if self.config.path is None:
            log.warning("SIGHUP: no config file to reload")
            return
        try:
            fresh = ServiceConfig.load(self.config.path).daemon
        except ConfigError as error:
            log.error("SIGHUP: keeping the running config: %s", error)
            return
        current = self.daemon
        changes = {name: getattr(fresh, name) for name in RELOADABLE}
        self.config = dataclasses.replace(
            self.config, daemon=dataclasses.replace(current, **changes)
        )
        ignored = [
            f.name
            for f in dataclasses.fields(DaemonConfig)
            if f.name not in RELOADABLE and getattr(fresh, f.name) != getattr(current, f.name)
        ]
        if ignored:
            log.warning("SIGHUP: %s changed; restart to apply", ", ".join(sorted(ignored)))
        logging.getLogger("kvstore").setLevel(self.daemon.log_level_number)
        if self.app is not None:
            self.app[STATE].config = self.daemon
            self.app[LEASES].ttl_s = self.daemon.lease_ttl_s
        log.info(
            "SIGHUP: reloaded (lease_ttl_s=%s, log_level=%s, token %s)",
            self.daemon.lease_ttl_s,
            self.daemon.log_level,
            "changed" if fresh.auth_token != current.auth_token else "unchanged",
        )

    # -- shutdown -----------------------------------------------------------------

    async def shutdown(self) -> None:
        """Drain, stop, flush, close; each step runs even if an earlier one failed."""
        started = time.monotonic()
        if self._loading is not None:  # a model still loading is not waited for
            self._loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loading
            self._loading = None
        if self._collecting is not None:
            self._collecting.cancel()
            self._collecting = None
        if self.runner is not None and self.app is not None:
            await self._drain(self.runner, self.app[STATE])
            # Closes connections (stragglers get _STRAGGLER_TIMEOUT_S), then
            # runs the app's cleanup: the lease expiry stops, leases are released.
            await self.runner.cleanup()
            self.runner = None
        self._remove_socket()
        store, self.store = self.store, None
        if store is not None:
            try:
                if self.daemon.flush_on_exit:
                    deadline = time.monotonic() + self.daemon.flush_timeout_s
                    flushed = await asyncio.to_thread(store.flush, deadline=deadline)
                    log.info("flushed %d block(s) to persistent tiers", flushed)
            except KVStoreError:
                log.exception("flush failed")
            finally:
                await asyncio.to_thread(store.close)
        log.info("stopped in %.2f s", time.monotonic() - started)
        skip_exit_pass()

    async def _drain(self, runner: web.AppRunner, state: DaemonState) -> None:
        """Stop listening, then wait until no request is in flight or the deadline."""
        state.draining = True
        for site in list(runner.sites):
            await site.stop()
        deadline = time.monotonic() + self.daemon.drain_timeout_s
        while state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        if state.in_flight:
            log.warning("drain deadline passed with %d request(s) in flight", state.in_flight)

    def _remove_socket(self) -> None:
        """Remove our socket file (not one another daemon bound since)."""
        path = self.daemon.socket_path
        with contextlib.suppress(FileNotFoundError):
            if self._socket_inode is not None and path.stat().st_ino == self._socket_inode:
                path.unlink()
        self._socket_inode = None


def _remove_stale_socket(path: Path) -> None:
    """Remove a socket file left by a daemon that died; refuse if one is listening."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError as error:
        if error.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise StartupError(f"cannot check socket {path}: {error}") from error
        path.unlink(missing_ok=True)
        log.info("removed stale socket %s", path)
        return
    finally:
        probe.close()
    raise StartupError(f"another daemon is listening on {path}")


def _check_port_free(host: str, port: int) -> None:
    """Refuse a TCP port another process listens on, as the real bind later would
    (with ``SO_REUSEADDR``, as aiohttp binds: connections of a daemon that just
    exited do not count)."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as error:
        raise StartupError(f"cannot listen on {host}:{port}: {error}") from error
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise StartupError(f"another process is listening on {host}:{port}") from error
                raise StartupError(f"cannot listen on {host}:{port}: {error.strerror}") from error


def _reuse_freed_memory(retain_bytes: int) -> None:
    """Have glibc keep freed multi-MiB buffers for reuse instead of unmapping them.

    A put stages each block in a buffer of its own (MiBs), freed once the
    batch is stored. glibc serves allocations that large with ``mmap`` and
    unmaps them on ``free``, so every put would page-fault its whole body in
    again: joining 128 MiB of received 2 MiB blocks took 58 ms that way and
    16 ms with this (the daemon's CPU per 128 MiB put: 120 -> 90 ms).
    Up to ``retain_bytes`` of freed heap stays mapped. No-op without glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_ALLOCATIONS_UP_TO)
    libc.mallopt(_M_TRIM_THRESHOLD, retain_bytes)


def _store_directories(config: ServiceConfig) -> list[Path]:
    directories = [config.store.data_dir]
    directories += [tier.path.parent for tier in config.store.tiers if tier.path is not None]
    return directories


def configure_logging(config: DaemonConfig) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("kvstore").setLevel(config.log_level_number)
