"""Learning when an idle session's human comes back, online, from session events.

The pipeline (docs/predictor_design.md draws it whole)::

    events ─► sessions.SessionTracker ─► features.feature_vector ─► model.ReturnModel
                                              online.OnlineLearner: forecast at idle,
                                              label on return or when a horizon passes,
                                              one step per label batch; quality.PrequentialScores
              counting.py: the counts beside the model (tool returns, the previous-gap
              table it is blended with, how often superseded sessions come back)
              portable.py: the arithmetic forecasts are made and read with, the same
              on every CPU (float64, a grid of 1e-6, scalar interpolation)

Typical use, one call per event::

    tracker = SessionTracker()
    learner = OnlineLearner(ReturnModel(len(feature_names())), tracker, PrequentialScores())
    forecast = learner.observe(event)        # a ReturnForecast when a session goes idle
    forecast.within(600.0)                   # P(back within 10 min)

Import each name from its module: this package imports none of them, so the tracker,
the features and the learner load without torch, which only ``model`` needs (the
daemon listens before it loads its model).

May import: the format and ``kvstore.wire.events``; nothing of tiers, the store or
placement, so a model can be trained and scored with no store at all.
"""
