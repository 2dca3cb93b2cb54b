"""Store configuration: TOML file, environment overrides, and the embedded default.

Settings are plain frozen dataclasses, kept apart from the running store (as
uvicorn keeps ``Config`` apart from ``Server``). A TOML file looks like::

    promote_on_hit = true

    [tiers.dram]
    capacity = "4GiB"
    prefault = true                  # commit the arena's pages at startup (background)

    [tiers.ssd]                      # LMDB
    path = "~/.cache/kvstore/lmdb"
    capacity = "64GiB"
    codec = "zstd-byteplane:1"

    [tiers.redis]
    url = "redis://127.0.0.1:6380/0" # or nodes = ["127.0.0.1:7000", ...] with cluster = true
    capacity = "16GiB"
    ttl_s = 86400

    [costs]                          # reload vs recompute (``CostModel``); defaults shown
    recompute_tokens_per_s = 17500
    dram_bytes_per_s = 50e9

Environment variables override the file: ``KVSTORE_CONFIG`` names the file,
``KVSTORE_<TIER>_<FIELD>`` sets one field of one tier (``KVSTORE_DRAM_CAPACITY=8GiB``,
``KVSTORE_REDIS_URL=redis://...`` adds a Redis tier), and ``KVSTORE_<FIELD>``
sets a store-wide field (``KVSTORE_PROMOTE_ON_HIT=false``). ``KVSTORE_DAEMON_*``
and ``KVSTORE_AUTH_TOKEN`` belong to the daemon (``kvstore.server.config``), as
does the ``[daemon]`` table of the file.

With no file and no variables the store runs the embedded default: DRAM plus
LMDB under the user's cache directory, no Redis, no GPU.
"""

from __future__ import annotations

import dataclasses
import decimal
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError
from kvstore.tiers.base import TierKind

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


# Capacity of a tier that is named without one; HBM must always be sized explicitly.
_DEFAULT_CAPACITY = {TierKind.DRAM: "2GiB", TierKind.SSD: "32GiB", TierKind.REDIS: "8GiB"}
_EMBEDDED_TIERS = ("dram", "ssd")
# KVSTORE_* variables that are not store settings (the file name; the daemon's token).
_NOT_STORE_VARIABLES = frozenset({"KVSTORE_CONFIG", "KVSTORE_AUTH_TOKEN"})


def parse_size(value: int | str) -> int:
    """``"4GiB"``, ``"512MB"``, ``"1.5GiB"`` or a plain integer, as bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"a size must be a number of bytes or a string, not {value!r}")
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).upper() not in _UNITS:
        raise ConfigError(f"cannot parse size {value!r} (try '4GiB' or '512MB')")
    # Decimal, not float: "2.01KB" is 2010 bytes, not 2009.
    return int(decimal.Decimal(match.group(1)) * _UNITS[match.group(2).upper()])


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kvstore``, else ``~/.cache/kvstore``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvstore"


@dataclass(frozen=True)
class TierConfig:
    """One tier's settings. Fields not used by a kind are ignored by it."""

    kind: TierKind
    capacity_bytes: int
    codec: str = "none"
    # dram: populate the arena's pages at startup, in the background (tiers.prefault)
    prefault: bool = False
    # hbm
    device: str = "cuda"
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
    socket_timeout_s: float = 2.0
    connect_timeout_s: float = 1.0


@dataclass(frozen=True)
class CostModel:
    """What loading cached KV from each tier costs, against recomputing it (prefill).

    Loading ``n`` tokens from tier ``t`` takes ``n * bytes_per_token / <t>_bytes_per_s``
    seconds, recomputing them ``n / recompute_tokens_per_s``. A tier that reloads
    slower than ``bytes_per_token * recompute_tokens_per_s`` loses to recomputing,
    and ``lookup`` says so (``CachedPrefix.load_chunks``).

    Defaults model Llama-3.1-8B in bf16 (128 KiB of KV per token) on one
    H100/H200-class GPU (``shared/reference/perf_anchors.md``): pinned DRAM to
    HBM ~50 GB/s, one NVMe SSD through LMDB ~5 GB/s, Redis ~1.5 GB/s; prefill
    ~17.5K tokens/s (a 10k-token prefix in 572 ms on an H800). HBM to HBM is a
    device copy, ~1.5 TB/s. With these, break-even is ~2.3 GB/s: Redis loses.
    ``kv_bytes_per_token`` overrides the namespace layout's size (the replay's
    stand-in payloads are one byte per token).
    """

    recompute_tokens_per_s: float = 17_500.0
    hbm_bytes_per_s: float = 1.5e12
    dram_bytes_per_s: float = 50e9
    ssd_bytes_per_s: float = 5e9
    redis_bytes_per_s: float = 1.5e9
    kv_bytes_per_token: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ConfigError(f"costs.{f.name} must be a positive number, got {value!r}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> CostModel:
        """The ``[costs]`` table; rates may be numbers or sizes (``"50GB"``)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown cost setting(s): {sorted(unknown)}")
        values = {
            name: parse_size(value) if isinstance(value, str) else value
            for name, value in data.items()
        }
        return cls(**values)

    def bytes_per_s(self, kind: TierKind) -> float:
        """Reload bandwidth of tier ``kind`` into the engine's KV memory."""
        return float(getattr(self, f"{kind.label}_bytes_per_s"))

    def load_seconds(self, kind: TierKind, tokens: float, bytes_per_token: float) -> float:
        return tokens * bytes_per_token / self.bytes_per_s(kind)

    def recompute_seconds(self, tokens: float) -> float:
        return tokens / self.recompute_tokens_per_s

    def worth_loading(self, kind: TierKind, bytes_per_token: float) -> bool:
        """Whether loading from ``kind`` is at least as fast as recomputing."""
        return self.load_seconds(kind, 1.0, bytes_per_token) <= self.recompute_seconds(1.0)

    def load_run(self, tiers: Sequence[TierKind], chunk_tokens: int, bytes_per_token: float) -> int:
        """How many leading chunks of a cached run (``tiers[i]``: where chunk ``i`` is)
        to load; the rest is recomputed. The cut saves the most time; a cached
        prefix stays a prefix, so one slow chunk may be worth loading to reach
        fast ones behind it."""
        recompute = self.recompute_seconds(chunk_tokens)
        best, best_cut, saved = 0.0, 0, 0.0
        for i, kind in enumerate(tiers):
            saved += recompute - self.load_seconds(kind, chunk_tokens, bytes_per_token)
            if saved >= best:
                best, best_cut = saved, i + 1
        return best_cut


@dataclass(frozen=True)
class StoreConfig:
    """Settings of a ``TieredStore``; ``tiers`` is ordered fastest first."""

    tiers: tuple[TierConfig, ...]
    promote_on_hit: bool = True
    max_batch_chunks: int = 4096
    max_chunk_bytes: int = 1 << 30
    scan_on_open: bool = True
    scrub_interval_s: float | None = None
    data_dir: Path = field(default_factory=default_cache_dir)
    costs: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ConfigError("a store needs at least one tier")
        kinds = [tier.kind for tier in self.tiers]
        if len(set(kinds)) != len(kinds):
            raise ConfigError("each tier kind may appear once")
        if kinds != sorted(kinds):
            object.__setattr__(self, "tiers", tuple(sorted(self.tiers, key=lambda t: t.kind)))

    def tier(self, kind: TierKind) -> TierConfig | None:
        return next((tier for tier in self.tiers if tier.kind is kind), None)

    @classmethod
    def embedded_default(cls, data_dir: Path | None = None) -> StoreConfig:
        """DRAM (2 GiB) plus LMDB (32 GiB) under the cache directory; no Redis, no GPU."""
        return cls.from_mapping({}, data_dir=data_dir)

    @classmethod
    def from_toml(cls, path: str | Path) -> StoreConfig:
        try:
            with open(path, "rb") as handle:
                data = tomllib.load(handle)
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise ConfigError(f"cannot read config {path}: {error}") from error
        return cls.from_mapping(data)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], data_dir: Path | None = None) -> StoreConfig:
        """Build from the TOML structure; ``tiers`` absent means the embedded default."""
        data = dict(data)
        data.pop("daemon", None)  # the [daemon] table belongs to kvstore.server.config
        tiers_data = data.pop("tiers", None)
        if tiers_data is None:
            tiers_data = {name: {} for name in _EMBEDDED_TIERS}
        if not isinstance(tiers_data, Mapping) or not all(
            isinstance(spec, Mapping) for spec in tiers_data.values()
        ):
            raise ConfigError("'tiers' must be a table of tables, e.g. [tiers.dram]")
        root = Path(os.path.expanduser(str(data.pop("data_dir", data_dir or default_cache_dir()))))
        tiers = tuple(_tier_from_mapping(name, spec, root) for name, spec in tiers_data.items())
        costs_data = data.pop("costs", {})
        if not isinstance(costs_data, Mapping):
            raise ConfigError("'costs' must be a table, e.g. [costs]")
        store_fields = {f.name for f in dataclasses.fields(cls)} - {"tiers", "data_dir", "costs"}
        unknown = set(data) - store_fields
        if unknown:
            raise ConfigError(f"unknown store setting(s): {sorted(unknown)}")
        return cls(tiers=tiers, data_dir=root, costs=CostModel.from_mapping(costs_data), **data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreConfig:
        """The file named by ``KVSTORE_CONFIG`` (or the default), then env overrides."""
        env = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        if env.get("KVSTORE_CONFIG"):
            try:
                with open(env["KVSTORE_CONFIG"], "rb") as handle:
                    data = tomllib.load(handle)
            except (OSError, tomllib.TOMLDecodeError) as error:
                raise ConfigError(f"cannot read KVSTORE_CONFIG: {error}") from error
        return cls.from_mapping(apply_env_overrides(data, env))


def apply_env_overrides(data: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Return ``data`` with ``KVSTORE_*`` variables applied (see the module docstring)."""
    merged: dict[str, Any] = {key: value for key, value in data.items() if key != "tiers"}
    tiers: dict[str, dict[str, Any]] | None = None
    if "tiers" in data:
        tiers = {name: dict(spec) for name, spec in data["tiers"].items()}
    tier_names = {kind.label for kind in TierKind}
    for variable, value in env.items():
        if not variable.startswith("KVSTORE_") or variable in _NOT_STORE_VARIABLES:
            continue
        if variable.startswith(("KVSTORE_DAEMON_", "KVSTORE_PREDICTOR_")):
            continue  # kvstore.server.config reads these
        name = variable[len("KVSTORE_") :].lower()
        tier_name, _, tier_field = name.partition("_")
        if tier_name in tier_names and tier_field:
            if tiers is None:
                tiers = {name: {} for name in _EMBEDDED_TIERS}
            tiers.setdefault(tier_name, {})[tier_field] = _parse_env_value(value)
        else:
            merged[name] = _parse_env_value(value)
    if tiers is not None:
        merged["tiers"] = tiers
    return merged


def _parse_env_value(value: str) -> Any:
    lowered = value.strip().lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if re.fullmatch(r"-?[0-9]+", lowered):
        return int(lowered)
    if re.fullmatch(r"-?[0-9]+\.[0-9]*", lowered):
        return float(lowered)
    return value


def _tier_from_mapping(name: str, spec: Mapping[str, Any], data_dir: Path) -> TierConfig:
    try:
        kind = TierKind[name.upper()]
    except KeyError:
        raise ConfigError(f"unknown tier {name!r}; expected hbm, dram, ssd or redis") from None
    spec = dict(spec)
    capacity = spec.pop("capacity", _DEFAULT_CAPACITY.get(kind))
    if capacity is None:
        raise ConfigError(f"tier {name!r} needs a capacity")
    values: dict[str, Any] = {"kind": kind, "capacity_bytes": parse_size(capacity)}
    if "map_size" in spec:
        values["map_size_bytes"] = parse_size(spec.pop("map_size"))
    if "path" in spec:
        values["path"] = Path(os.path.expanduser(str(spec.pop("path"))))
    elif kind is TierKind.SSD:
        values["path"] = data_dir / "lmdb"
    if "nodes" in spec:
        nodes = spec.pop("nodes")
        # From the environment a node list arrives as one comma-separated string.
        values["nodes"] = tuple(
            node.strip() for node in (nodes.split(",") if isinstance(nodes, str) else nodes)
        )
    allowed = {f.name for f in dataclasses.fields(TierConfig)} - set(values)
    unknown = set(spec) - allowed
    if unknown:
        raise ConfigError(f"unknown setting(s) for tier {name!r}: {sorted(unknown)}")
    switches = {f.name for f in dataclasses.fields(TierConfig) if isinstance(f.default, bool)}
    for setting in switches & set(spec):
        if not isinstance(spec[setting], bool) and spec[setting] not in (0, 1):  # 1: from env
            raise ConfigError(f"tier {name!r}: {setting} must be true or false")
        spec[setting] = bool(spec[setting])
    values.update(spec)
    if kind is TierKind.REDIS and not (values.get("url") or values.get("nodes")):
        raise ConfigError("the redis tier needs a url or cluster nodes")
    if values["capacity_bytes"] <= 0:
        raise ConfigError(f"tier {name!r} needs a positive capacity")
    return TierConfig(**values)
