"""The decision log: what ``PlacementPolicy`` did with each session's chain, and why.

An operator asking why a session's KV is on SSD, or was read back from it, reads
the log (the daemon serves it at ``GET /v1/decisions`` and, per session, in
``GET /v1/sessions/{session}``). One ``Decision`` per placement decision::

    at     session action            from  to    chunks  reason
    5.0    idle    place             dram  None  8       P(back within 3600 s)=0.15 < keep 0.5
    5.0    idle    write_down        dram  ssd   8       copied ahead of eviction: ssd has room
    10.0   idle    evict             dram  ssd   4       pressure: dram full;
                                                         P(back within 600 s)=0.09
    600.0  idle    prefetch_planned  ssd   dram  4       request started: its lookup is next
    600.0  busy    evict             dram  ssd   4       pressure: dram full; session running
    600.0  idle    prefetch          ssd   dram  4       request started: its lookup is next

(a chain nobody expects back stays in DRAM while there is room, a busy session's
put pushes half of it out, its next request brings that back), each with the
forecast it was made by: P(back within each horizon), as forecast when the
session went idle. ``to`` of a ``place`` is the tier the forecast calls for
(None: none, the chain may be dropped); of an ``evict``, the fastest tier still
holding the blocks (None: dropped). ``at`` is the policy's ``now``: the time of
the hook (event or tick) that made the decision, or, for an eviction, which a
put causes, of the hook before it.

Cheap, because the replay drives the same policy over millions of events: a
record holds numbers (a ``Reason`` and the figures it quotes, the forecast as
the tuple the policy keeps anyway) and is turned into text only when read
(``Decision.to_dict``). Evictions are counted, not logged per block: the blocks
of one session that leave one tier for one other at one ``at`` are one record,
whose ``chunks`` the policy raises as they go (``PlacementPolicy.on_remove``).

``DecisionLog`` keeps the latest ``kept`` records; older ones fall off. It is
written and read under the store's lock, as the policy's hooks run under it;
``latest`` returns copies, to be serialised once the lock is let go.
"""

from __future__ import annotations

import copy
import enum
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvstore.kinds import TierKind

DEFAULT_KEPT = 1000


class Action(enum.Enum):
    """What the policy did."""

    PLACE = "place"  # an idle session's target tier, at idle, at a new forecast, or changed
    DEMOTE = "demote"  # its chain moved down, out of the tiers faster than ``to``
    WRITE_DOWN = "write_down"  # its chain copied down while nobody waits, the fast copy kept
    PREFETCH_PLANNED = "prefetch_planned"  # a promotion planned under the lock, run after
    PREFETCH = "prefetch"  # a promotion run: ``chunks`` landed in ``to``
    EVICT = "evict"  # its blocks pushed out of ``source`` by capacity pressure


class Reason(enum.Enum):
    """Why, as the template of the text; ``Why`` carries the figures it quotes."""

    LIKELY = "P(back within {horizon:.0f} s)={p:.2f} >= keep {keep:g}"
    UNLIKELY = "P(back within {horizon:.0f} s)={p:.2f} < keep {keep:g}"
    NO_FORECAST = "no forecast"
    TOOL_RUNNING = "tool running"
    RESUMED = "request started: its lookup is next"
    OUTRANKED = (
        "P(back within {horizon:.0f} s)={p:.2f} < keep {keep:g}; "
        "{tier} full, next victim at {rival:.2f} outranks it"
    )
    FULL_OF_RUNNING = (
        "P(back within {horizon:.0f} s)={p:.2f} < keep {keep:g}; {tier} full of running requests"
    )
    PROMOTED = "P(back within {horizon:.0f} s)={p:.2f} beats {tier}'s next victim ({rival:.2f})"
    PROMOTED_ROOM = "P(back within {horizon:.0f} s)={p:.2f}; {tier} has room"
    KEPT_ROOM = "target below; kept in {tier} while it has room"
    KEPT_OUTRANKS = "target below; kept in {tier}: outranks next victim ({p:.2f} > {rival:.2f})"
    COPY_AHEAD = "copied ahead of eviction: {tier} has room"
    COPY_AHEAD_OUTRANKS = (
        "copied ahead of eviction: outranks {tier}'s next victim ({p:.2f} > {rival:.2f})"
    )
    PRESSURE = "pressure: {tier} full; P(back within {horizon:.0f} s)={p:.2f}"
    PRESSURE_RUNNING = "pressure: {tier} full; session running"


@dataclass(frozen=True, slots=True)
class Why:
    """A reason and the figures it quotes (those its template names; the rest None).

    ``tier`` is the tier the reason is about; ``p`` the session's P(back within
    ``horizon`` seconds) there; ``keep`` the tier's threshold; ``rival`` the
    same chance of the session next in line for eviction there.
    """

    reason: Reason
    tier: TierKind | None = None
    p: float | None = None
    horizon: float | None = None
    keep: float | None = None
    rival: float | None = None

    def text(self) -> str:
        tier = self.tier.label if self.tier is not None else None
        return self.reason.value.format(
            tier=tier, p=self.p, horizon=self.horizon, keep=self.keep, rival=self.rival
        )


@dataclass(slots=True)
class Decision:
    """One placement decision of one session. Made by ``PlacementPolicy``; only an
    eviction's ``chunks`` changes after it is logged (its walk counts blocks in)."""

    at: float  # the policy's ``now``
    session: str
    action: Action
    source: TierKind | None  # "from": where the chain lay, or the blocks left
    to: TierKind | None
    chunks: int
    why: Why
    forecast: tuple[tuple[float, float], ...]  # (horizon s, P(back within it)), as of idle
    forecast_at: float | None  # when that forecast was made (None: no forecast)

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "session": self.session,
            "action": self.action.value,
            "from": None if self.source is None else self.source.label,
            "to": None if self.to is None else self.to.label,
            "chunks": self.chunks,
            "reason": self.why.text(),
            "forecast": None
            if self.forecast_at is None
            else {
                "at": self.forecast_at,
                "horizons_s": [horizon for horizon, _ in self.forecast],
                "p_return": [p for _, p in self.forecast],
            },
        }


class DecisionLog:
    """The latest ``kept`` decisions, oldest first; ``recorded`` counts every one."""

    def __init__(self, kept: int = DEFAULT_KEPT) -> None:
        if kept <= 0:
            raise ValueError(f"a decision log keeps at least one record, not {kept}")
        self._ring: deque[Decision] = deque(maxlen=kept)
        self.recorded = 0

    @property
    def kept(self) -> int:
        maxlen = self._ring.maxlen
        assert maxlen is not None
        return maxlen

    def __len__(self) -> int:
        return len(self._ring)

    def record(self, decision: Decision) -> None:
        self._ring.append(decision)
        self.recorded += 1

    def latest(self, session: str | None = None, limit: int | None = None) -> list[Decision]:
        """Copies of the newest decisions first, of ``session`` only if given, at most
        ``limit`` of them."""
        found: list[Decision] = []
        for decision in reversed(self._ring):
            if limit is not None and len(found) >= limit:
                break
            if session is None or decision.session == session:
                found.append(copy.copy(decision))
        return found
