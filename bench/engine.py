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
``layerwise``  the same with the layer-wise loader (``client.hf.loading``)

``load_gbps`` is the KV bytes a reload puts into the cache over the time of
``client.hf.loading.load_cache`` (the load ``prefill`` runs before its forward:
get every chunk into a staging buffer, unpack every layer into the cache's
tensors), against ``ceiling_gbps``: the same bytes copied between warm
buffers by a plain memcpy (CPU) or a pinned host-to-device copy (CUDA).
The two are timed interleaved, ``LOAD_REPS`` times each (``QUICK_LOAD_REPS`` with
``--quick``), medians; ``ratio`` is ``load_gbps / ceiling_gbps`` and
``best_ratio`` the same from the fastest
repetition of each (what the load costs when no other process takes the
cores). A reload copies the bytes twice (store -> staging -> cache), so on
the host a ratio of 0.5 is the most it can reach; ``fetch_gbps`` and
``install_gbps`` (medians) say how each copy did. Every path's greedy
tokens (first token of each timed run, and a short ``generate`` through
``HFKVStore``) must equal plain ``model.generate``'s; the benchmark fails
otherwise.

JSON on stdout: ``{"device", "model", "results": [{"tier", "prompt_tokens",
"recompute_s", "reload_s", "speedup", "load_gbps", "ceiling_gbps", "ratio",
"best_ratio", "fetch_gbps", "install_gbps", "load_mib", "identical"}]}`` for
the plain reload, plus ``"overlap"`` (the layer-wise rows: ``reload_s``,
``hidden_fraction`` of the load the forward did not wait for) and
``"machine"``. Times are medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
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
from kvstore.client.hf import HFKVStore, RequestReport  # noqa: E402
from kvstore.client.hf.loading import load_cache  # noqa: E402
from kvstore.kinds import TierKind  # noqa: E402
from kvstore.local.redis_server import RedisServer  # noqa: E402
from kvstore.store.config import StoreConfig  # noqa: E402
from kvstore.tiers.registry import TierConfig  # noqa: E402

GiB = 1 << 30
NEW_TOKENS = 4
TIERS = ("hbm", "dram", "lmdb", "redis", "daemon")
LOAD_REPS = 31  # loads are cheap next to forwards: more reps, steadier medians
# Enough for a median on a machine of its own (the GPU check), where 31 loads of a 32K
# prompt from LMDB or the daemon (4 GiB each) would take most of its time.
QUICK_LOAD_REPS = 7
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
    load_reps: int
    store_bytes: int


def plan(args: argparse.Namespace) -> Plan:
    reps, load_reps = (2, QUICK_LOAD_REPS) if args.quick else (3, LOAD_REPS)
    lengths: tuple[int, ...]
    shape: dict[str, Any]
    if args.device == "cuda":
        lengths = (2048, 8192) if args.quick else (2048, 8192, 32768, 65536)
        shape, dtype, store_bytes = LLAMA_8B_SHAPE, torch.bfloat16, 24 * GiB
    else:
        lengths = (512, 1024) if args.quick else (1024, 2048, 4096)
        shape, dtype, store_bytes = CPU_SHAPE, torch.float32, GiB
    device = torch.device(args.device)
    return Plan(device, shape, dtype, lengths, 256, reps, load_reps, store_bytes)


def build_model(p: Plan) -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=max(p.lengths) + 64, **p.shape)
    with torch.device(p.device):
        model: Any = LlamaForCausalLM(config)
    return model.to(p.dtype).eval()


# -- tiers --------------------------------------------------------------------------


@contextmanager
def tier_clients(
    p: Plan, root: Path, stack: Any, names: Sequence[str] = TIERS
) -> Iterator[Iterator[tuple[str, Any]]]:
    """Yield (tier name, client) pairs of the tiers ``names``, each a fresh store holding
    nothing yet (HBM only on a CUDA device)."""
    root.mkdir(parents=True, exist_ok=True)

    def embedded(*tiers: TierConfig) -> EmbeddedClient:
        return EmbeddedClient(StoreConfig(tiers=tiers, promote_on_hit=False))

    def clients() -> Iterator[tuple[str, Any]]:
        if "hbm" in names and p.device.type == "cuda":
            yield "hbm", embedded(TierConfig(TierKind.HBM, p.store_bytes, device="cuda"))
        if "dram" in names:
            yield "dram", embedded(TierConfig(TierKind.DRAM, p.store_bytes))
        if "lmdb" in names:
            lmdb = TierConfig(TierKind.SSD, 2 * p.store_bytes, path=root / "lmdb", sync=False)
            yield "lmdb", embedded(lmdb)
        if "redis" in names:
            redis = stack.enter_context(RedisServer())
            yield (
                "redis",
                embedded(
                    TierConfig(TierKind.REDIS, p.store_bytes, url=redis.url, socket_timeout_s=30.0)
                ),
            )
        if "daemon" in names:
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


def copy_ceiling(nbytes: int, device: torch.device) -> Callable[[], None]:
    """The raw copy of ``nbytes`` between warm buffers: memcpy on CPU, pinned H2D on CUDA."""
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    source.fill_(1)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.fill_(0)  # fault its pages in now, as the pool's buffers are by the warmup load
    if device.type == "cuda":

        def copy() -> None:
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize(device)

        return copy
    source_array, target_array = source.numpy(), target.numpy()
    return lambda: np.copyto(target_array, source_array)


def measure_load(kv: HFKVStore, ids: torch.Tensor, reps: int) -> dict[str, float]:
    """``load_cache`` of the whole cached prefix against the raw copy of its bytes.

    Interleaved, ``reps`` times each after a warmup, so both see the
    same machine; medians. The load is exactly what ``prefill`` runs before
    its forward (lookup excluded), with the object's buffer pool, and each
    cache is dropped before the next load as a finished request's would be.
    """
    keys = kv.plan(ids)
    limit = int(ids.shape[1]) - 1
    tokens = min(len(keys) * kv.chunk_tokens, limit)
    nbytes = tokens * kv.namespace.layout.bytes_per_token
    parts: dict[str, list[float]] = {"fetch": [], "install": []}

    def load() -> None:
        _, good, timing = load_cache(kv.client, kv.namespace, keys, ids.device, limit, kv.buffers)
        if good != len(keys):
            raise RuntimeError(f"loaded {good} of {len(keys)} chunks")
        parts["fetch"].append(timing.fetch_s)
        parts["install"].append(timing.install_s)

    samples = time_interleaved(
        {"load": Case(run=load), "ceiling": Case(run=copy_ceiling(nbytes, ids.device))},
        reps,
    )
    load_s, ceiling_s = samples["load"].median, samples["ceiling"].median
    return {
        "load_gbps": gbps(nbytes, load_s),
        "ceiling_gbps": gbps(nbytes, ceiling_s),
        "ratio": ceiling_s / load_s,
        # Fastest repetition of each: the cost with no other process on the cores.
        "best_ratio": samples["ceiling"].best / samples["load"].best,
        "fetch_gbps": gbps(nbytes, statistics.median(parts["fetch"][-reps:])),
        "install_gbps": gbps(nbytes, statistics.median(parts["install"][-reps:])),
        "load_mib": nbytes / (1 << 20),
    }


def first_token(logits: torch.Tensor) -> int:
    return int(logits[0, -1].argmax().item())


def measure_tier(
    tier: str, client: Any, model: Any, p: Plan, ids: torch.Tensor, reference: torch.Tensor
) -> tuple[dict[str, Any], dict[str, Any]]:
    kv = HFKVStore(model, client, chunk_tokens=p.chunk_tokens, model_id="bench-llama")
    warm = kv.prefill(ids)
    kv.save(ids, warm.cache)
    del warm
    expected = int(reference[0, ids.shape[1]].item())
    tokens: dict[str, list[int]] = {"recompute": [], "reload": [], "layerwise": []}
    # Reports only: a kept cache would keep its memory from the buffer pool.
    reports: dict[str, list[RequestReport]] = {"reload": [], "layerwise": []}

    def recompute() -> None:
        with torch.no_grad():
            tokens["recompute"].append(first_token(model(ids).logits))

    def reload(layerwise: bool) -> Callable[[], None]:
        name = "layerwise" if layerwise else "reload"

        def run() -> None:
            result = kv.prefill(ids, layerwise=layerwise)
            tokens[name].append(first_token(result.logits))
            reports[name].append(result.report)

        return run

    samples = time_interleaved(
        {
            "recompute": Case(run=recompute),
            "reload": Case(run=reload(False)),
            "layerwise": Case(run=reload(True)),
        },
        p.reps,
    )
    load = measure_load(kv, ids, p.load_reps)
    generated = [
        kv.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, layerwise=lw).sequences
        for lw in (False, True)
    ]
    identical = all(t == expected for path in tokens.values() for t in path) and all(
        torch.equal(g, reference) for g in generated
    )
    # The timing of the timed repetitions only (time_interleaved runs a warmup first).
    reports = {name: runs[-p.reps :] for name, runs in reports.items()}
    recompute_s, reload_s = samples["recompute"].median, samples["reload"].median
    row = {
        "tier": tier,
        "prompt_tokens": int(ids.shape[1]),
        "recompute_s": recompute_s,
        "reload_s": reload_s,
        "speedup": recompute_s / reload_s,
        **load,
        "identical": identical,
    }
    layerwise = reports["layerwise"]
    overlap = {
        "tier": tier,
        "prompt_tokens": int(ids.shape[1]),
        "reload_s": samples["layerwise"].median,
        "load_s": statistics.median(r.timing.load_s for r in layerwise),
        "wait_s": statistics.median(r.timing.wait_s for r in layerwise),
        "hidden_fraction": statistics.median(r.timing.hidden_fraction for r in layerwise),
        "identical": identical,
    }
    return row, overlap


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="shorter prompts, fewer reps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--tiers", default=",".join(TIERS), help=f"a subset of {','.join(TIERS)} (default all)"
    )
    parser.add_argument("--lengths", help="prompt lengths in tokens, e.g. 2048,32768")
    args = parser.parse_args(argv)
    unknown = set(args.tiers.split(",")) - set(TIERS)
    if unknown:
        parser.error(f"unknown tiers {sorted(unknown)}; expected some of {', '.join(TIERS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        log("--device cuda: no CUDA device here; nothing measured")
        raise SystemExit(2)
    p = plan(args)
    if args.lengths:
        p = dataclasses.replace(p, lengths=tuple(int(n) for n in args.lengths.split(",")))
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
            with tier_clients(p, root / str(length), stack, args.tiers.split(",")) as clients:
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
        "ratio",
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
            f"{r['ratio']:.2f}",
            f"{o['reload_s']:.3f}",
            f"{o['hidden_fraction']:.2f}",
            r["identical"],
        ]
        for r, o in zip(rows, overlaps, strict=True)
    ]
    return format_table(headers, body)


if __name__ == "__main__":
    main()
