"""The thresholds ``PlacementPolicy`` places idle chains by, per tier kind: how far ahead
each tier is worth holding a chain for, how likely its return must be, and how often
an idle session is looked at again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvstore.kinds import TierKind
from kvstore.predictor.placement.overload import OverloadConfig


def _horizons() -> dict[TierKind, float]:
    hour = 3600.0
    return {TierKind.HBM: 60.0, TierKind.DRAM: 600.0, TierKind.SSD: hour, TierKind.REDIS: 4 * hour}


def _keep() -> dict[TierKind, float]:
    return dict.fromkeys(TierKind, 0.5)


@dataclass(frozen=True)
class PlacementConfig:
    """Thresholds of ``PlacementPolicy``, per tier kind.

    ``horizons_s``: how far ahead a tier is worth holding a chain for; ``keep``:
    keep a chain in a tier while P(back within its horizon) is at least this.
    A kind with no entry (a tier added later) takes the slowest tier's values.
    An idle session is re-placed after ``clamp(check_fraction * idle time,
    check_min_s, check_max_s)`` seconds.
    """

    horizons_s: Mapping[TierKind, float] = field(default_factory=_horizons)
    keep: Mapping[TierKind, float] = field(default_factory=_keep)
    check_min_s: float = 10.0
    check_fraction: float = 0.25
    check_max_s: float = 300.0
    promote_margin: float = 0.25
    """An idle chain goes up to a faster tier other than HBM when its chance there beats
    that tier's next victim's by this factor (any chance, if the tier has room): two
    chains of about the same chance do not trade places at every look."""
    overload: OverloadConfig = field(default_factory=OverloadConfig)
    """When the policy falls back to LRU because the engine cannot keep up."""
    speculative_link_share: float = 0.1
    """The share of a tier's read bandwidth that copies made while nobody waits (an idle
    chain brought up ahead of its return: ``prefetching.LinkBudget``) may take, on
    average: the rest is the demand loads'."""

    def horizon(self, kind: TierKind) -> float:
        return _of(self.horizons_s, kind)

    def keep_at(self, kind: TierKind) -> float:
        return _of(self.keep, kind)

    @property
    def longest_horizon(self) -> float:
        return max(self.horizons_s.values())


def _of(values: Mapping[TierKind, float], kind: TierKind) -> float:
    """``values[kind]``, else the value of the slowest kind that has one."""
    if kind in values:
        return values[kind]
    return values[max(values)]
