"""The predictor against LRU and the rule baselines where the engine cannot keep up.

The predictor is on in every daemon, so its worst regime is every operator's.
This replays (``kvstore replay``: the real store and policies on a simulated
clock) scenarios the predictor was not tuned on and prints each policy's
GPU-seconds against LRU's and the best baseline's in the same scenario::

    agents-1gpu   bench/agent_trace.py's coding agents (Poisson sessions, a 12K-token
                  system prompt shared by all, contexts to 200K tokens), open loop,
                  on 1 GPU with 40 GB of HBM for KV, 200 GB DRAM, 2 TB SSD: the
                  admission queue grows for hours
    agents-4gpu   the same trace on 4 GPUs with 4x the memory: it keeps up
    conversations kv-cache-tester conversations (--traces) starting at Poisson
                  times (--rate an hour), open loop, on 1 GPU: more than it serves

``--started-at admission`` has the engine report each request's start once it is
admitted, as vLLM's connector does, rather than when it arrives (``kvstore replay
--started-at``): while requests queue for hours the two tell the policies very
different stories.

The figure is the ratio: a policy that costs more than LRU (above 1.00x) in any
scenario is what a default policy cannot afford. Prefetches issued and
wasted, the bytes wasted and the time demand loads waited behind other copies on
the tiers' links (``replay.links``) come with each row. ``--plot PNG`` draws the
ratios; ``--replot REPORT... --plot PNG`` draws them from saved ``--json``
reports. ``--quick`` is a few minutes of agents on one GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import agent_trace
from common import bench_arguments, emit_json, format_table, log

BASELINES = ("lru", "ttl:60", "tool-aware", "prev-gap", "lognormal-tools")
"""Every policy but the predictor and the oracle; LRU first, the reference."""
POLICIES = (*BASELINES, "predictor", "oracle")
QUICK_POLICIES = ("lru", "tool-aware", "predictor")


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    source: str  # "agents" (generated) or "conversations"
    flags: tuple[str, ...]  # capacities, GPUs, arrivals


SCENARIOS = (
    Scenario(
        "agents-1gpu",
        "agents",
        ("--gpus", "1", "--hbm-gb", "40", "--dram-gb", "200", "--ssd-gb", "2000"),
    ),
    Scenario(
        "agents-4gpu",
        "agents",
        ("--gpus", "4", "--hbm-gb", "160", "--dram-gb", "800", "--ssd-gb", "8000"),
    ),
    Scenario(
        "conversations",
        "conversations",
        ("--gpus", "1", "--hbm-gb", "100", "--dram-gb", "200", "--ssd-gb", "4000"),
    ),
)


def replay(paths: Sequence[str], flags: Sequence[str], policies: Sequence[str]) -> dict[str, Any]:
    """``kvstore replay`` as a user runs it; its JSON report."""
    command = [
        sys.executable, "-m", "kvstore", "replay", *paths, *flags,
        "--policy", ",".join(policies), "--json", "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def rows(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per policy: GPU-seconds, against LRU and the best baseline, prefetch counts."""
    policies = report["policies"]
    lru = policies["lru"]["gpu_seconds"]
    baselines = [name for name in policies if name in BASELINES]
    best = min(baselines, key=lambda name: policies[name]["gpu_seconds"])
    figures = {}
    for name, result in policies.items():
        gpu_s = result["gpu_seconds"]
        prefetches = result.get("prefetches") or {}
        figures[name] = {
            "gpu_seconds": gpu_s,
            "vs_lru": gpu_s / lru,
            "vs_best_baseline": gpu_s / policies[best]["gpu_seconds"],
            "best_baseline": best,
            "ttft_p50": result["ttft_p50"],
            "load_seconds": result["load_seconds"],
            "link_wait_seconds": result.get("link_wait_seconds", 0.0),
            "prefetches_issued": prefetches.get("issued", 0),
            "prefetches_wasted": prefetches.get("wasted", 0),
            "prefetch_bytes": result.get("prefetch_bytes", {}),
            "overload": result.get("overload"),  # the placement policy's fallback to LRU
        }
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--policy", help=f"comma-separated (default {','.join(POLICIES)})")
    parser.add_argument("--scenarios", help="comma-separated (default: all, quick agents-1gpu)")
    parser.add_argument(
        "--traces",
        type=Path,
        help="kv-cache-tester conversations (a folder; without it the "
        "conversations scenario is skipped)",
    )
    parser.add_argument("--rate", type=float, default=120.0, help="conversations an hour")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--started-at",
        choices=("arrival", "admission"),
        default="arrival",
        help="when the engine reports a request's start (kvstore replay --started-at)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        help="draw each scenario's GPU-seconds against LRU's into this PNG",
    )
    parser.add_argument(
        "--replot",
        type=Path,
        nargs="+",
        help="replay nothing: draw --plot from these reports (this command's --json)",
    )
    args = parser.parse_args(argv)
    if args.replot:
        if args.plot is None:
            parser.error("--replot needs --plot")
        saved: dict[str, Any] = {}
        for path in args.replot:
            saved.update(json.loads(path.read_text())["scenarios"])
        plot(saved, args.plot)
        return 0
    policies = (
        args.policy.split(",") if args.policy else list(QUICK_POLICIES if args.quick else POLICIES)
    )
    if "lru" not in policies:
        parser.error("--policy must include lru, the reference")
    wanted = (
        args.scenarios.split(",")
        if args.scenarios
        else (["agents-1gpu"] if args.quick else [s.name for s in SCENARIOS])
    )
    shape = agent_trace.Shape(hours=0.25) if args.quick else agent_trace.Shape()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvs-overload-") as root:
        trace = Path(root) / "agents.jsonl"
        agent_trace.write(agent_trace.generate(shape, args.seed), trace)
        for scenario in SCENARIOS:
            if scenario.name not in wanted:
                continue
            if scenario.source == "conversations":
                if args.traces is None:
                    log(f"{scenario.name}: skipped, no --traces")
                    continue
                paths, flags = [str(args.traces)], ["--rate", str(args.rate)]
            else:
                paths, flags = [str(trace)], []
            log(f"{scenario.name}: {', '.join(policies)}")
            flags += [*scenario.flags, "--seed", str(args.seed), "--started-at", args.started_at]
            results[scenario.name] = rows(replay(paths, flags, policies))
    report = {"policies": policies, "started_at": args.started_at, "scenarios": results}
    if args.plot is not None:
        plot(results, args.plot)
    if args.json:
        emit_json(report)
    else:
        print_tables(results)
    return 0


def plot(results: dict[str, Any], path: Path) -> None:
    """Grouped bars: per scenario, each policy's GPU-seconds as a multiple of LRU's, with
    LRU's line at 1: a bar above it is a regime where the policy costs more than LRU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(results)
    policies = list(dict.fromkeys(name for figures in results.values() for name in figures))
    width = 0.8 / len(policies)
    figure, axis = plt.subplots(figsize=(2.2 * len(scenarios) + 2.5, 4))
    for i, policy in enumerate(policies):
        xs = [j + (i - (len(policies) - 1) / 2) * width for j in range(len(scenarios))]
        ratios = [results[name].get(policy, {}).get("vs_lru", float("nan")) for name in scenarios]
        bars = axis.bar(xs, ratios, width, label=policy)
        axis.bar_label(bars, fmt="%.2f", fontsize=7)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(scenarios)), scenarios)
    axis.set_ylabel("GPU-seconds / LRU's")
    axis.set_title("under overload and beside it (bench/overload.py)")
    axis.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def print_tables(results: dict[str, Any]) -> None:
    headers = [
        "policy", "GPU-s", "x LRU", "x best baseline", "TTFT p50 s", "link wait s",
        "prefetches", "wasted", "wasted TB", "as LRU",
    ]  # fmt: skip
    for name, figures in results.items():
        print(f"\n{name}")
        table = [
            [
                policy,
                f"{row['gpu_seconds']:,.0f}",
                f"{row['vs_lru']:.3f}",
                f"{row['vs_best_baseline']:.3f} ({row['best_baseline']})",
                f"{row['ttft_p50']:.3g}",
                f"{row['link_wait_seconds']:,.0f}",
                row["prefetches_issued"],
                row["prefetches_wasted"],
                f"{row['prefetch_bytes'].get('wasted', 0) / 1e12:.1f}",
                fallen_back(row.get("overload")),
            ]
            for policy, row in figures.items()
        ]
        print(format_table(headers, table))


def fallen_back(overload: dict[str, float] | None) -> str:
    """How long the placement policy evicted as LRU (``placement.overload``); "-" for a
    baseline."""
    if not overload:
        return "-"
    return f"{overload['overloaded_s'] / 3600:.1f} h, {overload['held_back']:,} held back"


if __name__ == "__main__":
    sys.exit(main())
