"""Replays in worker processes, each on a fresh store (``replay_runs``): several policies
over one workload (``replay``), or the cells of a sweep. The same workload and seed
give the same numbers however many run at once, as each worker runs exactly what
``simulator.replay_policy`` runs here."""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvstore.predictor.replay.config import Progress, ReplayConfig
from kvstore.predictor.replay.policies import PolicySpec
from kvstore.predictor.replay.results import PolicyResult
from kvstore.predictor.replay.simulator import replay_policy
from kvstore.predictor.replay.workload import Workload


@dataclass(frozen=True)
class Run:
    """One policy over one workload at one sizing; ``label`` names it in progress reports
    (default: the policy's name)."""

    workload: Workload
    spec: PolicySpec
    config: ReplayConfig
    label: str | None = None


def _replay_one(run: Run, reports: Any) -> PolicyResult:
    """One run in a worker process; progress goes back over ``reports`` (a manager's
    queue; None: none asked for)."""
    progress = None if reports is None else _Reporter(reports)
    return replay_policy(run.workload, run.spec, run.config, _labelled(progress, run.label))


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
    return replay_runs([Run(workload, spec, config) for spec in specs], progress, jobs)


def replay_runs(
    runs: Sequence[Run], progress: Progress | None = None, jobs: int = 1
) -> list[PolicyResult]:
    """Every run, ``jobs`` at a time in worker processes (1: here, in order). Results come
    back in ``runs``' order."""
    if jobs <= 1 or len(runs) <= 1:
        return [
            replay_policy(run.workload, run.spec, run.config, _labelled(progress, run.label))
            for run in runs
        ]
    context = multiprocessing.get_context("spawn")
    # The longest runs first: the last to finish then starts early, not after the
    # others (a predictor's replay takes three LRUs').
    longest_first = sorted(range(len(runs)), key=lambda i: -runs[i].spec.work)
    with context.Manager() as manager:
        reports = manager.Queue() if progress is not None else None
        with ProcessPoolExecutor(max_workers=min(jobs, len(runs)), mp_context=context) as pool:
            futures = {i: pool.submit(_replay_one, runs[i], reports) for i in longest_first}
            while not all(future.done() for future in futures.values()):
                _relay(reports, progress)
            _relay(reports, progress, wait_s=0.0)
            return [futures[i].result() for i in range(len(runs))]


def _labelled(progress: Progress | None, label: str | None) -> Progress | None:
    """``progress`` reporting under ``label`` instead of the policy's name, if given."""
    if progress is None or label is None:
        return progress
    return lambda _policy, done, total: progress(label, done, total)


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
