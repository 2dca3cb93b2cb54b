"""Where the predictor wins: the same policies replayed over a grid of users x HBM.

One replay answers for one deployment. A grid says where placement matters: with
HBM for every context or so little that nothing stays, every policy costs the
same and the offline bound says so (no headroom); in between, the policies part.
Each cell is a whole replay at that sizing; its verdict compares the predictor
with the best baseline of the same cell:

    saves = 1 - predictor / best baseline   (GPU-seconds)
    headroom = 1 - bound / best baseline    (what any policy could still save)
    saves above the floor = (best baseline - predictor) / (best baseline - floor)

The last is the share of what placement can change at all (``bound``'s floor: first
accesses and prompt tails, spent at any capacity) that the predictor saves; where the
floor is most of every policy's cost, ``saves`` cannot show much whoever places.

``wins`` when it saves at least ``TIE`` of the best baseline's GPU-seconds, ``loses``
when it spends that much more, ``ties`` in between.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.predictor.replay.bound import offline_bound, placement_floor
from kvstore.predictor.replay.config import Progress, ReplayConfig
from kvstore.predictor.replay.parallel import Run, replay_runs
from kvstore.predictor.replay.policies import PolicySpec
from kvstore.predictor.replay.report import gap_closed, policy_summary
from kvstore.predictor.replay.results import PolicyResult
from kvstore.predictor.replay.workload import Workload

TIE = 0.02
"""A saving this small either way is a tie: seeds move a cell's ratio by about 1%."""


@dataclass(frozen=True)
class Cell:
    """One replay of the grid: ``users`` (``None``: the trace's own arrivals) at ``hbm_gb``."""

    users: int | None
    hbm_gb: float
    gpu_seconds: dict[str, float]
    ttft_p99_human: dict[str, float]
    bound_gpu_seconds: float | None
    best_baseline: str | None
    floor_gpu_seconds: float | None = None

    @property
    def saves(self) -> float | None:
        """1 - predictor / best baseline (None without both)."""
        predictor = self.gpu_seconds.get("predictor")
        if predictor is None or self.best_baseline is None:
            return None
        return 1.0 - predictor / self.gpu_seconds[self.best_baseline]

    @property
    def headroom(self) -> float | None:
        """1 - bound / best baseline: the most any policy could save here."""
        if self.bound_gpu_seconds is None or self.best_baseline is None:
            return None
        return 1.0 - self.bound_gpu_seconds / self.gpu_seconds[self.best_baseline]

    @property
    def saves_above_floor(self) -> float | None:
        """The share of the best baseline's GPU-seconds above the floor the predictor saves."""
        predictor = self.gpu_seconds.get("predictor")
        if predictor is None or self.best_baseline is None or self.floor_gpu_seconds is None:
            return None
        return gap_closed(self.gpu_seconds[self.best_baseline], predictor, self.floor_gpu_seconds)

    @property
    def verdict(self) -> str | None:
        saves = self.saves
        if saves is None:
            return None
        if saves >= TIE:
            return "wins"
        return "loses" if saves <= -TIE else "ties"

    def to_dict(self) -> dict[str, Any]:
        return {
            "users": self.users,
            "hbm_gb": self.hbm_gb,
            "gpu_seconds": self.gpu_seconds,
            "ttft_p99_human": self.ttft_p99_human,
            "bound_gpu_seconds": self.bound_gpu_seconds,
            "best_baseline": self.best_baseline,
            "predictor_saves_vs_best_baseline": self.saves,
            "bound_below_best_baseline": self.headroom,
            "floor_gpu_seconds": self.floor_gpu_seconds,
            "predictor_saves_above_floor": self.saves_above_floor,
            "verdict": self.verdict,
        }


def cell_of(
    users: int | None,
    hbm_gb: float,
    results: Sequence[PolicyResult],
    bound_gpu_seconds: float | None,
    floor_gpu_seconds: float | None = None,
) -> Cell:
    baselines = [r for r in results if r.baseline]
    best = min(baselines, key=lambda r: r.gpu_seconds).name if baselines else None
    return Cell(
        users,
        hbm_gb,
        {r.name: r.gpu_seconds for r in results},
        {r.name: policy_summary(r)["ttft_p99_human"] for r in results},
        bound_gpu_seconds,
        best,
        floor_gpu_seconds,
    )


def sweep(
    workload_for: Callable[[int | None], Workload],
    users: Sequence[int | None],
    hbm_gb: Sequence[float],
    specs: Sequence[PolicySpec],
    config: ReplayConfig,
    *,
    with_bound: bool,
    progress: Progress | None = None,
    jobs: int = 1,
    done: Callable[[int | None, float], Sequence[PolicyResult] | None] = lambda u, h: None,
) -> list[Cell]:
    """Replay ``specs`` in every cell of ``users`` x ``hbm_gb`` (``config``'s other sizes).
    ``done(users, hbm)`` hands back a cell already replayed (the main run), so it is not
    replayed twice. The cells' runs share the ``jobs`` workers, so a sweep of fewer
    policies than workers still keeps them all busy."""
    grid: list[tuple[int | None, float, Workload, ReplayConfig, Sequence[PolicyResult] | None]]
    grid = []
    runs: list[Run] = []
    for count in users:
        workload = workload_for(count)
        for size in hbm_gb:
            sizing = dataclasses.replace(config.sizing, hbm_gb=size)
            sized = dataclasses.replace(config, sizing=sizing)
            reused = done(count, size)
            grid.append((count, size, workload, sized, reused))
            if reused is None:
                where = f"{count} users, " if count is not None else ""
                runs.extend(
                    Run(workload, spec, sized, f"{spec.name} ({where}{size:g} GB)")
                    for spec in specs
                )
    replayed = iter(replay_runs(runs, progress, jobs=jobs))
    cells: list[Cell] = []
    floors: dict[int | None, float | None] = {}
    for count, size, workload, sized, reused in grid:
        results = reused if reused is not None else [next(replayed) for _ in specs]
        bound = offline_bound(workload, sized) if with_bound else None
        if count not in floors:  # the same at every HBM size
            floors[count] = placement_floor(workload, sized, bound)
        cells.append(
            cell_of(count, size, results, bound.gpu_seconds if bound else None, floors[count])
        )
    return cells
