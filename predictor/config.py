"""The ``[predictor]`` table of the settings file (``kvstore.config`` draws the file).

Read by the daemon, which builds its ``PredictorService`` from it; the
learning and placement code take plain arguments and never read settings.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.config import env_table, expand_path, field_kinds
from kvstore.errors import ConfigError
from kvstore.predictor.placement.decisions import DEFAULT_KEPT

ENV_PREFIX = "KVSTORE_PREDICTOR_"


@dataclass(frozen=True)
class PredictorConfig:
    """The ``[predictor]`` table: the return-time predictor and its placement policy.

    On by default: a daemon that learns nothing from its session events would
    keep LRU placement, which is what the predictor exists to beat, and the
    untrained model starts at the published base rates, so it never does
    worse than a fixed rule on day one. ``enabled = false`` keeps the store's
    LRU policy and only records events.

    ``weights`` is a model file from ``kvstore train-predictor`` to start
    from; the daemon loads its model once it listens, and stops (exit status
    1) if this one cannot be used. The model the daemon learns is saved under
    ``<data_dir>/predictor/`` every ``save_interval_s`` and at shutdown, and
    that file, when present, wins over ``weights`` on the next start (delete
    it to start over from ``weights``). ``horizons_s`` shape a new model only;
    a loaded one keeps its own. Session events wait in a queue of
    ``queue_size`` (a full queue drops and counts them: events are advisory;
    those that come before the model is loaded wait there for it); ``tick_s``
    is the timer that labels passed horizons and re-places idle sessions; a
    session idle for ``forget_after_s`` is forgotten. The latest
    ``decisions_kept`` placement decisions are kept for ``GET /v1/decisions``
    (``placement.decisions``).
    """

    enabled: bool = True
    horizons_s: tuple[float, ...] = (60.0, 600.0, 3600.0)
    weights: Path | None = None
    tick_s: float = 5.0
    save_interval_s: float = 300.0
    queue_size: int = 10_000
    forget_after_s: float = 86_400.0
    decisions_kept: int = DEFAULT_KEPT

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
        for name in ("queue_size", "decisions_kept"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"predictor.{name} must be positive")

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> PredictorConfig:
        """Build from the ``[predictor]`` table, then ``KVSTORE_PREDICTOR_<FIELD>``."""
        if not isinstance(data, Mapping):
            raise ConfigError("'predictor' must be a table: [predictor]")
        env = os.environ if environ is None else environ
        values = {**data, **env_table(env, ENV_PREFIX, field_kinds(cls))}
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
        return expand_path(value)
    if name == "horizons_s":
        if not isinstance(value, list | tuple) or not all(_is_number(h) for h in value):
            raise ConfigError(f"predictor.horizons_s must be a list of seconds, not {value!r}")
        return tuple(float(h) for h in value)
    if name in ("queue_size", "decisions_kept"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"predictor.{name} must be an integer, not {value!r}")
        return value
    if not _is_number(value):
        raise ConfigError(f"predictor.{name} must be a number of seconds, not {value!r}")
    return float(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
