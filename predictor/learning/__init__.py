"""Learning when an idle session's human comes back, online, from session events.

The pipeline (docs/predictor_design.md draws it whole)::

    events ─► sessions.SessionTracker ─► features.feature_vector ─► model.ReturnModel
                                              online.OnlineLearner: forecast at idle,
                                              label on return or when a horizon passes,
                                              one step per label batch; quality.PrequentialScores
              counting.py: the counts beside the model (tool returns, the previous-gap
              table it is blended with, how often superseded sessions come back)

Typical use, one call per event::

    tracker = SessionTracker()
    learner = OnlineLearner(ReturnModel(len(feature_names())), tracker, PrequentialScores())
    forecast = learner.observe(event)        # a ReturnForecast when a session goes idle
    forecast.within(600.0)                   # P(back within 10 min)

May import: the format and ``kvstore.wire.events``; nothing of tiers, the store or
placement, so a model can be trained and scored with no store at all.
"""


from kvstore.predictor.learning.features import FEATURES, feature_names, feature_vector
from kvstore.predictor.learning.model import DEFAULT_HORIZONS, ReturnModel, default_prior
from kvstore.predictor.learning.online import OnlineLearner, ReturnForecast
from kvstore.predictor.learning.quality import PrequentialScores
from kvstore.predictor.learning.sessions import SessionState, SessionTracker

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
