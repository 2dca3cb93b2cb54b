"""Trace replay: drive the real store and policies over request traces on a simulated clock.

::

    commands.py   ``kvstore replay`` and ``kvstore train-predictor``
    traces.py     Mooncake and TraceLab traces as one request list
    timeline.py   a trace's requests as the session events the replay feeds
    simulator.py  the event loop: the real TieredStore, the real policies
    costs.py      the modeled cost of every request (nothing here is timed)
    policies.py   the policies a replay compares, by their command-line names
    oracle.py     the true next arrival, sharp or blurred to a chosen AUC
    training.py   the learner alone over traces (pre-training)
    ablation.py   what each feature is worth
    report.py     JSON, table, plots

A tool over the whole package: may import anything but the daemon and the client.
"""
