"""The store's settings: its tiers, store-wide switches and bounds, and the cost model.

The file and the environment are read by ``kvstore.config`` (which draws the
whole file); one ``[tiers.<kind>]`` table is a ``TierConfig``
(``kvstore.tiers.registry``). ``StoreConfig.from_env`` is what an embedded
store starts from: the file ``KVSTORE_CONFIG`` names, then the ``KVSTORE_*``
variables, else the embedded default (DRAM plus LMDB under the cache
directory, no Redis, no GPU).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvstore.config import (
    CONFIG_VARIABLE,
    TOKEN_VARIABLE,
    default_cache_dir,
    env_value,
    expand_path,
    field_kinds,
    parse_size,
    read_settings,
    read_toml,
)
from kvstore.errors import ConfigError
from kvstore.kinds import TIERS, TierKind
from kvstore.tiers.registry import TIER_ENV_KINDS, TierConfig, tier_config

# Variables that belong to other tables (``kvstore.config`` draws them all).
_OTHER_PREFIXES = ("KVSTORE_DAEMON_", "KVSTORE_PREDICTOR_")
_OTHER_VARIABLES = frozenset({CONFIG_VARIABLE, TOKEN_VARIABLE})
_RATE_SUFFIX = "_bytes_per_s"


def _default_rates() -> dict[TierKind, float]:
    return {kind: traits.reload_bytes_per_s for kind, traits in TIERS.items()}


@dataclass(frozen=True)
class CostModel:
    """What loading cached KV from each tier costs, against recomputing it (prefill).

    Loading ``n`` tokens from tier ``t`` takes ``n * bytes_per_token /
    reload_bytes_per_s[t]`` seconds, recomputing them ``n /
    recompute_tokens_per_s``. A tier that reloads slower than
    ``bytes_per_token * recompute_tokens_per_s`` loses to recomputing, and
    ``lookup`` says so (``CachedPrefix.load_chunks``).

    Defaults model Llama-3.1-8B in bf16 (128 KiB of KV per token) on one
    H100/H200-class GPU: each tier's reload rate is its ``TierTraits``'
    (``kvstore.kinds``), prefill ~17.5K tokens/s (a 10k-token prefix in
    572 ms on an H800). With these, break-even is ~2.3 GB/s: Redis loses.
    ``kv_bytes_per_token`` overrides the namespace layout's size (the replay's
    stand-in payloads are one byte per token). In the ``[costs]`` table a
    tier's rate is ``<tier>_bytes_per_s``.
    """

    recompute_tokens_per_s: float = 17_500.0
    reload_bytes_per_s: Mapping[TierKind, float] = field(default_factory=_default_rates)
    kv_bytes_per_token: int | None = None

    def __post_init__(self) -> None:
        rates = {**_default_rates(), **self.reload_bytes_per_s}
        object.__setattr__(self, "reload_bytes_per_s", rates)  # a copy: the caller's stays theirs
        checked = {"recompute_tokens_per_s": self.recompute_tokens_per_s}
        checked |= {f"{kind.label}{_RATE_SUFFIX}": rate for kind, rate in rates.items()}
        if self.kv_bytes_per_token is not None:
            checked["kv_bytes_per_token"] = self.kv_bytes_per_token
        for name, value in checked.items():
            if isinstance(value, bool) or not (
                isinstance(value, int | float) and math.isfinite(value) and value > 0
            ):
                raise ConfigError(f"costs.{name} must be a positive number, got {value!r}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> CostModel:
        """The ``[costs]`` table; rates may be numbers or sizes (``"50GB"``)."""
        values: dict[str, Any] = {}
        rates: dict[TierKind, float] = {}
        for name, value in data.items():
            kind = TierKind.named(name.removesuffix(_RATE_SUFFIX))
            number = parse_size(value) if isinstance(value, str) else value
            if name.endswith(_RATE_SUFFIX) and kind is not None:
                rates[kind] = number
            elif name in ("recompute_tokens_per_s", "kv_bytes_per_token"):
                values[name] = number
            else:
                raise ConfigError(f"unknown cost setting(s): {[name]}")
        return cls(reload_bytes_per_s=rates, **values)

    def bytes_per_s(self, kind: TierKind) -> float:
        """Reload bandwidth of tier ``kind`` into the engine's KV memory."""
        return float(self.reload_bytes_per_s[kind])

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
        gain = {  # per tier, not per chunk: a long context's lookup has thousands
            kind: recompute - self.load_seconds(kind, chunk_tokens, bytes_per_token)
            for kind in set(tiers)
        }
        best, best_cut, saved = 0.0, 0, 0.0
        for i, kind in enumerate(tiers):
            saved += gain[kind]
            if saved >= best:
                best, best_cut = saved, i + 1
        return best_cut


@dataclass(frozen=True)
class StoreConfig:
    """Settings of a ``TieredStore``; ``tiers`` is ordered fastest first.

    ``flush_on_close``: closing the store writes the blocks only its memory tiers
    hold into its first persistent tier, so that it reopens with them.
    ``breaker_min_open_s`` / ``breaker_max_open_s``: after a tier's backend fails,
    how long its calls are answered as misses before the first probe, and at most
    between probes while it stays down (``kvstore.breaker``).
    ``shared_miss_ttl_s``: how long a key a shared tier said it lacks is taken as
    missing there without asking again (``index.RecentMisses``); another host's put
    of it may go unseen that long. 0: ask every time.
    ``max_batch_chunks`` bounds the chunks one put, get or delete names;
    ``max_lookup_chunks`` the keys of one lookup, which carry no payload, so that a
    whole long context is one lookup even in an engine's small blocks (119K tokens
    are 7,438 of vLLM's 16-token blocks).
    """

    tiers: tuple[TierConfig, ...]
    promote_on_hit: bool = True
    max_batch_chunks: int = 4096
    max_lookup_chunks: int = 1 << 16
    max_chunk_bytes: int = 1 << 30
    scan_on_open: bool = True
    scrub_interval_s: float | None = None
    data_dir: Path = field(default_factory=default_cache_dir)
    costs: CostModel = field(default_factory=CostModel)
    flush_on_close: bool = True
    breaker_min_open_s: float = 0.5
    breaker_max_open_s: float = 10.0
    shared_miss_ttl_s: float = 0.25

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ConfigError("a store needs at least one tier")
        if self.shared_miss_ttl_s < 0:
            raise ConfigError(
                f"shared_miss_ttl_s must not be negative, got {self.shared_miss_ttl_s}"
            )
        if not 0 < self.breaker_min_open_s <= self.breaker_max_open_s:
            raise ConfigError(
                "breaker_min_open_s must be positive and at most breaker_max_open_s, got "
                f"{self.breaker_min_open_s} and {self.breaker_max_open_s}"
            )
        if not 0 < self.max_batch_chunks <= self.max_lookup_chunks:
            raise ConfigError(
                "max_batch_chunks must be positive and at most max_lookup_chunks, got "
                f"{self.max_batch_chunks} and {self.max_lookup_chunks}"
            )
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
        return cls.from_mapping(read_toml(path))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], data_dir: Path | None = None) -> StoreConfig:
        """Build from the file's structure; ``tiers`` absent means the embedded default.
        The other parts' tables (``[daemon]``, ``[predictor]``) are not read here."""
        data = {name: value for name, value in data.items() if name not in ("daemon", "predictor")}
        tiers_data = data.pop("tiers", None)
        if tiers_data is None:
            tiers_data = _embedded_tiers()
        if not isinstance(tiers_data, Mapping) or not all(
            isinstance(spec, Mapping) for spec in tiers_data.values()
        ):
            raise ConfigError("'tiers' must be a table of tables, e.g. [tiers.dram]")
        root = expand_path(data.pop("data_dir", data_dir or default_cache_dir()))
        tiers = tuple(tier_config(name, spec, root) for name, spec in tiers_data.items())
        costs_data = data.pop("costs", {})
        if not isinstance(costs_data, Mapping):
            raise ConfigError("'costs' must be a table, e.g. [costs]")
        settable = {f.name for f in fields(cls)} - {"tiers", "data_dir", "costs"}
        unknown = set(data) - settable
        if unknown:
            raise ConfigError(f"unknown store setting(s): {sorted(unknown)}")
        return cls(tiers=tiers, data_dir=root, costs=CostModel.from_mapping(costs_data), **data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreConfig:
        """The file named by ``KVSTORE_CONFIG`` (or the default), then env overrides."""
        env = os.environ if environ is None else environ
        return cls.from_mapping(apply_env_overrides(read_settings(None, env), env))


def _embedded_tiers() -> dict[str, dict[str, Any]]:
    return {kind.label: {} for kind, traits in TIERS.items() if traits.embedded_default}


_STORE_ENV_KINDS = field_kinds(StoreConfig)


def apply_env_overrides(data: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """``data`` with the store's ``KVSTORE_*`` variables applied (``kvstore.config``);
    ``data`` itself is left as it was."""
    merged: dict[str, Any] = {key: value for key, value in data.items() if key != "tiers"}
    tiers: dict[str, dict[str, Any]] | None = None
    if "tiers" in data:
        tiers = {name: dict(spec) for name, spec in data["tiers"].items()}
    for variable, text in env.items():
        if (
            not variable.startswith("KVSTORE_")
            or variable in _OTHER_VARIABLES
            or variable.startswith(_OTHER_PREFIXES)
        ):
            continue
        name = variable[len("KVSTORE_") :].lower()
        tier_name, _, tier_field = name.partition("_")
        if TierKind.named(tier_name) is not None and tier_field:
            if tiers is None:
                tiers = _embedded_tiers()
            value = env_value(variable, text, TIER_ENV_KINDS.get(tier_field, "str"))
            tiers.setdefault(tier_name, {})[tier_field] = value
        else:
            merged[name] = env_value(variable, text, _STORE_ENV_KINDS.get(name, "str"))
    if tiers is not None:
        merged["tiers"] = tiers
    return merged
