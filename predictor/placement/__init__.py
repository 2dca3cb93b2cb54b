"""Where an idle session's KV waits, and which blocks leave a tier first.

::

    hooks.py      the session-policy protocol (on_idle, on_resume, tick), forecasts, prefetch counts
    policy.py     PlacementPolicy: placement and eviction by forecast return
    thresholds.py   its per-tier horizons and keep thresholds (PlacementConfig)
    holdings.py   what each tier holds, whose it is, in eviction order
    prefetching.py  its prefetches, run in the hook or later off the store's lock
    overload.py   when the engine cannot keep up, and it falls back to LRU
    ranking.py    eviction order inside a tier; where between horizons returns fall
    decisions.py  the log of what the policy decided for each session, and why
    baselines.py  LRU and a fixed idle timeout, with the same hooks

Every policy here is also the store's ``EvictionPolicy`` (``kvstore.store.eviction``).
May import: the format, ``kvstore.kinds``, ``kvstore.store`` and
``kvstore.predictor.learning``.
"""
