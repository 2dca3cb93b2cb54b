"""``SessionDriver``: session events through the tracker, the learner and the policy.

The daemon (``service``) and the replay (``replay.simulator``) feed the same
components in the same order; this is that order, written once::

    request_started   started()   tracker, learner (labels the open forecast: it returned);
                                  policy.on_forecast for each idle session the learner
                                  forecast again (its user started this new session)
                      resumed()   policy.on_resume: prefetch the chain, its lookup is next
    request_finished  finished()  tracker, learner (forecast when the session goes idle)
                                  policy.on_idle: keep the chain where it is, or demote it
    timer             tick()      learner labels passed horizons, policy re-places idle sessions

``started`` and ``resumed`` are two calls because the replay looks the prompt
up in between (it charges the request from the tiers the lookup saw, before
any prefetch); the daemon calls them back to back.

The driver holds no lock: the policy is also the store's eviction policy, so
a caller with other threads using the store calls the driver under the
store's lock (``TieredStore.locked``), as the store calls the policy's
eviction hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.keys import ChunkKey
from kvstore.kinds import TierKind
from kvstore.predictor.learning.online import OnlineLearner, ReturnForecast
from kvstore.predictor.learning.sessions import SessionState, SessionTracker
from kvstore.predictor.placement.policy import Forecast, SessionPolicy
from kvstore.store.tiered_store import TieredStore
from kvstore.wire.events import RequestFinished, RequestStarted


@dataclass(frozen=True)
class IdlePlacement:
    """What happened when a session went idle: the learner's forecast (None without a
    learner) and the tier the policy kept its chain in (None: not placed)."""

    state: SessionState
    forecast: ReturnForecast | None
    placed: TierKind | None


class SessionDriver:
    """One store, one session policy, and optionally an online learner (without one,
    a bare tracker: the baselines and the oracle learn nothing)."""

    def __init__(
        self,
        store: TieredStore,
        policy: SessionPolicy,
        learner: OnlineLearner | None = None,
    ) -> None:
        self.store = store
        self.policy = policy
        self.learner = learner
        self.tracker = learner.tracker if learner is not None else SessionTracker()

    def started(
        self,
        event: RequestStarted,
        keys: Sequence[ChunkKey] = (),
        namespace: bytes | None = None,
        user: str | None = None,
    ) -> SessionState:
        """Record a request start (the learner labels the forecast it ends, and may
        forecast other sessions of the user again)."""
        if self.learner is not None:
            self.learner.observe(event, keys, namespace, user)
            for idle, forecast in self.learner.take_revisions():
                self.policy.on_forecast(self.store, idle, forecast, event.time)
        else:
            self.tracker.started(event, keys, namespace, user)
        state = self.tracker.get(event.session)
        assert state is not None, "the tracker just recorded it"
        return state

    def resumed(self, state: SessionState, now: float) -> None:
        """The session's lookup is next: let the policy prefetch its chain."""
        self.policy.on_resume(self.store, state, now)

    def finished(
        self,
        event: RequestFinished,
        keys: Sequence[ChunkKey] = (),
        namespace: bytes | None = None,
        forecast: Forecast | None = None,
    ) -> IdlePlacement | None:
        """Record a request end; if the session went idle, forecast and place it.

        ``forecast`` stands in for the learner's (the oracle's true next
        arrival). None while another request of the session still runs.
        """
        learnt = None
        if self.learner is not None:
            learnt = self.learner.observe(event, keys, namespace)
        else:
            self.tracker.finished(event, keys, namespace)
        state = self.tracker.get(event.session)
        assert state is not None, "the tracker just recorded it"
        if state.active:
            return None
        chosen = forecast if forecast is not None else learnt
        placed = self.policy.on_idle(self.store, state, chosen, event.time)
        return IdlePlacement(state, learnt, placed)

    def tick(self, now: float) -> None:
        """Label the horizons that passed by ``now``; re-place idle sessions."""
        if self.learner is not None:
            self.learner.tick(now)
        self.policy.tick(self.store, now)

    def forget(self, session: str) -> None:
        """Drop a session the caller considers over (its open labels stay unknown)."""
        if self.learner is not None:
            self.learner.forget(session)
        self.tracker.forget(session)
