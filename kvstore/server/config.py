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

import dataclasses
import logging
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config import StoreConfig, apply_env_overrides, parse_size
from kvstore.errors import ConfigError

SOCKET_NAME = "kvstore.sock"
TOKEN_VARIABLE = "KVSTORE_AUTH_TOKEN"
_ENV_PREFIX = "KVSTORE_DAEMON_"
_PREDICTOR_ENV_PREFIX = "KVSTORE_PREDICTOR_"
# The longest path a Unix socket can bind to on Linux (sun_path is 108 bytes).
MAX_SOCKET_PATH = 107
RELOADABLE = frozenset({"auth_token", "lease_ttl_s", "log_level"})
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# Fields given in bytes, which also accept "64MiB"-style strings.
_SIZE_FIELDS = frozenset({"max_body_bytes", "max_json_bytes"})


@dataclass(frozen=True)
class DaemonConfig:
    """How ``kvstore serve`` listens and what it bounds.

    Memory bound of request bodies: ``max_concurrent_puts * max_body_bytes``
    (a put is validated whole before it is stored, so its body is buffered).
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
    max_line_size: int = 8190
    max_field_size: int = 8190
    max_headers: int = 64
    drain_timeout_s: float = 10.0
    # A put whose body stops arriving for this long is dropped (its client gone quiet).
    body_timeout_s: float = 30.0
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
        for name in ("lease_ttl_s", "drain_timeout_s", "body_timeout_s", "flush_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"daemon.{name} must be a positive number of seconds")
        for name in (
            "max_leases",
            "max_namespaces",
            "max_body_bytes",
            "max_json_bytes",
            "max_concurrent_puts",
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
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name, value in data.items():
            values[name] = _checked(name, value, types)
        if env.get(TOKEN_VARIABLE):
            values["auth_token"] = env[TOKEN_VARIABLE]
        for variable, text in env.items():
            if variable.startswith(_ENV_PREFIX):
                name = variable[len(_ENV_PREFIX) :].lower()
                values[name] = _checked(name, _from_env(name, text, types), types)
        values.setdefault("socket_path", data_dir / SOCKET_NAME)
        values["socket_path"] = Path(os.path.expanduser(str(values["socket_path"])))
        return cls(**values)


@dataclass(frozen=True)
class PredictorConfig:
    """The ``[predictor]`` table: the return-time predictor and its placement policy.

    On by default: a daemon that learns nothing from its session events would
    keep LRU placement, which is what the predictor exists to beat, and the
    untrained model starts at the published base rates, so it never does
    worse than a fixed rule on day one. ``enabled = false`` keeps the store's
    LRU policy and only records events.

    ``weights`` is a model file from ``kvstore train-predictor`` to start
    from. The model the daemon learns is saved under ``<data_dir>/predictor/``
    every ``save_interval_s`` and at shutdown, and that file, when present,
    wins over ``weights`` on the next start (delete it to start over from
    ``weights``). ``horizons_s`` shape a new model only; a loaded one keeps
    its own. Session events wait in a queue of ``queue_size`` (a full queue
    drops and counts them: events are advisory); ``tick_s`` is the timer that
    labels passed horizons and re-places idle sessions; a session idle for
    ``forget_after_s`` is forgotten.
    """

    enabled: bool = True
    horizons_s: tuple[float, ...] = (60.0, 600.0, 3600.0)
    weights: Path | None = None
    tick_s: float = 5.0
    save_interval_s: float = 300.0
    queue_size: int = 10_000
    forget_after_s: float = 86_400.0

    def __post_init__(self) -> None:
        horizons = self.horizons_s
        if not horizons or any(not (math.isfinite(h) and h > 0) for h in horizons):
            raise ConfigError("predictor.horizons_s must be positive numbers of seconds")
        if any(a >= b for a, b in zip(horizons, horizons[1:], strict=False)):
            raise ConfigError("predictor.horizons_s must be increasing")
        for name in ("tick_s", "save_interval_s", "forget_after_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"predictor.{name} must be a positive number of seconds")
        if self.queue_size <= 0:
            raise ConfigError("predictor.queue_size must be positive")

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> PredictorConfig:
        """Build from the ``[predictor]`` table, then ``KVSTORE_PREDICTOR_<FIELD>``."""
        if not isinstance(data, Mapping):
            raise ConfigError("'predictor' must be a table: [predictor]")
        env = os.environ if environ is None else environ
        values = dict(data)
        for variable, text in env.items():
            if variable.startswith(_PREDICTOR_ENV_PREFIX):
                values[variable[len(_PREDICTOR_ENV_PREFIX) :].lower()] = _predictor_env(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ConfigError(
                f"unknown predictor setting(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        checked: dict[str, Any] = {}
        for name, value in values.items():
            checked[name] = _predictor_value(name, value)
        return cls(**checked)


def _predictor_env(text: str) -> Any:
    """An environment value as TOML would read it (``true``, ``5``, ``[60, 600]``),
    else as a string (a path)."""
    words = {"yes": True, "on": True, "no": False, "off": False}
    if text.strip().lower() in words:
        return words[text.strip().lower()]
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def _predictor_value(name: str, value: Any) -> Any:
    if name == "enabled":
        if not isinstance(value, bool):
            raise ConfigError(f"predictor.enabled must be true or false, not {value!r}")
        return value
    if name == "weights":
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise ConfigError(f"predictor.weights must be a path, not {value!r}")
        return Path(os.path.expanduser(value))
    if name == "horizons_s":
        if not isinstance(value, list | tuple) or not all(_is_number(h) for h in value):
            raise ConfigError(f"predictor.horizons_s must be a list of seconds, not {value!r}")
        return tuple(float(h) for h in value)
    if name == "queue_size":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"predictor.queue_size must be an integer, not {value!r}")
        return value
    if not _is_number(value):
        raise ConfigError(f"predictor.{name} must be a number of seconds, not {value!r}")
    return float(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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
        if path is None and env.get("KVSTORE_CONFIG"):
            path = env["KVSTORE_CONFIG"]
        data: dict[str, Any] = {}
        if path is not None:
            try:
                with open(path, "rb") as handle:
                    data = tomllib.load(handle)
            except (OSError, tomllib.TOMLDecodeError) as error:
                raise ConfigError(f"cannot read config {path}: {error}") from error
        predictor = PredictorConfig.from_mapping(data.pop("predictor", {}), environ=env)
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


def _from_env(name: str, text: str, types: Mapping[str, Any]) -> Any:
    """Parse an environment string by the type of field ``name``."""
    kind = str(types.get(name, "str"))
    lowered = text.strip().lower()
    try:
        if name in _SIZE_FIELDS:
            return text
        if kind.startswith("int"):
            return None if lowered in ("", "none") and "None" in kind else int(lowered)
        if kind == "float":
            return float(lowered)
        if kind == "bool":
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
    except ValueError:
        raise ConfigError(f"{_ENV_PREFIX}{name.upper()}={text!r} is not of type {kind}") from None
    return text
