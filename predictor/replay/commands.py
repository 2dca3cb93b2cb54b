"""``kvstore replay`` and ``kvstore train-predictor``: the command-line faces of the replay.

::

    kvstore replay PATH... [--format mooncake|tracelab|kv-cache-tester]
                   [--users N | --rate PER_HOUR] [--seed S] [--warm-prefix]
                   [--policy lru,ttl:60,...,predictor,oracle,bound]
                   --hbm-gb X --dram-gb Y --ssd-gb Z [--redis-gb W]
                   [--max-running N] [--gpus N] [--chunk-blocks N] [--jobs N]
                   [--kv-bytes-per-token N] [--recompute-tokens-per-s R]
                   [--max-requests N] [--model FILE] [--json] [--plot DIR]
                   [--sweep-users N,N,...] [--sweep-hbm GB,GB,...]
    kvstore train-predictor TRACE... [--format ...] --out FILE

``kvstore.cli`` registers them (``add_commands``) and hands the parsed
arguments here (``run``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvstore.errors import ConfigError, KVStoreError
from kvstore.kinds import TierKind
from kvstore.predictor.replay.engine import DEFAULT_MAX_RUNNING, StartReported
from kvstore.predictor.replay.traces import TraceFormat
from kvstore.predictor.replay.workload import DEFAULT_USERS
from kvstore.store.config import CostModel

if TYPE_CHECKING:
    from kvstore.predictor.replay.config import Progress, ReplayConfig
    from kvstore.predictor.replay.policies import PolicySpec
    from kvstore.predictor.replay.results import PolicyResult
    from kvstore.predictor.replay.workload import Workload

N = TypeVar("N", int, float)

DEFAULT_POLICIES = (
    "lru,ttl:60,ttl:300,ttl:600,tool-aware,prev-gap,lognormal,lognormal-tools,predictor,oracle,bound"
)

COMMANDS = ("replay", "train-predictor")

TRAIN_SIZING = {"hbm": 100.0, "dram": 200.0, "ssd": 4000.0}
"""GB of each tier that serves conversations while the model learns: the closed loop
times each call by how the one before it was served, so training needs a deployment."""


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Add ``replay`` and ``train-predictor`` to the ``kvstore`` parser."""
    defaults = CostModel()
    replay = commands.add_parser(
        "replay", help="replay a request trace through the real store under several policies"
    )
    _add_inputs(replay, "paths", "a trace file (JSON Lines)")
    replay.add_argument(
        "--users", type=int, help="conversations: this many users, each playing one after "
        f"another (default {DEFAULT_USERS})",
    )  # fmt: skip
    replay.add_argument(
        "--rate", type=float, metavar="PER_HOUR",
        help="conversations: start each at a Poisson arrival of this many an hour instead",
    )  # fmt: skip
    replay.add_argument("--seed", type=int, default=0, help="shuffles, arrivals, the model")
    replay.add_argument(
        "--warm-prefix", action="store_true",
        help="conversations: their system prompt and tool definitions are one shared prefix",
    )  # fmt: skip
    replay.add_argument(
        "--max-running", type=int, default=DEFAULT_MAX_RUNNING,
        help=f"requests in the engine's batch at once (default {DEFAULT_MAX_RUNNING})",
    )  # fmt: skip
    replay.add_argument(
        "--started-at", choices=[when.value for when in StartReported],
        default=StartReported.ARRIVAL.value,
        help="when the engine reports a request's start to the daemon: as it arrives "
        "(default) or once admitted (vLLM's connector); they differ while requests queue",
    )  # fmt: skip
    replay.add_argument(
        "--gpus", type=int, default=1,
        help="GPUs prefilling (each one prefill at a time); --hbm-gb is all of theirs",
    )  # fmt: skip
    replay.add_argument(
        "--chunk-blocks", type=int,
        help="trace blocks per chunk (default: 1024 tokens a chunk where blocks are smaller)",
    )  # fmt: skip
    replay.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1,
        help="policies replayed at once, in worker processes (default: one per core)",
    )  # fmt: skip
    replay.add_argument(
        "--policy",
        default=DEFAULT_POLICIES,
        help="comma-separated: lru, ttl:SECONDS, tool-aware, prev-gap, lognormal, "
        f"lognormal-tools, predictor, oracle[:AUC], bound (default {DEFAULT_POLICIES})",
    )
    replay.add_argument("--hbm-gb", type=float, required=True, help="HBM tier, GB of KV")
    replay.add_argument("--dram-gb", type=float, required=True, help="DRAM tier, GB of KV")
    replay.add_argument("--ssd-gb", type=float, required=True, help="SSD (LMDB) tier, GB of KV")
    replay.add_argument("--redis-gb", type=float, help="Redis tier (a private redis-server)")
    replay.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=131072,
        help="KV size of the modeled model (default: Llama-3.1-8B, 131072)",
    )
    replay.add_argument(
        "--recompute-tokens-per-s",
        type=float,
        default=defaults.recompute_tokens_per_s,
        help=f"prefill rate (default {defaults.recompute_tokens_per_s:g})",
    )
    for kind in TierKind:
        value = defaults.bytes_per_s(kind)
        replay.add_argument(
            f"--{kind.label}-bytes-per-s",
            type=float,
            default=value,
            help=f"{kind.label} reload bandwidth (default {value:g})",
        )
    replay.add_argument("--tick", type=float, default=10.0, help="policy timer, seconds")
    replay.add_argument("--max-requests", type=int, help="replay only the first N requests")
    replay.add_argument("--model", type=Path, help="start the predictor from a trained model")
    replay.add_argument(
        "--score-from",
        type=float,
        default=float("-inf"),
        metavar="SECONDS",
        help="charge only requests from this trace time on (after pre-training on the part before)",
    )
    replay.add_argument("--json", action="store_true", help="print the report as JSON")
    replay.add_argument("--plot", type=Path, metavar="DIR", help="write PNG plots to DIR")
    replay.add_argument(
        "--sweep-users", metavar="N,N,...",
        help="conversations: replay every policy again for each of these user counts "
        "(the grid's rows; JSON \"sweep\", plot sweep.png)",
    )  # fmt: skip
    replay.add_argument(
        "--sweep-hbm", metavar="GB,GB,...",
        help="replay every policy again at each of these HBM sizes (the grid's columns)",
    )  # fmt: skip
    replay.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    train = commands.add_parser(
        "train-predictor", help="train the return-time model offline from traces"
    )
    _add_inputs(train, "traces", "trace files, learnt in order")
    train.add_argument("--out", type=Path, required=True, help="where to save the model")
    train.add_argument("--hidden", type=int, default=16, help="hidden units (0: logistic)")
    train.add_argument(
        "--users", type=int, help="conversations: served to this many users, in a closed loop, "
        f"through the predictor's replay (default {DEFAULT_USERS})",
    )  # fmt: skip
    train.add_argument("--seed", type=int, default=0, help="conversations: shuffle and model")
    for tier, size in TRAIN_SIZING.items():
        train.add_argument(
            f"--{tier}-gb", type=float, default=size,
            help=f"conversations: GB of {tier.upper()} where they are served (default {size:g})",
        )  # fmt: skip
    train.add_argument("--json", action="store_true", help="print the scores as JSON")


def _add_inputs(parser: argparse.ArgumentParser, dest: str, traces: str) -> None:
    """The positional paths and ``--format`` both commands read workloads from."""
    parser.add_argument(
        dest, type=Path, nargs="+", metavar="PATH",
        help=f"{traces}, or kv-cache-tester conversations (files or a folder)",
    )  # fmt: skip
    parser.add_argument(
        "--format", choices=[f.value for f in TraceFormat], help="default: guessed"
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.command == "replay":
            return _replay(args)
        return _train(args)
    except KVStoreError as error:
        print(f"kvstore {args.command}: {error}", file=sys.stderr)
        return 2


def _replay(args: argparse.Namespace) -> int:
    from kvstore.predictor.replay.bound import offline_bound
    from kvstore.predictor.replay.config import ReplayConfig, chunk_blocks_for
    from kvstore.predictor.replay.costs import Sizing
    from kvstore.predictor.replay.engine import EngineModel
    from kvstore.predictor.replay.parallel import replay
    from kvstore.predictor.replay.policies import PolicyKind, parse_policies
    from kvstore.predictor.replay.report import format_table, plot, summarize
    from kvstore.predictor.replay.simulator import horizons_for, idle_gaps
    from kvstore.predictor.replay.workload import load_workload

    workload = load_workload(
        args.paths,
        TraceFormat(args.format) if args.format else None,
        users=args.users,
        rate=args.rate,
        seed=args.seed,
        warm_prefix=args.warm_prefix,
    )
    specs = parse_policies(args.policy)
    if args.sweep_users and not workload.closed_loop:
        raise ConfigError("--sweep-users is for conversations")
    grid = (
        _numbers(args.sweep_users, int) if args.sweep_users else [args.users or DEFAULT_USERS],
        _numbers(args.sweep_hbm, float) if args.sweep_hbm else [args.hbm_gb],
    )
    costs = CostModel(
        recompute_tokens_per_s=args.recompute_tokens_per_s,
        reload_bytes_per_s={
            kind: getattr(args, f"{kind.label}_bytes_per_s") for kind in TierKind
        },
        kv_bytes_per_token=args.kv_bytes_per_token,
    )
    progress = None if args.no_progress else _Progress()
    with _redis(args.redis_gb) as redis_url:
        config = ReplayConfig(
            sizing=Sizing(args.hbm_gb, args.dram_gb, args.ssd_gb, args.redis_gb),
            kv_bytes_per_token=args.kv_bytes_per_token,
            costs=costs,
            engine=EngineModel(
                max_running=args.max_running,
                gpus=args.gpus,
                started=StartReported(args.started_at),
            ),
            chunk_blocks=args.chunk_blocks or chunk_blocks_for(workload.block_tokens),
            tick_s=args.tick,
            max_requests=args.max_requests,
            model_path=args.model,
            seed=args.seed,
            score_from=args.score_from,
            redis_url=redis_url,
        )
        replayed = [spec for spec in specs if spec.kind is not PolicyKind.BOUND]
        bound = offline_bound(workload, config) if len(replayed) < len(specs) else None
        results = replay(workload, replayed, config, progress, jobs=args.jobs)
        cells = None
        if args.sweep_users or args.sweep_hbm:
            with_bound = bound is not None
            cells = _sweep(args, grid, workload, results, replayed, config, with_bound, progress)
        horizons = horizons_for(workload, config)
        report = summarize(workload, results, config, horizons, bound, cells)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    if args.plot is not None:
        for path in plot(report, results, idle_gaps(workload, config), args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _sweep(
    args: argparse.Namespace,
    grid: tuple[list[int], list[float]],
    workload: Workload,
    results: Sequence[PolicyResult],
    specs: Sequence[PolicySpec],
    config: ReplayConfig,
    with_bound: bool,
    progress: Progress | None,
) -> list[dict[str, Any]]:
    """The users x HBM grid (``replay.sweep``); the main run is its cell at ``--users``
    and ``--hbm-gb``, not replayed again."""
    from kvstore.predictor.replay.sweep import sweep
    from kvstore.predictor.replay.workload import load_workload

    main_users = args.users or DEFAULT_USERS
    by_users = workload.closed_loop and args.rate is None  # else the trace's own arrivals
    users: list[int | None] = list(grid[0]) if by_users else [None]

    def workload_for(count: int | None) -> Workload:
        if count is None or count == main_users:
            return workload
        return load_workload(
            args.paths, TraceFormat(args.format) if args.format else None,
            users=count, seed=args.seed, warm_prefix=args.warm_prefix,
        )  # fmt: skip

    def done(count: int | None, size: float) -> Sequence[PolicyResult] | None:
        main = count is None or count == main_users
        return results if main and size == args.hbm_gb else None

    cells = sweep(
        workload_for, users, grid[1], specs, config,
        with_bound=with_bound, progress=progress, jobs=args.jobs, done=done,
    )  # fmt: skip
    return [cell.to_dict() for cell in cells]


def _numbers(text: str, kind: Callable[[str], N]) -> list[N]:
    """``"8,16,24"`` -> [8, 16, 24], in order, without duplicates; a clear error otherwise."""
    values: list[N] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            value = kind(item)
        except ValueError:
            raise ConfigError(f"expected comma-separated numbers, got {text!r}") from None
        if not value > 0:
            raise ConfigError(f"sweep values must be positive (got {item!r})")
        if value not in values:
            values.append(value)
    if not values:
        raise ConfigError(f"no sweep values in {text!r}")
    return values


@contextlib.contextmanager
def _redis(redis_gb: float | None) -> Iterator[str | None]:
    """The URL of a private redis-server for ``--redis-gb`` (``None`` without one); each
    policy's run uses its own key prefix, so runs never see each other's blocks."""
    if not redis_gb:
        yield None
        return
    from kvstore.local.redis_server import RedisServer

    with RedisServer() as server:
        yield server.url


class _Progress:
    """One line on stderr for every policy under way at once: its share of calls done."""

    def __init__(self) -> None:
        self.shares: dict[str, float] = {}
        self.line = ""

    def __call__(self, policy: str, done: int, total: int) -> None:
        self.shares[policy] = done / max(total, 1)
        line = "  ".join(f"{name} {100 * share:3.0f}%" for name, share in self.shares.items())
        if line == self.line:
            return
        self.line = line
        finished = all(share >= 1.0 for share in self.shares.values())
        print(f"\r{line}", end="\n" if finished else "", file=sys.stderr, flush=True)
        if finished:  # a sweep's next run starts a line of its own
            self.shares.clear()
            self.line = ""


def _train(args: argparse.Namespace) -> int:
    from kvstore.predictor.learning.features import feature_names
    from kvstore.predictor.learning.model import REHEARSAL, ReturnModel
    from kvstore.predictor.replay.conversations import is_conversations
    from kvstore.predictor.replay.traces import load_trace
    from kvstore.predictor.replay.training import train

    trace_format = TraceFormat(args.format) if args.format else None
    if trace_format is TraceFormat.KV_CACHE_TESTER or (
        trace_format is None and any(is_conversations(path) for path in args.traces)
    ):
        report = _train_on_conversations(args)
    else:
        traces = [load_trace(path, trace_format) for path in args.traces]
        model = ReturnModel(
            len(feature_names()), hidden=args.hidden, rehearsal=REHEARSAL, seed=args.seed
        )
        scores = train(traces, model)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        model.save(args.out)
        report = scores.report()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        for horizon, auc in report.get("auc", {}).items():
            brier = report.get("brier", {}).get(horizon)
            print(f"{horizon:>6} s  AUC {auc:.3f}  Brier {brier:.3f}")
    print(f"saved {args.out}", file=sys.stderr)
    return 0


def _train_on_conversations(args: argparse.Namespace) -> dict[str, Any]:
    """Serve the conversations under the predictor policy (``replay``) and save the model
    it learnt: the events a daemon would see, timed by the closed loop. Returns the
    learner's prequential scores."""
    from kvstore.predictor.replay.config import ReplayConfig, chunk_blocks_for
    from kvstore.predictor.replay.costs import Sizing
    from kvstore.predictor.replay.parallel import replay
    from kvstore.predictor.replay.policies import parse_policies
    from kvstore.predictor.replay.workload import load_workload

    workload = load_workload(
        args.traces, TraceFormat.KV_CACHE_TESTER, users=args.users, seed=args.seed
    )
    config = ReplayConfig(
        sizing=Sizing(args.hbm_gb, args.dram_gb, args.ssd_gb),
        chunk_blocks=chunk_blocks_for(workload.block_tokens),
        model_hidden=args.hidden,
        model_out=args.out,
        seed=args.seed,
    )
    (result,) = replay(workload, parse_policies("predictor"), config)
    return result.quality or {}
