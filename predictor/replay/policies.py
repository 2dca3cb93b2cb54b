"""The policies a replay compares, as named on the command line, and the policy object
each name stands for:

    lru            LRU only                                      baselines
    ttl:SECONDS    a fixed idle timeout at every tier               (placement.baselines)
    tool-aware     HBM while a tool runs, out of HBM at the human's turn
    prev-gap       out of HBM at once after a human gap over 10 minutes
    lognormal      PlacementPolicy fed one log-normal of the deployment's human gaps
    lognormal-tools  the same, with tool waits forecast from how soon tools came back
    predictor      PlacementPolicy fed the return model's forecasts
    oracle         PlacementPolicy fed the true next arrival (oracle:AUC: blurred to it)
    bound          no policy: the offline lower bound on GPU-seconds (``replay.bound``)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.predictor.placement.baselines import (
    LogNormalGaps,
    LRUBaseline,
    PrevGapPolicy,
    ToolAwarePolicy,
    ToolGaps,
    TTLPolicy,
)
from kvstore.predictor.placement.policy import PlacementConfig, PlacementPolicy, SessionPolicy


class PolicyKind(enum.Enum):
    LRU = "lru"
    TTL = "ttl"
    TOOL_AWARE = "tool-aware"
    PREV_GAP = "prev-gap"
    LOGNORMAL = "lognormal"
    LOGNORMAL_TOOLS = "lognormal-tools"
    PREDICTOR = "predictor"
    ORACLE = "oracle"
    BOUND = "bound"


_BASELINES = frozenset(
    {
        PolicyKind.LRU,
        PolicyKind.TTL,
        PolicyKind.TOOL_AWARE,
        PolicyKind.PREV_GAP,
        PolicyKind.LOGNORMAL,
        PolicyKind.LOGNORMAL_TOOLS,
    }
)

# How long each policy's replay takes against LRU's (1.0), by which ``replay_runs``
# starts the longest first. Timed on 142 conversations, 16 users, one core, for the
# TTL, lognormal-tools and the predictor; the others are put beside their kin.
_WORK = {
    PolicyKind.TTL: 1.4,
    PolicyKind.TOOL_AWARE: 1.2,
    PolicyKind.PREV_GAP: 1.2,
    PolicyKind.LOGNORMAL: 2.5,
    PolicyKind.LOGNORMAL_TOOLS: 2.5,
    PolicyKind.ORACLE: 2.5,
    PolicyKind.PREDICTOR: 3.1,
}


@dataclass(frozen=True)
class PolicySpec:
    """One policy of a replay, as named on the command line (``ttl:300``)."""

    kind: PolicyKind
    seconds: float | None = None
    auc: float | None = None  # oracle only: blurred to this AUC (None: perfect)

    @property
    def name(self) -> str:
        if self.kind is PolicyKind.TTL:
            return f"ttl:{self.seconds:g}"
        if self.auc is not None:
            return f"oracle:{self.auc:g}"
        return self.kind.value

    @property
    def baseline(self) -> bool:
        return self.kind in _BASELINES

    @property
    def work(self) -> float:
        """About how long a replay under this policy takes, relative to LRU's (``_WORK``)."""
        return _WORK.get(self.kind, 1.0)


def parse_policies(text: str) -> list[PolicySpec]:
    """``"lru,ttl:60,predictor,oracle"`` -> specs, in order, without duplicates."""
    specs: list[PolicySpec] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, argument = item.partition(":")
        try:
            kind = PolicyKind(name.lower())
        except ValueError:
            raise ConfigError(
                f"unknown policy {item!r}; expected one of lru, ttl:SECONDS, tool-aware, "
                "prev-gap, lognormal, lognormal-tools, predictor, oracle[:AUC], bound"
            ) from None
        seconds = auc = None
        if kind is PolicyKind.ORACLE and argument:
            try:
                auc = float(argument)
            except ValueError:
                raise ConfigError(f"oracle takes an AUC, e.g. oracle:0.7 (got {item!r})") from None
            if not 0.5 < auc < 1.0:
                raise ConfigError(f"an oracle's AUC must lie in (0.5, 1) (got {item!r})")
        elif kind is PolicyKind.TTL:
            try:
                seconds = float(argument)
            except ValueError:
                raise ConfigError(f"ttl needs seconds, e.g. ttl:300 (got {item!r})") from None
            if not seconds > 0:
                raise ConfigError(f"ttl seconds must be positive (got {item!r})")
        elif argument:
            raise ConfigError(f"policy {name!r} takes no argument (got {item!r})")
        spec = PolicySpec(kind, seconds, auc)
        if spec not in specs:
            specs.append(spec)
    if not specs:
        raise ConfigError("no policy given")
    return specs


def make_policy(spec: PolicySpec, placement: PlacementConfig) -> SessionPolicy:
    """A fresh policy object for ``spec`` (the oracle is ``PlacementPolicy`` too: the
    replay feeds it perfect forecasts instead of the model's)."""
    if spec.kind is PolicyKind.LRU:
        return LRUBaseline()
    if spec.kind is PolicyKind.TTL:
        assert spec.seconds is not None
        return TTLPolicy(spec.seconds)
    if spec.kind is PolicyKind.TOOL_AWARE:
        return ToolAwarePolicy()
    if spec.kind is PolicyKind.PREV_GAP:
        return PrevGapPolicy()
    if spec.kind is PolicyKind.BOUND:
        raise ConfigError("the bound is computed, not replayed (replay.bound)")
    return PlacementPolicy(placement)


def lognormal_forecaster(kind: PolicyKind) -> LogNormalGaps | None:
    """What feeds ``PlacementPolicy`` for ``lognormal``, and for ``lognormal-tools`` (tool
    waits counted); None for any other policy."""
    if kind is PolicyKind.LOGNORMAL:
        return LogNormalGaps()
    if kind is PolicyKind.LOGNORMAL_TOOLS:
        return LogNormalGaps(tools=ToolGaps())
    return None
