"""The links a replay's tiers are read over: every read of a tier shares them.

A chunk read from a tier is a copy over that tier's link into HBM, and the link
carries one copy at a time: a demand load (a request's cached prefix, read at
admission) and a policy's prefetch or promotion (``PrefetchStats.listener``)
queue on it alike, in the order they were issued. The daemon gives demand reads
no priority over prefetches either: both are reads of the same tier. So a
prefetch costs more than the copy itself: every demand load issued behind it
waits, and a wasted prefetch is that wait for nothing::

    links.prefetch(copies, at)    its copies from each source go one after another on
                                  the lane of that source's link free first; a chunk
                                  lands when its copy ends
    links.load(keys, tiers, at)   a request's chunks, one after another: a chunk in
                                  flight is waited for; any other is copied over its
                                  tier's link when both the link and the request's
                                  previous chunk are done

Lanes: DRAM reaches each GPU over that GPU's own host link (one lane per GPU);
a node's SSD and its network to Redis are one link each, shared by every GPU.
HBM is not a link: a chunk there is read in place, at its (tiny) modeled cost.
Writes (a request's write-back, a policy's demotions) are not modeled on the
links: the question here is what reads ahead of time cost the reads on time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.keys import ChunkKey
from kvstore.kinds import TierKind

_SWEEP = 4096
"""Landed copies are forgotten in bulk once this many are remembered."""


@dataclass(frozen=True, slots=True)
class Load:
    """One request's demand load over the links.

    ``seconds``: from its start until its last chunk is in HBM. ``tiers``: each
    chunk's source, the tier a chunk still in flight is copied from.
    ``nominal_s``: the chunks' own copy times, as if the links were idle;
    ``seconds`` beyond that is waiting for other copies (``waited_s``)."""

    seconds: float
    tiers: tuple[TierKind, ...]
    nominal_s: float

    @property
    def waited_s(self) -> float:
        return max(0.0, self.seconds - self.nominal_s)


class Links:
    """Each tier's read link, as lanes free at given times; see the module docstring.

    ``chunk_s[kind]``: one chunk's copy from tier ``kind``; ``lanes[kind]``: copies
    that tier's link carries at once (1 where not given)."""

    def __init__(
        self, chunk_s: Mapping[TierKind, float], lanes: Mapping[TierKind, int] | None = None
    ) -> None:
        self._chunk_s = dict(chunk_s)
        lanes = lanes or {}
        linked = [kind for kind in TierKind if kind is not TierKind.HBM]
        self._free: dict[TierKind, list[float]] = {
            kind: [0.0] * max(1, lanes.get(kind, 1)) for kind in linked
        }
        self._landing: dict[ChunkKey, tuple[float, TierKind]] = {}

    def prefetch(self, copies: Sequence[tuple[ChunkKey, TierKind]], at: float) -> None:
        """Queue the copies of a prefetch, (key, source tier) in order, issued at ``at``."""
        lanes: dict[TierKind, int] = {}
        for key, source in copies:
            self._landing[key] = (self._copy(source, at, lanes), source)
        if len(self._landing) > _SWEEP:
            self._landing = {key: v for key, v in self._landing.items() if v[0] > at}

    def load(self, keys: Sequence[ChunkKey], tiers: Sequence[TierKind], at: float) -> Load:
        """Bring ``keys``, held in ``tiers`` as the lookup found them, into HBM from ``at``."""
        ready = at  # the request's previous chunk is in
        landed = at  # its last chunk in flight has landed
        nominal = 0.0
        charged: list[TierKind] = []
        lanes: dict[TierKind, int] = {}
        for key, kind in zip(keys, tiers, strict=True):
            flight = self._landing.get(key)
            if flight is not None and flight[0] > at:
                landed = max(landed, flight[0])
                kind = flight[1]
            elif kind is TierKind.HBM:
                ready += self._chunk_s[kind]
            else:
                ready = self._copy(kind, ready, lanes)
            nominal += self._chunk_s[kind]
            charged.append(kind)
        return Load(max(ready, landed) - at, tuple(charged), nominal)

    def __len__(self) -> int:
        """Prefetched chunks remembered: those in flight, and landed ones until a sweep."""
        return len(self._landing)

    def _copy(self, source: TierKind, ready: float, lanes: dict[TierKind, int]) -> float:
        """One chunk's copy from ``source``, ready to go at ``ready``: when it ends. A
        transfer's copies from one tier keep to one lane (``lanes``: the lane it took
        for each), the lane free first when it began."""
        free = self._free[source]
        lane = lanes.get(source)
        if lane is None:
            lane = lanes[source] = min(range(len(free)), key=free.__getitem__)
        free[lane] = done = max(ready, free[lane]) + self._chunk_s[source]
        return done
