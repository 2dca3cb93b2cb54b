"""The tier kinds, in hierarchy order, and what the rest of kvstore needs to know of each.

``TIERS`` is the one list to extend: a new kind is a ``TierKind`` member, its
row here, its backend module, and its opener in ``tiers.registry``. Nothing
else names kinds one by one: the store, the config loader, the cost model,
the predictor and the metrics read these traits.

Imports nothing of kvstore, so every layer may name a kind.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TierKind(enum.IntEnum):
    """Tier kinds; the value is the position in the hierarchy, 0 = fastest."""

    HBM = 0
    DRAM = 1
    SSD = 2
    REDIS = 3

    @property
    def label(self) -> str:
        """The lowercase name the wire, the config and the metrics use (``"dram"``).

        Looked up, not computed: the daemon labels every chunk of every lookup,
        and ``Enum.name`` plus ``str.lower`` cost ~0.2 us a call."""
        return _LABELS[self]

    @property
    def traits(self) -> TierTraits:
        return TIERS[self]

    @property
    def shared(self) -> bool:
        """Whether other processes write to this tier too (so no local index of it
        is authoritative)."""
        return TIERS[self].shared

    @classmethod
    def named(cls, label: str) -> TierKind | None:
        """The kind whose label is ``label`` (any case), or ``None``."""
        return _BY_LABEL.get(label.lower())


@dataclass(frozen=True, slots=True)
class TierTraits:
    """What is known of a kind before any tier of it is opened.

    ``shared``: other processes write to it (Redis), so the store's index is
    advisory for it. ``volatile``: its contents die with the process, so a
    daemon flushes them down before it exits. ``default_capacity``: the size
    a tier named without one gets (``None``: it must be sized explicitly).
    ``embedded_default``: part of the store that runs with no configuration.
    ``reload_bytes_per_s``: how fast its KV reloads into the engine's memory,
    the cost model's default (Llama-3.1-8B on one H100/H200-class GPU,
    ``shared/reference/perf_anchors.md``).
    """

    shared: bool
    volatile: bool
    default_capacity: str | None
    embedded_default: bool
    reload_bytes_per_s: float


TIERS: dict[TierKind, TierTraits] = {
    #                          shared volatile default  embedded  reload bytes/s
    TierKind.HBM: TierTraits(False, True, None, False, 1.5e12),  # a device copy
    TierKind.DRAM: TierTraits(False, True, "2GiB", True, 50e9),  # pinned host memory to HBM
    TierKind.SSD: TierTraits(False, False, "32GiB", True, 5e9),  # one NVMe SSD through LMDB
    TierKind.REDIS: TierTraits(True, False, "8GiB", False, 1.5e9),  # Redis over the network
}

_LABELS: dict[TierKind, str] = {kind: kind.name.lower() for kind in TierKind}
_BY_LABEL: dict[str, TierKind] = {label: kind for kind, label in _LABELS.items()}
