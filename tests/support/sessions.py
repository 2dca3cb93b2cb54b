"""A real store and a session policy driven the way the daemon and the replay drive them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore.keys import ChunkKey, Namespace
from kvstore.kinds import TierKind
from kvstore.predictor.learning.model import DEFAULT_HORIZONS
from kvstore.predictor.learning.online import ReturnForecast
from kvstore.predictor.learning.sessions import SessionState, SessionTracker
from kvstore.predictor.placement.hooks import SessionPolicy
from kvstore.store.tiered_store import TieredStore
from kvstore.tiers.registry import TierConfig
from kvstore.wire.events import RequestFinished, RequestStarted, Trigger
from support import kv


@dataclass(frozen=True)
class StepForecast:
    """Back exactly ``after`` seconds after going idle: a forecast that jumps from 0 to 1."""

    session: str
    at: float
    after: float
    horizons: tuple[float, ...] = ()  # none: the policy reads ``within`` as it is

    def within(self, seconds: float) -> float:
        return float(seconds >= self.after)


class Sessions:
    """Drives one store and one policy the way the daemon and the replay do."""

    def __init__(self, store: TieredStore, policy: SessionPolicy) -> None:
        self.store = store
        self.policy = policy
        self.tracker = SessionTracker()
        self.ns: Namespace = kv.namespace()

    def request(
        self,
        session: str,
        tokens_start: int,
        n_chunks: int,
        now: float,
        *,
        trigger: Trigger = Trigger.USER,
        tool_running: bool = False,
        named: bool = True,
        shared: int = 0,
    ) -> SessionState:
        """One request of ``session`` whose prompt is ``n_chunks`` chunks from ``tokens_start``,
        finished a second later (``tool_running``: it ended asking for a tool). Not
        ``named``, its put names no session, as vLLM's workers' puts. ``shared``: the
        prompt begins with that many chunks every session shares (``shared_keys``)."""
        tokens = np.concatenate([kv.tokens(shared), kv.tokens(n_chunks, start=tokens_start)])
        keys = self.store.keys_for(self.ns, tokens)
        started = RequestStarted(session, trigger, len(tokens), 0, now)
        state, _ = self.tracker.started(started, keys, self.ns.digest)
        self.policy.on_resume(self.store, state, now)
        chunks = kv.chunks(shared + n_chunks)
        self.store.put(self.ns, tokens, chunks, session=session if named else None)
        finished = RequestFinished(session, 1, 8, len(tokens), tool_running, 0, 0, now + 1)
        return self.tracker.finished(finished, keys, self.ns.digest)

    def arrive(self, session: str, tokens_start: int, n_chunks: int, now: float) -> SessionState:
        """A request of ``session`` reported started as it arrives, and still waiting for
        the engine to admit it: nothing of it read or put yet."""
        keys = self.keys(tokens_start, n_chunks)
        started = RequestStarted(session, Trigger.USER, n_chunks * kv.LAYOUT.chunk_tokens, 0, now)
        state, _ = self.tracker.started(started, keys, self.ns.digest)
        self.policy.on_resume(self.store, state, now)
        return state

    def pushed_down(
        self, starts: dict[str, int], n_chunks: int, chances: tuple[float, ...], to: TierKind
    ) -> None:
        """Sessions (name -> first token) that ran at 0 s, went idle at 1 s forecast back
        with ``chances`` at the default horizons, and whose chains pressure then moved
        to ``to``."""
        for name, start in starts.items():
            state = self.request(name, start, n_chunks, now=0.0)
            forecast = ReturnForecast(name, 1.0, DEFAULT_HORIZONS, chances)
            self.policy.on_idle(self.store, state, forecast, 1.0)
            self.store.demote(self.ns, self.keys(start, n_chunks), to=to)

    def shared_keys(self, n_chunks: int) -> list[ChunkKey]:
        """The keys of a prefix of ``n_chunks`` every session shares (``request(shared=)``)."""
        return self.keys(0, n_chunks)

    def busy(self, n_chunks: int) -> None:
        """A request that keeps running (no ``on_idle``) and holds ``n_chunks`` of HBM."""
        self.request("busy", 5000, n_chunks, now=0.0)

    def keys(self, tokens_start: int, n_chunks: int) -> list[ChunkKey]:
        return self.store.keys_for(self.ns, kv.tokens(n_chunks, start=tokens_start))

    def where(self, tokens_start: int, n_chunks: int) -> list[TierKind | None]:
        return self.store.locate(self.ns, self.keys(tokens_start, n_chunks))


def opened(policy: SessionPolicy, *tiers: TierConfig) -> Sessions:
    """A store of ``tiers`` whose eviction policy is ``policy``, to be closed (``with``)."""
    return Sessions(TieredStore(kv.config(*tiers), policy=policy), policy)
