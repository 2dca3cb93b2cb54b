"""Return-time predictor: when a session goes idle, how soon will its human be back,
and where should its KV wait meanwhile?

::

    learning/    sessions, features, model, online learner, prequential quality:
                 events in, calibrated P(back within h) out; knows nothing of tiers
    placement/   policies that place an idle session's chain and order evictions
                 (the predictor's, and the baselines it is measured against)
    driver.py    events through tracker, learner and policy, in one order
    service.py   the predictor inside ``kvstore serve`` (its thread, queue, lock)
    config.py    the ``[predictor]`` table
    replay/      ``kvstore replay``: the real store and policies over request traces

May import: the format, ``kvstore.tiers``, ``kvstore.store`` and
``kvstore.wire``; never the daemon or the client. The daemon is the one
place that wires predictor and store together (``service.py`` is built by
``kvstore.server``). ``learning`` imports nothing of ``placement``; the
pipeline is drawn in ``docs/predictor_design.md``.
"""
