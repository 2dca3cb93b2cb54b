"""Daemon settings: the ``[daemon]`` table of the store's TOML file, plus environment.

Kept apart from the running ``Server`` (as uvicorn keeps ``Config`` apart from
``Server``) and from the store's own settings, which live in the same file::

    data_dir = "/var/lib/kvstore"

    [tiers.dram]
    capacity = "8GiB"

    [tiers.ssd]
    capacity = "256GiB"

    [daemon]
    socket_path = "/run/kvstore/kvstore.sock"   # default <data_dir>/kvstore.sock
    tcp_port = 7480                              # TCP is off unless a port is set,
    auth_token = "..."                           #   and then needs a token
    lease_ttl_s = 10

    [predictor]                                  # the return-time predictor (on by default)
    horizons_s = [60, 600, 3600]
    weights = "/srv/kvstore/pretrained.pt"       # start from `kvstore train-predictor`

``KVSTORE_DAEMON_<FIELD>`` overrides one field (``KVSTORE_DAEMON_TCP_PORT=7480``)
and ``KVSTORE_AUTH_TOKEN`` the token, so the secret need not sit in the file;
``KVSTORE_PREDICTOR_<FIELD>`` does the same for ``[predictor]``. Values from
the environment are parsed by the field's type: a token of digits stays a
string.

Reloadable on SIGHUP (``RELOADABLE``): the token, the lease TTL and the log
level. Everything else needs a restart.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config import (
    CONFIG_VARIABLE,
    TOKEN_VARIABLE,
    env_table,
    expand_path,
    field_kinds,
    parse_size,
    read_settings,
)
from kvstore.errors import ConfigError
from kvstore.predictor.config import PredictorConfig
from kvstore.store.config import StoreConfig, apply_env_overrides

SOCKET_NAME = "kvstore.sock"
ENV_PREFIX = "KVSTORE_DAEMON_"
# The longest path a Unix socket can bind to on Linux (sun_path is 108 bytes).
MAX_SOCKET_PATH = 107
RELOADABLE = frozenset({"auth_token", "lease_ttl_s", "log_level"})
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# Fields given in bytes, which also accept "64MiB"-style strings.
_SIZE_FIELDS = frozenset(
    {"max_body_bytes", "max_json_bytes", "min_body_bytes_per_s", "put_start_bytes"}
)


@dataclass(frozen=True)
class DaemonConfig:
    """How ``kvstore serve`` listens and what it bounds.

    Memory bound of request bodies: ``max_concurrent_puts * max_body_bytes``
    (a put is validated whole before it is stored, so its body is buffered).

    Time bounds of a request, so that a slow client cannot hold a put slot or a
    connection for long: its headers must be complete within
    ``header_timeout_s`` of the connection opening (or of its previous
    response), and its body within ``body_deadline_s(length)``, whatever the
    pace of the bytes in between; a body that pauses for ``body_timeout_s`` is
    dropped sooner. Event times must lie within ``event_time_ahead_s`` after
    and ``event_time_behind_s`` before the daemon's clock: one event stamped
    far in the future would move the predictor's clock past every horizon.
    """

    socket_path: Path
    tcp_host: str = "127.0.0.1"
    tcp_port: int | None = None
    auth_token: str | None = field(default=None, repr=False)
    lease_ttl_s: float = 10.0
    max_leases: int = 1024
    max_namespaces: int = 4096
    max_body_bytes: int = 512 << 20
    max_json_bytes: int = 4 << 20
    max_concurrent_puts: int = 4
    # A put takes one of those slots once this much of its body (all of it, if smaller)
    # has arrived: below a socket's smallest receive window, so a client that sends at
    # once is never held back, while one that trickles never holds a slot.
    put_start_bytes: int = 16 << 10
    max_line_size: int = 8190
    max_field_size: int = 8190
    max_headers: int = 64
    drain_timeout_s: float = 10.0
    # A put whose body stops arriving for this long is dropped (its client gone quiet).
    body_timeout_s: float = 30.0
    # A request's whole body must arrive within body_deadline_base_s plus its length
    # at min_body_bytes_per_s (body_deadline_s), or it is answered 408 and dropped.
    body_deadline_base_s: float = 10.0
    min_body_bytes_per_s: int = 1 << 20
    # A connection's request headers must be complete this long after it opened or
    # its previous response ended, or it is closed (idle keep-alive ones too).
    header_timeout_s: float = 10.0
    # How far an event's time may lie from the daemon's clock, ahead and behind.
    event_time_ahead_s: float = 300.0
    event_time_behind_s: float = 6 * 3600.0
    flush_on_exit: bool = True
    flush_timeout_s: float = 60.0
    workers: int = 8
    events_kept: int = 10_000
    log_level: str = "info"
    access_log: bool = False

    def __post_init__(self) -> None:
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise ConfigError(
                f"socket_path {self.socket_path} is longer than {MAX_SOCKET_PATH} bytes"
            )
        if self.tcp_port is not None:
            if not 0 <= self.tcp_port <= 65535:
                raise ConfigError(f"tcp_port {self.tcp_port} is not a port number")
            if not self.auth_token:
                raise ConfigError(
                    "refusing to listen on TCP without an auth token: set daemon.auth_token "
                    f"or {TOKEN_VARIABLE}, or remove daemon.tcp_port"
                )
        for name in (
            "lease_ttl_s",
            "drain_timeout_s",
            "body_timeout_s",
            "body_deadline_base_s",
            "header_timeout_s",
            "event_time_ahead_s",
            "event_time_behind_s",
            "flush_timeout_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"daemon.{name} must be a positive number of seconds")
        for name in (
            "max_leases",
            "max_namespaces",
            "max_body_bytes",
            "max_json_bytes",
            "max_concurrent_puts",
            "put_start_bytes",
            "min_body_bytes_per_s",
            "max_line_size",
            "max_field_size",
            "max_headers",
            "workers",
            "events_kept",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"daemon.{name} must be positive")
        if self.log_level.lower() not in _LOG_LEVELS:
            raise ConfigError(f"daemon.log_level must be one of {', '.join(_LOG_LEVELS)}")

    def body_deadline_s(self, length: int) -> float:
        """How long a body of ``length`` bytes may take to arrive, all of it."""
        return self.body_deadline_base_s + length / self.min_body_bytes_per_s

    @property
    def log_level_number(self) -> int:
        return int(getattr(logging, self.log_level.upper()))

    @classmethod
    def from_mapping(
        cls,
        data: Mapping[str, Any],
        *,
        data_dir: Path,
        environ: Mapping[str, str] | None = None,
    ) -> DaemonConfig:
        """Build from the ``[daemon]`` table, then apply the environment."""
        if not isinstance(data, Mapping):
            raise ConfigError("'daemon' must be a table: [daemon]")
        env = os.environ if environ is None else environ
        types = field_kinds(cls)
        values: dict[str, Any] = {}
        for name, value in data.items():
            values[name] = _checked(name, value, types)
        if env.get(TOKEN_VARIABLE):
            values["auth_token"] = env[TOKEN_VARIABLE]
        env_kinds = {**types, **dict.fromkeys(_SIZE_FIELDS, "str")}
        for name, value in env_table(env, ENV_PREFIX, env_kinds).items():
            values[name] = _checked(name, value, types)
        values.setdefault("socket_path", data_dir / SOCKET_NAME)
        values["socket_path"] = expand_path(values["socket_path"])
        return cls(**values)


@dataclass(frozen=True)
class ServiceConfig:
    """Everything ``kvstore serve`` runs with: the store, the daemon, the predictor,
    and the file they came from (re-read on SIGHUP)."""

    store: StoreConfig
    daemon: DaemonConfig
    path: Path | None = None
    predictor: PredictorConfig = field(default_factory=PredictorConfig)

    @classmethod
    def load(
        cls, path: str | Path | None = None, environ: Mapping[str, str] | None = None
    ) -> ServiceConfig:
        """Read ``path`` (else ``$KVSTORE_CONFIG``, else the embedded default) and
        apply the environment to both halves."""
        env = os.environ if environ is None else environ
        data = read_settings(path, env)
        if path is None:
            path = env.get(CONFIG_VARIABLE) or None
        predictor = PredictorConfig.from_mapping(data.get("predictor", {}), environ=env)
        store = StoreConfig.from_mapping(apply_env_overrides(data, env))
        daemon = DaemonConfig.from_mapping(
            data.get("daemon", {}), data_dir=store.data_dir, environ=env
        )
        return cls(store, daemon, Path(path) if path is not None else None, predictor)


def _checked(name: str, value: Any, types: Mapping[str, Any]) -> Any:
    """``value`` for field ``name`` if it has the field's type (sizes may be strings)."""
    if name not in types:
        raise ConfigError(f"unknown daemon setting {name!r}; known: {sorted(types)}")
    kind = str(types[name])
    number = not isinstance(value, bool)
    if name in _SIZE_FIELDS:
        return parse_size(value)
    if value is None and kind.endswith("| None"):
        return None
    if kind == "Path" and isinstance(value, str | Path):
        return Path(value)
    if kind.startswith("int") and isinstance(value, int) and number:
        return value
    if kind == "float" and isinstance(value, int | float) and number:
        return float(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind.startswith("str") and isinstance(value, str):
        return value
    raise ConfigError(f"daemon.{name} must be of type {kind}, not {value!r}")
