"""A tier's settings, and the one table that opens a tier of each kind.

``OPENERS`` is an explicit table, kind to opener: a kind with no row cannot
be configured (``ConfigError``), never silently opened as another. Each
opener imports its backend only when a tier of its kind is opened, so a store
without Redis never imports redis-py, and one without HBM never needs CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvstore.config import check_switch, expand_path, field_kinds, parse_size
from kvstore.errors import ConfigError
from kvstore.kinds import TIERS, TierKind
from kvstore.tiers.base import Tier
from kvstore.tiers.redis_access import RedisAccess, split_url


@dataclass(frozen=True)
class TierConfig:
    """One tier's settings (a ``[tiers.<kind>]`` table). Fields a kind does not use are
    ignored by it."""

    kind: TierKind
    capacity_bytes: int
    codec: str = "none"
    # dram: populate the arena's pages at startup, in the background (tiers.prefault)
    prefault: bool = False
    # hbm; ``share``: local clients may open the arena (read-write: ``kvstore.tiers.hbm``)
    device: str = "cuda"
    share: bool = True
    # ssd (LMDB)
    path: Path | None = None
    map_size_bytes: int | None = None
    sync: bool = True
    # redis
    url: str | None = None
    nodes: tuple[str, ...] = ()
    cluster: bool = False
    key_prefix: str = "kvs"
    ttl_s: int | None = None
    # a shared tier: "through" copies every put to it soon after (the default: other hosts
    # see it), "back" only what the local tiers push out (``kvstore.store.write_through``)
    write: str | None = None
    write_queue: int = 8192  # blocks waiting for their write-through, at most
    # A hung Redis costs a request these once (then the tier's breaker answers for it):
    # together under the client's 2 s, so that one request degrades, not times out.
    socket_timeout_s: float = 1.0
    connect_timeout_s: float = 0.5
    # redis AUTH and TLS (``kvstore.tiers.redis_access``); a URL may carry them too
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

    def __post_init__(self) -> None:
        # Credentials written into ``url`` or ``nodes`` move to ``username`` and
        # ``password`` (which must agree with them), so neither field ever holds a
        # secret and no repr or log line of a config shows one.
        urls = [self.url] if self.url else []
        clean, access = split_url([*urls, *self.nodes], self.redis_access())
        if self.url:
            object.__setattr__(self, "url", clean[0])
        object.__setattr__(self, "nodes", tuple(clean[len(urls) :]))
        object.__setattr__(self, "username", access.username)
        object.__setattr__(self, "password", access.password)
        object.__setattr__(self, "tls", access.tls)
        write = (
            self.write if self.write is not None else ("through" if self.kind.shared else "back")
        )
        if write not in _WRITE_MODES:
            raise ConfigError(f"tier {self.kind.label!r}: write must be one of {_WRITE_MODES}")
        if write == "through" and not self.kind.shared:
            raise ConfigError(
                f"tier {self.kind.label!r}: write = 'through' is for a shared tier (redis)"
            )
        if self.write_queue < 1:
            raise ConfigError(f"tier {self.kind.label!r}: write_queue must be at least 1")
        object.__setattr__(self, "write", write)

    @property
    def writes_through(self) -> bool:
        return self.write == "through"

    def redis_access(self) -> RedisAccess:
        """The redis tier's credentials and TLS settings."""
        return RedisAccess(
            username=self.username,
            password=self.password,
            tls=self.tls,
            tls_ca_file=self.tls_ca_file,
            tls_cert_file=self.tls_cert_file,
            tls_key_file=self.tls_key_file,
        )


_TLS_FILES = ("tls_ca_file", "tls_cert_file", "tls_key_file")
_WRITE_MODES = ("through", "back")

# How a ``KVSTORE_<TIER>_<FIELD>`` variable is read: by its field's type, under the
# name the file uses (sizes are text: "8GiB").
TIER_ENV_KINDS: dict[str, str] = {
    **field_kinds(TierConfig),
    "capacity": "str",
    "map_size": "str",
    "path": "str",
}


def tier_config(name: str, spec: Mapping[str, Any], data_dir: Path) -> TierConfig:
    """The settings of the ``[tiers.<name>]`` table ``spec``; an SSD tier without a path
    lives under ``data_dir``."""
    kind = TierKind.named(name)
    if kind is None or kind not in OPENERS:
        known = ", ".join(kind.label for kind in OPENERS)
        raise ConfigError(f"unknown tier {name!r}; expected one of {known}")
    spec = dict(spec)
    capacity = spec.pop("capacity", TIERS[kind].default_capacity)
    if capacity is None:
        raise ConfigError(f"tier {name!r} needs a capacity")
    values: dict[str, Any] = {"kind": kind, "capacity_bytes": parse_size(capacity)}
    if "map_size" in spec:
        values["map_size_bytes"] = parse_size(spec.pop("map_size"))
    if "path" in spec:
        values["path"] = expand_path(spec.pop("path"))
    elif kind is TierKind.SSD:
        values["path"] = data_dir / "lmdb"
    for setting in set(_TLS_FILES) & set(spec):
        file = spec.pop(setting)
        values[setting] = None if file is None else expand_path(file)
    if "nodes" in spec:
        nodes = spec.pop("nodes")
        values["nodes"] = tuple(
            node.strip() for node in (nodes.split(",") if isinstance(nodes, str) else nodes)
        )
    settable = {f.name for f in fields(TierConfig)} - set(values)
    unknown = set(spec) - settable
    if unknown:
        raise ConfigError(f"unknown setting(s) for tier {name!r}: {sorted(unknown)}")
    switches = {f.name for f in fields(TierConfig) if isinstance(f.default, bool)}
    for setting in switches & set(spec):
        check_switch(f"tier {name!r}: {setting}", spec[setting])
    values.update(spec)
    if values["capacity_bytes"] <= 0:
        raise ConfigError(f"tier {name!r} needs a positive capacity")
    config = TierConfig(**values)
    OPENERS[kind].check(config)
    return config


def open_tier(config: TierConfig) -> Tier:
    """Open the backend ``config`` describes."""
    opener = OPENERS.get(config.kind)
    if opener is None:
        raise ConfigError(f"no tier of kind {config.kind.label!r} can be opened")
    opener.check(config)
    return opener.open(config)


@dataclass(frozen=True, slots=True)
class Opener:
    """How a kind's tier is opened (``open``), and what its settings must have first
    (``check``, a ``ConfigError`` before anything is opened)."""

    open: Callable[[TierConfig], Tier]
    check: Callable[[TierConfig], None] = lambda config: None


def _open_hbm(config: TierConfig) -> Tier:
    from kvstore.tiers.hbm import HBMTier

    return HBMTier(config.capacity_bytes, device=config.device, share=config.share)


def _open_dram(config: TierConfig) -> Tier:
    from kvstore.tiers.dram import DRAMTier

    return DRAMTier(config.capacity_bytes, prefault=config.prefault)


def _check_ssd(config: TierConfig) -> None:
    if config.path is None:
        raise ConfigError("the ssd tier needs a path")


def _open_ssd(config: TierConfig) -> Tier:
    from kvstore.tiers.lmdb_tier import LMDBTier

    assert config.path is not None, "checked by _check_ssd"
    return LMDBTier(
        config.path, config.capacity_bytes, map_size=config.map_size_bytes, sync=config.sync
    )


def _check_redis(config: TierConfig) -> None:
    if not (config.nodes if config.cluster else config.url):
        raise ConfigError("the redis tier needs a url (or nodes with cluster = true)")
    config.redis_access().check()


def _open_redis(config: TierConfig) -> Tier:
    from kvstore.tiers.redis_tier import RedisTier

    return RedisTier(
        list(config.nodes) if config.cluster else config.url or "",
        config.capacity_bytes,
        cluster=config.cluster,
        key_prefix=config.key_prefix,
        ttl_s=config.ttl_s,
        socket_timeout_s=config.socket_timeout_s,
        connect_timeout_s=config.connect_timeout_s,
        access=config.redis_access(),
    )


OPENERS: dict[TierKind, Opener] = {
    TierKind.HBM: Opener(_open_hbm),
    TierKind.DRAM: Opener(_open_dram),
    TierKind.SSD: Opener(_open_ssd, _check_ssd),
    TierKind.REDIS: Opener(_open_redis, _check_redis),
}
