"""Engine benchmark: time to first token, recomputing a prompt versus loading its prefix.

``python bench/engine.py --json [--quick] [--device cpu|cuda]``

A Llama-shaped transformers model with random weights (on CPU a small one in
float32; on CUDA the Llama-3.1-8B shape in bf16) prefills prompts of several
lengths. For each tier (HBM where present, DRAM, LMDB, Redis on a private
``redis-server``, and a ``kvstore serve`` daemon over its Unix socket) the
prompt's chunks are stored once, then three things are timed, interleaved so
drift hits all alike:

``recompute``  the forward over the whole prompt, argmax of the last logits
``reload``     ``HFKVStore.prefill``: lookup, load every full chunk but the
               last token's, forward over the rest, argmax (layer-wise off)
``layerwise``  the same with the layer-wise loader (``client.hf_cache``)

``load_gbps`` is the KV bytes loaded over the load time (fetch plus unpack
into the cache), against ``ceiling_gbps``: the same bytes copied by a plain
memcpy (CPU) or a pinned host-to-device copy (CUDA) in the same run. Every
path's greedy tokens (first token of each timed run, and a short
``generate`` through ``HFKVStore``) must equal plain ``model.generate``'s;
the benchmark fails otherwise.

JSON on stdout: ``{"device", "model", "results": [{"tier", "prompt_tokens",
"recompute_s", "reload_s", "speedup", "load_gbps", "ceiling_gbps",
"identical"}]}`` for the plain reload, plus ``"overlap"`` (the layer-wise
rows: ``reload_s``, ``hidden_fraction`` of the load the forward did not wait
for) and ``"machine"``. Times are medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (  # noqa: E402
    Case,
    RedisServer,
    ServerProcess,
    bench_session,
    emit_json,
    format_table,
    gbps,
    log,
    machine_info,
    temp_dir,
    time_interleaved,
)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvstore  # noqa: E402
from kvstore.client.embedded import EmbeddedClient  # noqa: E402
from kvstore.client.hf import HFKVStore, Prefill  # noqa: E402
from kvstore.config import StoreConfig, TierConfig  # noqa: E402
from kvstore.store import TieredStore  # noqa: E402
from kvstore.tiers.base import TierKind  # noqa: E402

GiB = 1 << 30
NEW_TOKENS = 4
CPU_SHAPE = {  # ~23M parameters, 8 KiB of KV per token in float32
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
}
LLAMA_8B_SHAPE = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
}


@dataclass(frozen=True)
class Plan:
    device: torch.device
    shape: dict[str, Any]
    dtype: torch.dtype
    lengths: tuple[int, ...]
    chunk_tokens: int
    reps: int
    store_bytes: int


def plan(args: argparse.Namespace) -> Plan:
    if args.device == "cuda":
        lengths = (2048, 8192) if args.quick else (2048, 8192, 32768, 65536)
        return Plan(
            torch.device("cuda"),
            LLAMA_8B_SHAPE,
            torch.bfloat16,
            lengths,
            256,
            2 if args.quick else 3,
            24 * GiB,
        )
    cpu_lengths: tuple[int, ...] = (512, 1024) if args.quick else (1024, 2048, 4096)
    return Plan(
        torch.device("cpu"), CPU_SHAPE, torch.float32, cpu_lengths, 256, 2 if args.quick else 3, GiB
    )


def build_model(p: Plan) -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=max(p.lengths) + 64, **p.shape)
    with torch.device(p.device):
        model: Any = LlamaForCausalLM(config)
    return model.to(p.dtype).eval()


# -- tiers --------------------------------------------------------------------------


@contextmanager
def tier_clients(p: Plan, root: Path, stack: Any) -> Iterator[Iterator[tuple[str, Any]]]:
    """Yield (tier name, client) pairs, each a fresh store holding nothing yet."""
    root.mkdir(parents=True, exist_ok=True)

    def embedded(*tiers: TierConfig) -> EmbeddedClient:
        return EmbeddedClient(TieredStore(StoreConfig(tiers=tiers, promote_on_hit=False)))

    def clients() -> Iterator[tuple[str, Any]]:
        if p.device.type == "cuda":
            yield "hbm", embedded(TierConfig(TierKind.HBM, p.store_bytes, device="cuda"))
        yield "dram", embedded(TierConfig(TierKind.DRAM, p.store_bytes))
        yield (
            "lmdb",
            embedded(TierConfig(TierKind.SSD, 2 * p.store_bytes, path=root / "lmdb", sync=False)),
        )
        redis = stack.enter_context(RedisServer())
        yield (
            "redis",
            embedded(
                TierConfig(TierKind.REDIS, p.store_bytes, url=redis.url, socket_timeout_s=30.0)
            ),
        )
        yield "daemon", kvstore.connect(daemon(p, root, stack), timeout_s=60.0)

    yield clients()


def daemon(p: Plan, root: Path, stack: Any) -> str:
    """Start ``kvstore serve`` (DRAM + LMDB) over ``root``; return its ``unix://`` URL."""
    socket_path = root / "kvstore.sock"
    config = root / "kvstore.toml"
    config.write_text(
        f'data_dir = "{root / "daemon-data"}"\npromote_on_hit = false\n\n'
        f"[tiers.dram]\ncapacity = {p.store_bytes}\n\n"
        f'[tiers.ssd]\ncapacity = {2 * p.store_bytes}\npath = "{root / "daemon-lmdb"}"\n\n'
        f'[daemon]\nsocket_path = "{socket_path}"\nmax_body_bytes = {256 << 20}\n'
        'log_level = "warning"\n'
    )
    argv = [sys.executable, "-m", "kvstore", "serve", "--config", str(config)]
    stack.enter_context(ServerProcess("kvstore serve", argv, socket_path, root / "daemon.log"))
    return f"unix://{socket_path}"


# -- measurement --------------------------------------------------------------------


def ceiling_seconds(nbytes: int, device: torch.device, reps: int) -> float:
    """Median time of the raw copy of ``nbytes``: memcpy on CPU, pinned H2D on CUDA."""
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    source.fill_(1)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 1):
        began = time.perf_counter()
        if device.type == "cuda":
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize(device)
        else:
            np.copyto(target.numpy(), source.numpy())
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def first_token(logits: torch.Tensor) -> int:
    return int(logits[0, -1].argmax().item())


def measure_tier(
    tier: str, client: Any, model: Any, p: Plan, ids: torch.Tensor, reference: torch.Tensor
) -> tuple[dict[str, Any], dict[str, Any]]:
    kv = HFKVStore(model, client, chunk_tokens=p.chunk_tokens, model_id="bench-llama")
    warm = kv.prefill(ids)
    kv.save(ids, warm.cache)
    expected = int(reference[0, ids.shape[1]].item())
    tokens: dict[str, list[int]] = {"recompute": [], "reload": [], "layerwise": []}
    prefills: dict[str, list[Prefill]] = {"reload": [], "layerwise": []}

    def recompute() -> None:
        with torch.no_grad():
            tokens["recompute"].append(first_token(model(ids).logits))

    def reload(layerwise: bool) -> Callable[[], None]:
        name = "layerwise" if layerwise else "reload"

        def run() -> None:
            result = kv.prefill(ids, layerwise=layerwise)
            tokens[name].append(first_token(result.logits))
            prefills[name].append(result)

        return run

    samples = time_interleaved(
        {
            "recompute": Case(run=recompute),
            "reload": Case(run=reload(False)),
            "layerwise": Case(run=reload(True)),
        },
        p.reps,
    )
    generated = [
        kv.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, layerwise=lw).sequences
        for lw in (False, True)
    ]
    identical = all(t == expected for path in tokens.values() for t in path) and all(
        torch.equal(g, reference) for g in generated
    )
    # The timing of the timed repetitions only (time_interleaved runs a warmup first).
    prefills = {name: runs[-p.reps :] for name, runs in prefills.items()}
    loaded = prefills["reload"][-1].report.loaded_tokens
    nbytes = loaded * kv.namespace.layout.bytes_per_token
    load_s = statistics.median(r.report.timing.load_s for r in prefills["reload"])
    ceiling_s = ceiling_seconds(nbytes, p.device, p.reps)
    recompute_s, reload_s = samples["recompute"].median, samples["reload"].median
    row = {
        "tier": tier,
        "prompt_tokens": int(ids.shape[1]),
        "recompute_s": recompute_s,
        "reload_s": reload_s,
        "speedup": recompute_s / reload_s,
        "load_gbps": gbps(nbytes, load_s),
        "ceiling_gbps": gbps(nbytes, ceiling_s),
        "identical": identical,
    }
    layerwise = prefills["layerwise"]
    overlap = {
        "tier": tier,
        "prompt_tokens": int(ids.shape[1]),
        "reload_s": samples["layerwise"].median,
        "load_s": statistics.median(r.report.timing.load_s for r in layerwise),
        "wait_s": statistics.median(r.report.timing.wait_s for r in layerwise),
        "hidden_fraction": statistics.median(r.report.timing.hidden_fraction for r in layerwise),
        "identical": identical,
    }
    return row, overlap


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="shorter prompts, fewer reps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        log("--device cuda: no CUDA device here; nothing measured")
        raise SystemExit(2)
    p = plan(args)
    model = build_model(p)
    rows: list[dict[str, Any]] = []
    overlaps: list[dict[str, Any]] = []
    with bench_session() as stack:
        root = stack.enter_context(temp_dir("kvs-engine-"))
        for length in p.lengths:
            generator = torch.Generator().manual_seed(length)
            ids = torch.randint(0, p.shape["vocab_size"], (1, length), generator=generator)
            ids = ids.to(p.device)
            with torch.no_grad():
                reference = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            with tier_clients(p, root / str(length), stack) as clients:
                for tier, client in clients:
                    with client:
                        row, overlap = measure_tier(tier, client, model, p, ids, reference)
                    log(
                        f"{tier:>7} {length:>6} tokens: recompute {row['recompute_s']:.3f} s, "
                        f"reload {row['reload_s']:.3f} s, layerwise {overlap['reload_s']:.3f} s"
                    )
                    rows.append(row)
                    overlaps.append(overlap)
    log(table(rows, overlaps))
    if args.json:
        emit_json(
            {
                "device": torch.cuda.get_device_name(0) if p.device.type == "cuda" else "cpu",
                "model": f"LlamaForCausalLM random weights {p.shape} {str(p.dtype)[6:]}",
                "results": rows,
                "overlap": overlaps,
                "machine": machine_info(),
            }
        )
    if not all(row["identical"] for row in rows):
        log("FAIL: some path generated different tokens")
        raise SystemExit(1)


def table(rows: list[dict[str, Any]], overlaps: list[dict[str, Any]]) -> str:
    headers = [
        "tier",
        "tokens",
        "recompute s",
        "reload s",
        "speedup",
        "load GB/s",
        "ceiling GB/s",
        "layerwise s",
        "hidden",
        "identical",
    ]
    body = [
        [
            r["tier"],
            r["prompt_tokens"],
            f"{r['recompute_s']:.3f}",
            f"{r['reload_s']:.3f}",
            f"{r['speedup']:.2f}",
            f"{r['load_gbps']:.2f}",
            f"{r['ceiling_gbps']:.2f}",
            f"{o['reload_s']:.3f}",
            f"{o['hidden_fraction']:.2f}",
            r["identical"],
        ]
        for r, o in zip(rows, overlaps, strict=True)
    ]
    return format_table(headers, body)


if __name__ == "__main__":
    main()
