"""A replay's results as JSON, as a table, and as plots.

The JSON (``kvstore replay --json``)::

    {"trace": NAME, "requests": N, "prompt_tokens": N, "config": {...},
     "policies": {NAME: {"gpu_seconds", "queue_seconds", "writeback_seconds",
                         "ttft_p50", "ttft_p99", "ttft_p50_human", "ttft_p99_human",
                         "ttft_p50_tool", "ttft_p99_tool", "hit_rate",
                         "hit_rate_by_tier": {"hbm": ..}, "hbm_gb_hours_idle",
                         "load_seconds_by_turn": {"human": {"ssd": ..}, "tool": {..}},
                         "bytes_moved": {"dram": {"read", "written"}, ..},
                         "link_wait_seconds", "prefetches_used", "prefetches_wasted",
                         "prefetch_bytes": {"ssd->dram": .., "wasted": ..},
                         "auc": {"60": ..}, "brier": {..}, "auc_human": {..},
                         "brier_human": {..}, ...}},
     "baselines": {"prev_gap": {"auc_human", "brier_human"},
                   "base_rate": {"auc_human", "brier_human"}},
     "summary": {"best_baseline", "predictor_saves_vs_best_baseline", ...}}

``auc`` and ``brier`` are the predictor's prequential scores per horizon over
every idle period (``learning.quality``); ``auc_human`` and ``brier_human``
over the periods a human ends (``replay.scoring``), where ``baselines`` are
scored on exactly the same periods (those of the predictor's run). The gap
closed is ``(best baseline - predictor) / (best baseline - oracle)`` in
GPU-seconds, the best baseline being the cheapest of the baseline policies.
``floor_gpu_seconds`` is what every policy spends at any capacity (``bound``'s
floor: first accesses and prompt tails), and ``predictor_saves_above_floor`` (and
the oracle's) the share of the best baseline's GPU-seconds above it that the
policy saves: a saving of all GPU-seconds is diluted by the floor, whoever places.
Numbers that are not defined (an AUC before both labels were seen) are null.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.kinds import TierKind
from kvstore.predictor.replay.bound import Bound, placement_floor
from kvstore.predictor.replay.config import ReplayConfig
from kvstore.predictor.replay.results import PolicyResult
from kvstore.predictor.replay.workload import Workload


def _clean(value: Any) -> Any:
    """NaN and infinities as ``None`` (JSON has neither), recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _clean(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(item) for item in value]
    return value


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else math.nan


def policy_summary(result: PolicyResult) -> dict[str, Any]:
    """One policy's numbers, as they appear under ``"policies"``."""
    ttft = np.asarray(result.ttft_s, dtype=np.float64)
    prompt = result.prompt_tokens
    summary: dict[str, Any] = {
        "hit_rate": result.hit_rate,
        "hit_rate_by_tier": {
            kind.label: result.hit_tokens_by_tier.get(kind, 0) / prompt if prompt else math.nan
            for kind in TierKind
            if kind in result.hit_tokens_by_tier or kind is not TierKind.REDIS
        },
        "hit_tokens": result.hit_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        "gpu_seconds": result.gpu_seconds,
        "load_seconds": result.load_seconds,
        "link_wait_seconds": result.link_wait_seconds,
        "load_seconds_by_turn": {
            turn: {kind.label: seconds for kind, seconds in sorted(by_tier.items())}
            for turn, by_tier in sorted(result.load_seconds_by_turn.items())
        },
        "writeback_seconds": result.writeback_seconds,
        "queue_seconds": result.queue_seconds,
        "admission_wait_seconds": result.admission_wait_seconds,
        "ttft_mean": float(ttft.mean()) if ttft.size else math.nan,
        "ttft_p50": _percentile(result.ttft_s, 50),
        "ttft_p99": _percentile(result.ttft_s, 99),
        "ttft_p50_human": _percentile(result.ttft_human_s, 50),
        "ttft_p99_human": _percentile(result.ttft_human_s, 99),
        "ttft_p50_tool": _percentile(result.ttft_tool_s, 50),
        "ttft_p99_tool": _percentile(result.ttft_tool_s, 99),
        "service_p50_human": _percentile(result.service_human_s, 50),
        "service_p99_human": _percentile(result.service_human_s, 99),
        "hbm_gb_hours_idle": result.hbm_gb_hours_idle,
        "bytes_moved": result.bytes_moved,
        "prefetches": result.prefetches.to_dict(),
        "prefetches_used": result.prefetches.used,
        "prefetches_wasted": result.prefetches.wasted,
        "prefetch_bytes": result.prefetch_bytes,
        "demoted_at_idle": result.demoted_at_idle,
        "overload": result.overload,
        "tiers": result.tier_counters,
        "auc": {},
        "brier": {},
        "auc_human": {},
        "brier_human": {},
    }
    if result.human is not None:
        summary["auc_human"] = result.human["auc_human"]
        summary["brier_human"] = result.human["brier_human"]
        summary["labels_human"] = result.human["n_human"]
    if result.quality is not None:
        quality = result.quality
        summary["auc"] = quality.get("auc", {})
        summary["brier"] = quality.get("brier", {})
        summary["log_loss"] = quality.get("log_loss", {})
        summary["labels"] = quality.get("n", {})
        summary["baselines"] = {
            name: {
                "auc": quality.get(f"{name}_auc", {}),
                "brier": quality.get(f"{name}_brier", {}),
            }
            for name in ("base_rate", "last_gap")
        }
    return summary


def gap_closed(baseline: float, predictor: float, oracle: float) -> float:
    """The share of the baseline-to-oracle gap the predictor closes (NaN without a gap)."""
    gap = baseline - oracle
    return (baseline - predictor) / gap if gap > 0 else math.nan


def summarize(
    workload: Workload,
    results: Sequence[PolicyResult],
    config: ReplayConfig,
    horizons: Sequence[float],
    bound: Bound | None = None,
    sweep: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The whole replay: workload, configuration, every policy, the offline bound, the
    comparison, and the users x HBM grid (``replay.sweep``'s cells) when one was run."""
    first = results[0] if results else None
    policies = {result.name: policy_summary(result) for result in results}
    sizing = config.sizing
    chunk_tokens = workload.block_tokens * config.chunk_blocks
    summary: dict[str, Any] = {}
    baselines = [r for r in results if r.baseline]
    by_name = {r.name: r for r in results}
    if baselines:
        best = min(baselines, key=lambda r: r.gpu_seconds)
        summary["best_baseline"] = best.name
        summary["best_baseline_gpu_seconds"] = best.gpu_seconds
        predictor, oracle = by_name.get("predictor"), by_name.get("oracle")
        if predictor is not None:
            summary["predictor_beats_every_baseline"] = all(
                predictor.gpu_seconds < r.gpu_seconds for r in baselines
            )
            summary["predictor_saves_vs_best_baseline"] = (
                1.0 - predictor.gpu_seconds / best.gpu_seconds
            )
        if predictor is not None and oracle is not None:
            summary["predictor_gap_closed"] = gap_closed(
                best.gpu_seconds, predictor.gpu_seconds, oracle.gpu_seconds
            )
        floor = placement_floor(workload, config, bound)
        if floor is not None:
            # What placement can change is only what the best baseline spends above it.
            summary["floor_gpu_seconds"] = floor
            for result in (predictor, oracle):
                if result is not None:
                    summary[f"{result.name}_saves_above_floor"] = gap_closed(
                        best.gpu_seconds, result.gpu_seconds, floor
                    )
        if bound is not None:
            summary["bound_below_best_baseline"] = 1.0 - bound.gpu_seconds / best.gpu_seconds
            if predictor is not None:
                summary["predictor_bound_gap_closed"] = gap_closed(
                    best.gpu_seconds, predictor.gpu_seconds, bound.gpu_seconds
                )
    scored = next((r for r in results if r.name == "predictor" and r.human), None)
    scored = scored or next((r for r in results if r.human), None)
    baselines_scores: dict[str, Any] = {}
    if scored is not None and scored.human is not None:
        baselines_scores = {name: scored.human[name] for name in ("prev_gap", "base_rate")}
    report = {
        "trace": workload.name,
        "requests": first.requests if first else 0,
        "prompt_tokens": first.prompt_tokens if first else 0,
        "config": {
            "hbm_gb": sizing.hbm_gb,
            "dram_gb": sizing.dram_gb,
            "ssd_gb": sizing.ssd_gb,
            "redis_gb": sizing.redis_gb,
            "slots": {
                kind.label: sizing.slots(kind, chunk_tokens, config.kv_bytes_per_token)
                for kind in TierKind
            },
            "chunk_tokens": chunk_tokens,
            "kv_bytes_per_token": config.kv_bytes_per_token,
            "recompute_tokens_per_s": config.costs.recompute_tokens_per_s,
            "reload_bytes_per_s": {kind.label: config.costs.bytes_per_s(kind) for kind in TierKind},
            "max_running": config.engine.max_running,
            "gpus": config.engine.gpus,
            "started_at": config.engine.started.value,
            "closed_loop": workload.closed_loop,
            "lanes": len(workload.lanes),
            "seed": config.seed,
            "tick_s": config.tick_s,
            "horizons": list(horizons),
            "max_requests": config.max_requests,
            "score_from": config.score_from if math.isfinite(config.score_from) else None,
        },
        "policies": {**policies, **({"bound": bound.to_dict()} if bound else {})},
        "baselines": baselines_scores,
        "summary": summary,
        **({"sweep": list(sweep)} if sweep else {}),
    }
    return _clean(report)


def format_table(report: dict[str, Any]) -> str:
    """The report as a table for a terminal."""

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}%"

    def num(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    horizons = [f"{h:g}" for h in report["config"]["horizons"]]
    columns = [
        "policy",
        "hit",
        "hbm",
        "dram",
        "ssd",
        "redis",
        "GPU-s",
        "queue-s",
        "TTFT p50 human",
        "p99 human",
        "w/o queue",
        "p99 tool",
        "HBM GB-h idle",
        "link wait-s",
        "prefetch used/wasted",
        *[f"AUC {h}s" for h in horizons],
    ]
    rows = [columns]
    for name, p in report["policies"].items():
        if name == "bound":
            continue
        tiers = p["hit_rate_by_tier"]
        rows.append(
            [
                name,
                pct(p["hit_rate"]),
                pct(tiers.get("hbm")),
                pct(tiers.get("dram")),
                pct(tiers.get("ssd")),
                pct(tiers.get("redis")),
                num(p["gpu_seconds"]),
                num(p["queue_seconds"]),
                num(p["ttft_p50_human"], 3),
                num(p["ttft_p99_human"], 3),
                num(p["service_p99_human"], 3),
                num(p["ttft_p99_tool"], 3),
                num(p["hbm_gb_hours_idle"], 2),
                num(p.get("link_wait_seconds")),
                f"{p['prefetches_used']}/{p['prefetches_wasted']}",
                *[num(p["auc"].get(h), 3) if p["auc"] else "-" for h in horizons],
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    config = report["config"]
    head = (
        f"{report['trace']}: {report['requests']} requests, {report['prompt_tokens']:,} prompt "
        f"tokens; HBM {config['hbm_gb']} GB ({config['slots']['hbm']} chunks), DRAM "
        f"{config['dram_gb']} GB ({config['slots']['dram']}), SSD {config['ssd_gb']} GB "
        f"({config['slots']['ssd']})"
        + (
            f", Redis {config['redis_gb']} GB ({config['slots']['redis']})"
            if config["redis_gb"]
            else ""
        )
    )
    out = [head, "", *lines]
    bound = report["policies"].get("bound")
    if bound:
        out.append(
            f"bound (offline, MIN per tier): {num(bound['gpu_seconds'])} GPU-s; "
            f"{num(bound['gpu_seconds_prefetch'])} with perfect prefetch"
        )
    predictor = report["policies"].get("predictor")
    if predictor and predictor.get("baselines"):
        for name, scores in predictor["baselines"].items():
            auc = ", ".join(f"{h}s {num(scores['auc'].get(h), 3)}" for h in horizons)
            out.append(f"  {name} baseline AUC: {auc}")
    summary = report["summary"]
    if "best_baseline" in summary:
        out.append("")
        out.append(
            f"best baseline: {summary['best_baseline']} "
            f"({num(summary['best_baseline_gpu_seconds'])} GPU-s)"
        )
        if "predictor_saves_vs_best_baseline" in summary:
            out.append(
                f"predictor: {pct(summary['predictor_saves_vs_best_baseline'])} fewer GPU-s than "
                f"the best baseline; beats every baseline: "
                f"{summary['predictor_beats_every_baseline']}"
            )
        if "predictor_gap_closed" in summary:
            out.append(
                f"predictor closes {pct(summary['predictor_gap_closed'])} of the gap "
                "from the best baseline to the oracle"
            )
        if "floor_gpu_seconds" in summary:
            floor = summary["floor_gpu_seconds"]
            share = floor / summary["best_baseline_gpu_seconds"]
            saved = [
                f"the {name} saves {pct(summary[f'{name}_saves_above_floor'])}"
                for name in ("predictor", "oracle")
                if f"{name}_saves_above_floor" in summary
            ]
            out.append(
                f"floor: {num(floor)} GPU-s every policy spends (first accesses, prompt "
                f"tails), {pct(share)} of the best baseline's"
                + (f"; of the rest, {' and '.join(saved)}" if saved else "")
            )
    if report.get("sweep"):
        out += ["", "sweep (users x HBM): predictor vs the best baseline of each cell"]
        for cell in report["sweep"]:
            users = "trace" if cell["users"] is None else f"{cell['users']} users"
            out.append(
                f"  {users:>9}, HBM {cell['hbm_gb']:g} GB: {cell['verdict'] or '-'} "
                f"(saves {pct(cell['predictor_saves_vs_best_baseline'])} against "
                f"{cell['best_baseline']}, {pct(cell['predictor_saves_above_floor'])} of "
                f"what it spends above the floor; the bound is "
                f"{pct(cell['bound_below_best_baseline'])} below it)"
            )
    return "\n".join(out)


def calibration_curves(
    results: Sequence[PolicyResult], bins: int = 10
) -> dict[float, list[tuple[float, float]]]:
    """The predictor's calibration on human turns: per horizon, (mean forecast, observed
    frequency) in ``bins`` bins of equal count (forecasts crowd where the rates are).
    Empty without a predictor run; the other policies fed forecasts (lognormal, the
    oracle) are not the model's."""
    predictor = next((r for r in results if r.name == "predictor"), None)
    if predictor is None or not predictor.calibration:
        return {}
    samples = np.asarray(predictor.calibration, dtype=np.float64)
    curves: dict[float, list[tuple[float, float]]] = {}
    for horizon in sorted(set(samples[:, 0].tolist())):
        rows = samples[samples[:, 0] == horizon]
        rows = rows[np.argsort(rows[:, 1], kind="stable")]
        groups = [g for g in np.array_split(rows, bins) if len(g)]
        curves[horizon] = [(float(g[:, 1].mean()), float(g[:, 2].mean())) for g in groups]
    return curves


def plot(
    report: dict[str, Any],
    results: Sequence[PolicyResult],
    gaps: Sequence[float],
    directory: Path,
) -> list[Path]:
    """PNGs: hit rate and GPU-seconds per policy, the users x HBM sweep when there is
    one, the trace's idle-gap CDF, the predictor's calibration. Returns the files
    written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    names = [name for name in report["policies"] if name != "bound"]

    def save(figure: Any, name: str) -> None:
        path = directory / name
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(names, [100 * (report["policies"][n]["hit_rate"] or 0) for n in names])
    left.set_ylabel("token hit rate (%)")
    right.bar(names, [report["policies"][n]["gpu_seconds"] or 0 for n in names])
    right.set_ylabel("prefill + load GPU-seconds")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30)
    figure.suptitle(report["trace"])
    save(figure, "policies.png")

    if report.get("sweep"):
        save(_sweep_figure(plt, report["sweep"]), "sweep.png")

    if gaps:
        figure, axis = plt.subplots(figsize=(6, 4))
        ordered = np.sort(np.asarray(gaps))
        axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered))
        axis.set_xscale("log")
        axis.set_xlabel("idle gap before a return (s)")
        axis.set_ylabel("CDF")
        for horizon in report["config"]["horizons"]:
            axis.axvline(horizon, color="grey", linestyle=":")
        save(figure, "gap_cdf.png")

    curves = calibration_curves(results)
    if curves:
        figure, axis = plt.subplots(figsize=(5, 5))
        for horizon, points in curves.items():
            xs, ys = zip(*points, strict=True)
            axis.plot(xs, ys, marker="o", label=f"{horizon:g} s")
        axis.plot([0, 1], [0, 1], color="grey", linestyle=":")
        axis.set_title("calibration on human turns (deciles of the forecast)")
        axis.set_xlabel("predicted P(back within horizon)")
        axis.set_ylabel("observed frequency")
        axis.legend()
        save(figure, "calibration.png")
    return written


def _sweep_figure(plt: Any, cells: Sequence[dict[str, Any]]) -> Any:
    """The sweep as a grid: each cell's colour and first figure is what the predictor
    saves against that cell's best baseline (negative: it spends more), the second what
    the offline bound says any policy could; the best baseline's name below them."""
    users = sorted({c["users"] or 0 for c in cells})
    sizes = sorted({c["hbm_gb"] for c in cells})
    grid = np.full((len(users), len(sizes)), np.nan)
    figure, axis = plt.subplots(figsize=(1.8 * len(sizes) + 2.5, 1.2 * len(users) + 1.8))
    for cell in cells:
        row, column = users.index(cell["users"] or 0), sizes.index(cell["hbm_gb"])
        saves = cell["predictor_saves_vs_best_baseline"]
        grid[row, column] = math.nan if saves is None else 100 * saves
        headroom = cell["bound_below_best_baseline"]
        label = "-" if saves is None else f"{100 * saves:+.1f}%"
        if headroom is not None:
            label += f"\nbound {100 * headroom:.0f}%"
        label += f"\n{cell['best_baseline']}"
        axis.text(column, row, label, ha="center", va="center", fontsize=8)
    limit = max(5.0, float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 5.0)
    image = axis.imshow(grid, cmap="RdYlGn", vmin=-limit, vmax=limit, aspect="auto")
    figure.colorbar(image, ax=axis, label="predictor saves vs best baseline (%)")
    axis.set_xticks(range(len(sizes)), [f"{s:g}" for s in sizes])
    axis.set_yticks(range(len(users)), [str(u or "trace") for u in users])
    axis.set_xlabel("HBM for KV (GB)")
    axis.set_ylabel("concurrent users")
    axis.set_title("GPU-seconds: predictor against the best baseline")
    return figure
