"""Trace replay: drive the real store and policies over a workload on a simulated clock,
in a modeled engine whose HBM both runs requests and caches KV.

::

    commands.py       ``kvstore replay`` and ``kvstore train-predictor``
    traces.py         Mooncake and TraceLab request traces
    conversations.py  kv-cache-tester conversations (human and tool turns, subagents)
    workload.py       either as lanes of scripts: open loop, or users in a closed loop
    engine.py         the engine: batch slots, HBM admission, the GPUs' prefill queue
    links.py          each tier's read link, shared by demand loads and prefetches
    config.py         what a replay depends on besides workload and policy
    simulator.py      one policy's event loop: the real TieredStore, the real policies
    replay_store.py   the store it runs on, sized in stand-in blocks; a call's chunk keys
    results.py        what one policy did (GPU-seconds, TTFT, bytes moved, ...)
    parallel.py       several policies at once, a worker process each
    timeline.py       a request trace as the session events training feeds the learner
    costs.py          tier sizes and the modeled cost of every request (nothing is timed)
    policies.py       the policies a replay compares, by their command-line names
    oracle.py         the true next arrival, sharp or blurred to a chosen AUC
    bound.py          the offline lower bound on GPU-seconds (MIN per tier)
    scoring.py        AUC and Brier on the idle periods a human ends, with baselines
    sweep.py          the same policies over a grid of users x HBM
    training.py       the learner alone over request traces (pre-training)
    ablation.py       what each feature is worth
    report.py         JSON, table, plots

A tool over the whole package: may import anything but the daemon and the client.
"""
