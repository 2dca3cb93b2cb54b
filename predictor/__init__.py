"""Return-time predictor: when a session goes idle, how soon will its human be back?

The pipeline (docs/predictor_design.md draws it whole)::

    events ─► sessions.SessionTracker ─► features.feature_vector ─► model.ReturnModel
                                              online.OnlineLearner: forecast at idle,
                                              label on return or when a horizon passes,
                                              one step per label batch; quality.PrequentialScores

Typical use, one call per event::

    tracker = SessionTracker()
    learner = OnlineLearner(ReturnModel(len(feature_names())), tracker, PrequentialScores())
    forecast = learner.observe(event)        # a ReturnForecast when a session goes idle
    forecast.within(600.0)                   # P(back within 10 min)
"""

from kvstore.predictor.features import FEATURES, feature_names, feature_vector
from kvstore.predictor.model import DEFAULT_HORIZONS, ReturnModel, default_prior
from kvstore.predictor.online import OnlineLearner, ReturnForecast
from kvstore.predictor.quality import PrequentialScores
from kvstore.predictor.sessions import SessionState, SessionTracker

__all__ = [
    "DEFAULT_HORIZONS",
    "FEATURES",
    "OnlineLearner",
    "PrequentialScores",
    "ReturnForecast",
    "ReturnModel",
    "SessionState",
    "SessionTracker",
    "default_prior",
    "feature_names",
    "feature_vector",
]
