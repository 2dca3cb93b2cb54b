"""Eviction order inside one tier, and how a forecast reads as idle time grows.

``TierRanking`` keeps the sessions holding blocks in a tier sorted by their
chance of coming back soon (``PlacementPolicy`` computes the ranks), and their
blocks in chain order so a chain loses its tail first. ``IdleForecast`` is the
chance itself: a forecast made when a session went idle, read after ``e``
seconds of idleness as P(back within ``H`` more | not back yet) =
(F(e + H) - F(e)) / (1 - F(e)), with F shaped between the forecast's horizons
by ``GapShape``, the histogram of idle gaps that ended in a return.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.keys import ChunkKey
from kvstore.predictor.learning.portable import geometric_grid, interpolate
from kvstore.predictor.placement.hooks import Forecast

Rank = tuple[float, float, int]
"""One session's place in a tier's eviction order: (p within horizon, p at all, recency)."""


class GapShape:
    """Where, between two horizons, returns fall: the histogram of every idle gap that
    ended in a return, on a log grid, learnt online.

    A forecast is calibrated at its horizons only; between them
    ``ReturnForecast.within`` is linear in log time, which puts half of the
    first minute's returns in its first 7 s. Ranking idle sessions by the chance
    that they return *soon* depends on that shape, so the policy reads a
    forecast between horizons with the shape of the gaps it has seen instead,
    once an interval holds ``min_samples`` of them.
    """

    EDGES = (0.0, *geometric_grid(1.0, 7 * 86400.0, 80))

    def __init__(self, min_samples: int = 50) -> None:
        self.min_samples = min_samples
        self._log_edges = [math.log1p(edge) for edge in self.EDGES]
        self._cumulative = [0.0] * len(self.EDGES)  # gaps <= each edge

    def add(self, gap: float) -> None:
        cumulative = self._cumulative
        for index in range(bisect.bisect_left(self.EDGES, gap), len(cumulative)):
            cumulative[index] += 1.0

    def count(self, seconds: float) -> float:
        """Gaps seen up to ``seconds``, interpolated within a bin in log time."""
        return interpolate(math.log1p(max(0.0, seconds)), self._log_edges, self._cumulative)

    def share(self, low: float, high: float, seconds: float) -> float | None:
        """Of the gaps in ``(low, high]``, the share up to ``seconds`` (None: too few)."""
        below = self.count(low)
        total = self.count(high) - below
        if total < self.min_samples:
            return None
        return min(1.0, max(0.0, (self.count(seconds) - below) / total))


@dataclass(frozen=True)
class IdleForecast:
    """A session's forecast as its idle time grows (module docstring); ``at``: when it
    was made, ``levels``: (horizon, P(back within it)) at each of its horizons."""

    forecast: Forecast
    at: float
    levels: tuple[tuple[float, float], ...]

    @classmethod
    def made(cls, forecast: Forecast, at: float) -> IdleForecast:
        return cls(forecast, at, tuple((h, forecast.within(h)) for h in forecast.horizons))

    def chance(self, seconds: float, now: float, gaps: GapShape) -> float:
        """P(back within ``seconds`` from ``now`` | not back yet)."""
        elapsed = max(0.0, now - self.at)
        before = self.within(elapsed, gaps)
        rest = 1.0 - before
        if rest <= 1e-9:
            return 0.0
        return max(0.0, (self.within(elapsed + seconds, gaps) - before) / rest)

    def within(self, seconds: float, gaps: GapShape) -> float:
        """P(back within ``seconds`` of ``at``): the forecast at its horizons, shaped
        between them by ``gaps`` once they hold enough returns there, flat beyond the
        last."""
        low, p_low = 0.0, 0.0
        for high, p_high in self.levels:
            if seconds <= high:
                share = gaps.share(low, high, seconds)
                if share is None:
                    return self.forecast.within(seconds)
                return p_low + (p_high - p_low) * share
            low, p_low = high, p_high
        return p_low if self.levels else self.forecast.within(seconds)


class TierRanking:
    """The sessions holding blocks in one tier, in eviction order, and their blocks.

    ``entries`` is kept sorted; a session whose rank changes gets a new entry
    and its old one goes stale (``live`` names the current one), to be skipped
    and dropped at the next compaction. Blocks of each session are kept in
    chain order, head first, so the tail is evicted first.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[Rank, str]] = []
        self.live: dict[str, tuple[Rank, str]] = {}
        self.blocks: dict[str, dict[ChunkKey, None]] = {}
        self.owner: dict[ChunkKey, str] = {}

    def add(self, key: ChunkKey, session: str) -> bool:
        """File ``key`` under ``session``; returns whether the session is new to the tier."""
        current = self.owner.get(key)
        if current == session:
            return False
        if current is not None:
            self._unfile(key, current)
        self.owner[key] = session
        blocks = self.blocks.get(session)
        new = blocks is None
        if blocks is None:
            blocks = self.blocks[session] = {}
        blocks[key] = None
        return new

    def remove(self, key: ChunkKey) -> None:
        session = self.owner.pop(key, None)
        if session is not None:
            self._unfile(key, session)

    def _unfile(self, key: ChunkKey, session: str) -> None:
        blocks = self.blocks[session]
        del blocks[key]
        if not blocks:
            del self.blocks[session]
            self.live.pop(session, None)

    def rank(self, session: str, rank: Rank) -> None:
        old = self.live.get(session)
        if old is not None and old[0] == rank:
            return
        entry = (rank, session)
        self.live[session] = entry
        bisect.insort(self.entries, entry)
        if len(self.entries) > 2 * len(self.live) + 64:
            self.entries = sorted(self.live.values())

    def drop_stale(self) -> None:
        """Drop stale entries from the front, so the first entry is a live one."""
        entries = self.entries
        while entries and self.live.get(entries[0][1]) is not entries[0]:
            del entries[0]

    def victims(self) -> Iterator[ChunkKey]:
        self.drop_stale()
        position = 0
        while position < len(self.entries):
            entry = self.entries[position]
            position += 1
            session = entry[1]
            if self.live.get(session) is not entry:
                continue
            yield from _tail_first(self.blocks, session)


def _tail_first(blocks: dict[str, dict[ChunkKey, None]], session: str) -> Iterator[ChunkKey]:
    """``blocks[session]`` from the tail, in snapshots that double (the store may remove
    keys between two ``next`` calls), so walking ``n`` blocks costs O(n)."""
    seen: set[ChunkKey] = set()
    size = 16
    while True:
        held = blocks.get(session)
        if not held:
            return
        batch = [key for key in itertools.islice(reversed(held), size) if key not in seen]
        if not batch:
            return
        for key in batch:
            seen.add(key)
            if key in held:
                yield key
        size *= 2
