"""SessionDriver: events through the tracker, the learner and the policy, in order."""

from __future__ import annotations

from pathlib import Path

from support import kv

from kvstore.predictor.driver import SessionDriver
from kvstore.predictor.learning.features import feature_names
from kvstore.predictor.learning.model import ReturnModel
from kvstore.predictor.learning.online import OnlineLearner
from kvstore.predictor.learning.sessions import SessionTracker
from kvstore.predictor.placement.hooks import Forecast, IdleSession
from kvstore.predictor.placement.policy import PlacementPolicy
from kvstore.store.tiered_store import TieredStore
from kvstore.wire.events import RequestFinished, RequestStarted, Trigger


class Recording(PlacementPolicy):
    """The real policy, remembering the forecasts it was handed again."""

    def __init__(self) -> None:
        super().__init__()
        self.revised: list[tuple[str, float]] = []

    def on_forecast(
        self, store: TieredStore, state: IdleSession, forecast: Forecast, now: float
    ) -> None:
        self.revised.append((state.session, now))
        super().on_forecast(store, state, forecast, now)


def test_a_user_starting_a_new_session_re_places_their_idle_one(tmp_path: Path) -> None:
    policy = Recording()
    learner = OnlineLearner(ReturnModel(len(feature_names())), SessionTracker())
    ns = kv.namespace()
    with TieredStore(kv.config(kv.dram(8), kv.ssd(tmp_path / "lmdb")), policy=policy) as store:
        driver = SessionDriver(store, policy, learner)
        keys = store.keys_for(ns, kv.tokens(3))
        state = driver.started(RequestStarted("a", Trigger.USER, 3, 0, 0.0), keys, ns.digest, "u")
        driver.resumed(state, 0.0)
        store.put(ns, kv.tokens(3), kv.chunks(3), session="a")
        placed = driver.finished(RequestFinished("a", 1, 8, 3, False, 0, 0, 1.0), keys, ns.digest)
        assert placed is not None and placed.forecast is not None
        driver.started(RequestStarted("other", Trigger.USER, 3, 0, 5.0), (), None, "v")
        assert policy.revised == []  # another user's new session
        driver.started(RequestStarted("b", Trigger.USER, 3, 0, 9.0), (), None, "u")
        assert policy.revised == [("a", 9.0)]
