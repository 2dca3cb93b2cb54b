"""Several policies over one workload, each in a worker process of its own on a fresh
store (``replay``): the same workload and seed give the same numbers however many
run at once, as each worker runs exactly what ``simulator.replay_policy`` runs here."""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from kvstore.predictor.replay.config import Progress, ReplayConfig
from kvstore.predictor.replay.policies import PolicySpec
from kvstore.predictor.replay.results import PolicyResult
from kvstore.predictor.replay.simulator import replay_policy
from kvstore.predictor.replay.workload import Workload


def _replay_one(
    workload: Workload, spec: PolicySpec, config: ReplayConfig, reports: Any
) -> PolicyResult:
    """One policy in a worker process; progress goes back over ``reports`` (a manager's
    queue; None: none asked for)."""
    progress = None if reports is None else _Reporter(reports)
    return replay_policy(workload, spec, config, progress)


class _Reporter:
    """A worker's ``Progress``: each report put on the parent's queue."""

    def __init__(self, reports: Any) -> None:
        self.reports = reports

    def __call__(self, policy: str, done: int, total: int) -> None:
        self.reports.put((policy, done, total))


def replay(
    workload: Workload,
    specs: Sequence[PolicySpec],
    config: ReplayConfig,
    progress: Progress | None = None,
    jobs: int = 1,
) -> list[PolicyResult]:
    """Every policy over the same workload, each on a fresh store, ``jobs`` at a time in
    worker processes (1: here, in order). Results come back in ``specs``' order."""
    if jobs <= 1 or len(specs) <= 1:
        return [replay_policy(workload, spec, config, progress) for spec in specs]
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        reports = manager.Queue() if progress is not None else None
        with ProcessPoolExecutor(max_workers=min(jobs, len(specs)), mp_context=context) as pool:
            runs = [pool.submit(_replay_one, workload, spec, config, reports) for spec in specs]
            while not all(run.done() for run in runs):
                _relay(reports, progress)
            _relay(reports, progress, wait_s=0.0)
            return [run.result() for run in runs]


def _relay(reports: Any, progress: Progress | None, wait_s: float = 0.5) -> None:
    """Hand the workers' progress reports to ``progress`` (waiting up to ``wait_s``)."""
    if reports is None or progress is None:
        if wait_s:
            time.sleep(wait_s)
        return
    try:
        while True:
            progress(*reports.get(timeout=wait_s) if wait_s else reports.get_nowait())
    except queue.Empty:
        return
