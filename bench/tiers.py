#!/usr/bin/env python3
"""Put and get throughput of every tier through the real ``TieredStore``, against the raw backend.

For each chunk size (256 KiB, 2 MiB, 16 MiB of bfloat16 K/V) and each tier, a
``TieredStore`` configured with that tier *alone* (so every put and get hits
it) stores and reads back a batch of chunks, one ``put``/``get`` call per
batch, as an engine saving or loading a prefix would. The same bytes are moved
in the same run by the backend with nothing of the store around it, which
gives the ceiling the store is measured against:

    tier   store path                               raw ceiling
    -----  ---------------------------------------  -----------------------------------------
    hbm    HBMTier on cuda (only with a GPU)        pinned host <-> device torch copy (DMA)
    dram   DRAMTier (shared-memory arena)           np.copyto into a preallocated buffer
    ssd    LMDBTier in a temp dir, sync=True        py-lmdb, one write txn per batch, same
                                                    flags; txn.get returning bytes
    redis  RedisTier on a private redis-server      redis-py (hiredis) pipelined SET / GET,
                                                    same server, same client settings

Gets are measured twice: ``get`` (the store allocates each chunk's buffer)
and ``get_into`` (``get(..., out=)``: the store copies into the caller's own,
already allocated buffers, as an engine loading into its KV cache does). The
ceiling of ``get_into`` reads into preallocated buffers too: memcpy for DRAM,
py-lmdb zero-copy views copied out for LMDB, redis-py GET then a copy for Redis.

Puts write a fresh key space every repetition (the previous repetition's keys
are deleted, untimed), so a put is a real write, never a "chunk already held".
Gets read the last repetition's chunks, which are really stored. GB/s are
decimal, of KV payload bytes (the 128-byte block header is the store's own
overhead and not counted); times are medians, store and raw interleaved.

It also measures prefix hashing: ``kvstore.keys.chunk_keys`` over ~4M token
ids, default namespace (xxh3-128, 256-token chunks), and the same with sha256.

    python bench/tiers.py            # table on stdout
    python bench/tiers.py --json     # one JSON object on stdout, table on stderr
    python bench/tiers.py --quick    # smaller batches, fewer repetitions (< 1 min)
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ceilings import RawBackend, RawDRAM, RawHBM, RawLMDB, RawRedis  # noqa: E402
from common import (  # noqa: E402
    VOCAB,
    BatchThroughput,
    Case,
    Chain,
    ChunkSize,
    KeySpace,
    MiB,
    bench_session,
    check_chunks,
    emit_json,
    format_table,
    log,
    machine_info,
    make_chunks,
    size_label,
    temp_dir,
    time_interleaved,
    time_reps,
)

from kvstore.block import HEADER_BYTES  # noqa: E402
from kvstore.keys import ChunkKey, HashAlgo, KVLayout, Namespace, chunk_keys  # noqa: E402
from kvstore.kinds import TierKind  # noqa: E402
from kvstore.local.redis_server import RedisServer  # noqa: E402
from kvstore.store.config import StoreConfig  # noqa: E402
from kvstore.store.tiered_store import TieredStore  # noqa: E402
from kvstore.tiers.registry import TierConfig  # noqa: E402

SIZES = (
    ChunkSize("256KiB", KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, chunk_tokens=16)),
    ChunkSize("2MiB", KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, chunk_tokens=16)),
    ChunkSize("16MiB", KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, chunk_tokens=128)),
)
assert [size.nbytes for size in SIZES] == [256 * 1024, 2 * MiB, 16 * MiB]

# Goals from the issue: store/raw get ratio at 2 MiB chunks.
GET_GOALS = {"dram": 0.8, "ssd": 0.6, "redis": 0.8}
GOAL_CHUNK_BYTES = 2 * MiB

HASH_TOKENS = 1 << 22  # ~4M token ids


@dataclass(frozen=True)
class Settings:
    batch_bytes: int
    reps: int
    warmup: int
    hash_reps: int

    def batch_chunks(self, size: ChunkSize) -> int:
        return max(2, self.batch_bytes // size.nbytes)


FULL = Settings(batch_bytes=128 * MiB, reps=9, warmup=1, hash_reps=7)
QUICK = Settings(batch_bytes=32 * MiB, reps=5, warmup=1, hash_reps=3)


@dataclass(frozen=True, kw_only=True)
class Result(BatchThroughput):
    """A ``BatchThroughput`` of one tier; its ceiling is the raw backend."""

    tier: str

    @property
    def goal(self) -> float | None:
        if self.op == "get" and self.chunk_bytes == GOAL_CHUNK_BYTES:
            return GET_GOALS.get(self.tier)
        return None

    def as_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "op": self.op,
            "chunk_bytes": self.chunk_bytes,
            "gbps": round(self.gbps, 4),
            "raw_gbps": round(self.ceiling_gbps, 4),
            "ratio": round(self.ratio, 4),
        }


# -- the tiers under test ------------------------------------------------------


@dataclass
class TierUnderTest:
    name: str
    store: TieredStore
    raw: RawBackend


def open_tiers(
    wanted: Sequence[str], settings: Settings, stack: Any, tmp: Path
) -> tuple[list[TierUnderTest], list[str]]:
    """Open each wanted tier (store + raw backend); return them and notes on skipped ones."""
    notes: list[str] = []
    # Room for two batches (the last repetition's and the current one) plus headers.
    largest = max(settings.batch_chunks(size) * (size.nbytes + HEADER_BYTES) for size in SIZES)
    capacity = 3 * largest
    opened: list[TierUnderTest] = []

    def store_of(tier: TierConfig) -> TieredStore:
        config = StoreConfig(tiers=(tier,), promote_on_hit=False, data_dir=tmp)
        return stack.enter_context(TieredStore(config))

    for name in wanted:
        if name == "hbm":
            if not torch.cuda.is_available():
                notes.append("hbm: skipped, no CUDA device (an HBM tier on cpu is not a real tier)")
                continue
            tier = TierConfig(TierKind.HBM, capacity_bytes=capacity, device="cuda")
            raw: RawBackend = RawHBM("cuda")
        elif name == "dram":
            tier = TierConfig(TierKind.DRAM, capacity_bytes=capacity)
            raw = RawDRAM()
        elif name == "ssd":
            from kvstore.tiers.lmdb_tier import default_map_size

            tier = TierConfig(TierKind.SSD, capacity_bytes=capacity, path=tmp / "store-lmdb")
            raw = RawLMDB(tmp / "raw-lmdb", default_map_size(capacity), sync=tier.sync)
        elif name == "redis":
            try:
                server = stack.enter_context(RedisServer())
            except RuntimeError as error:
                notes.append(f"redis: skipped ({error})")
                continue
            tier = TierConfig(TierKind.REDIS, capacity_bytes=capacity, url=server.url)
            raw = RawRedis(server.url, tier)
        else:
            raise SystemExit(f"unknown tier {name!r}; expected hbm, dram, ssd or redis")
        stack.callback(raw.close)
        opened.append(TierUnderTest(name, store_of(tier), raw))
    return opened, notes


# -- measurement ---------------------------------------------------------------


def raw_keys(namespace: Namespace, keys: Sequence[ChunkKey]) -> list[bytes]:
    # 32-byte keys, as the LMDB tier uses (namespace digest + chunk key).
    return [namespace.digest + key for key in keys]


def measure_tier(
    tut: TierUnderTest,
    size: ChunkSize,
    chunks: list[torch.Tensor],
    payloads: list[np.ndarray],
    settings: Settings,
    seed: int,
) -> list[Result]:
    """Put then get throughput of one tier at one chunk size, store and raw."""
    store, raw = tut.store, tut.raw
    namespace = Namespace(f"bench-{size.label}", size.layout)
    count = len(chunks)
    raw.load(payloads)
    space = KeySpace(namespace, count, seed)
    held: dict[str, list[Any]] = {"store": [], "raw": []}

    def store_put(state: Chain) -> None:
        stored = store.put(namespace, state.tokens, chunks)
        if stored != count:
            raise RuntimeError(f"{tut.name}: stored {stored} of {count} chunks (capacity?)")

    def store_after(state: Chain) -> None:
        if held["store"]:
            store.delete(namespace, held["store"])
        held["store"] = state.keys

    def raw_before() -> list[bytes]:
        return raw_keys(namespace, space.fresh().keys)

    def raw_after(keys: list[bytes]) -> None:
        if held["raw"]:
            raw.delete(held["raw"])
        held["raw"] = keys

    puts = time_interleaved(
        {
            "store": Case(run=store_put, before=space.fresh, after=store_after),
            "raw": Case(run=raw.put, before=raw_before, after=raw_after),
        },
        settings.reps,
        warmup=settings.warmup,
    )

    store_keys, raw_held = held["store"], held["raw"]
    misses_before = store.stats().get_misses
    check_chunks(tut.name, store.get(namespace, store_keys), payloads, full=True)
    if any(value is None for value in raw.get(raw_held)):
        raise RuntimeError(f"{tut.name}: the raw backend lost a value")
    gets = time_interleaved(
        {
            "store": Case(run=lambda: store.get(namespace, store_keys)),
            "raw": Case(run=lambda: raw.get(raw_held)),
        },
        settings.reps,
        warmup=settings.warmup,
    )
    # get(..., out=): into the caller's own (already touched) buffers, as an
    # engine loading into its KV cache does; the ceiling reads into buffers too.
    outs = [torch.zeros_like(chunk) for chunk in chunks]
    raw_outs = [np.zeros(p.nbytes, dtype=np.uint8) for p in payloads]
    check_chunks(tut.name, store.get(namespace, store_keys, out=outs), payloads, full=True)
    gets_into = time_interleaved(
        {
            "store": Case(run=lambda: store.get(namespace, store_keys, out=outs)),
            "raw": Case(run=lambda: raw.get_into(raw_held, raw_outs)),
        },
        settings.reps,
        warmup=settings.warmup,
    )
    store.delete(namespace, store_keys)
    raw.delete(raw_held)
    misses = store.stats().get_misses - misses_before
    if misses:
        raise RuntimeError(f"{tut.name}: {misses} timed gets missed")
    timed = {"put": puts, "get": gets, "get_into": gets_into}
    return [
        Result(
            tier=tut.name,
            op=op,
            chunk_bytes=size.nbytes,
            batch_chunks=count,
            store=samples["store"],
            ceiling=samples["raw"],
        )
        for op, samples in timed.items()
    ]


def measure_hashing(reps: int) -> dict[str, Any]:
    """Tokens/s of ``chunk_keys`` on ~4M token ids, one thread, per algorithm and dtype."""
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128)  # chunk_tokens=256
    rng = np.random.default_rng(7)
    tokens64 = rng.integers(0, VOCAB, size=HASH_TOKENS, dtype=np.int64)
    tokens32 = tokens64.astype(np.int32)
    out: dict[str, Any] = {"tokens": HASH_TOKENS, "chunk_tokens": layout.chunk_tokens}
    for algo in (HashAlgo.XXH3_128, HashAlgo.SHA256):
        namespace = Namespace("bench-hash", layout, hash_algo=algo)
        for label, tokens in (("int64", tokens64), ("int32", tokens32)):
            sample = time_reps(functools.partial(chunk_keys, namespace, tokens), reps, warmup=1)
            out[f"{algo.value}_{label}_tokens_per_s"] = HASH_TOKENS / sample.median
    return out


# -- output ----------------------------------------------------------------------


def table(results: list[Result]) -> str:
    rows = []
    for r in results:
        verdict = None
        if r.goal is not None:
            verdict = f"{'ok' if r.ratio >= r.goal else 'MISS'} (>= {r.goal})"
        rows.append(
            [
                r.tier,
                r.op,
                size_label(r.chunk_bytes),
                r.batch_chunks,
                f"{r.gbps:.2f}",
                f"{r.ceiling_gbps:.2f}",
                f"{r.ratio:.3f}",
                f"{r.store.spread:.0%}/{r.ceiling.spread:.0%}",
                verdict,
            ]
        )
    return format_table(
        ["tier", "op", "chunk", "batch", "store GB/s", "raw GB/s", "ratio", "spread", "goal"],
        rows,
    )


NOTES = [
    "GB/s: decimal, KV payload bytes per second (128-byte block headers not counted), "
    "median of the timed repetitions; store and raw interleaved; spread = (max-min)/median.",
    "Each tier runs in a TieredStore configured with that tier alone; chunks are CPU bf16 "
    "tensors (torch.randn); one put/get call per batch of chunks.",
    "ssd (LMDB, sync=True): puts pay an fsync per batch commit, on both sides. Gets are served "
    "from the OS page cache (the data was just written), so they run at memory speed, not disk "
    "speed; store and raw read the same cache.",
    "dram raw: np.copyto into preallocated, already-touched buffers (one thread); the store "
    "allocates a fresh buffer per chunk read.",
    "redis raw: redis-py + hiredis pipelined SET/GET of bytes prepared in advance, against the "
    "same private redis-server (loopback), same client settings as the tier.",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer reps")
    parser.add_argument(
        "--tiers", default="hbm,dram,ssd,redis", help="comma-separated subset to run"
    )
    parser.add_argument(
        "--tmpdir", default=None, help="where LMDB files go (default: the system temp dir)"
    )
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    out: Callable[..., None] = log if args.json else print
    started = time.perf_counter()

    results: list[Result] = []
    with bench_session() as stack:
        tmp = stack.enter_context(temp_dir("kvs-bench-tiers-", args.tmpdir))
        tiers, notes = open_tiers(args.tiers.split(","), settings, stack, tmp)
        for size_index, size in enumerate(SIZES):
            count = settings.batch_chunks(size)
            chunks = make_chunks(size, count, seed=size_index)
            payloads = [chunk.view(torch.uint8).reshape(-1).numpy() for chunk in chunks]
            for tier_index, tut in enumerate(tiers):
                log(f"  {tut.name:5} {size_label(size.nbytes):>7} x {count} ...")
                results.extend(
                    measure_tier(
                        tut, size, chunks, payloads, settings, seed=1000 * size_index + tier_index
                    )
                )
    log("  hashing ...")
    hashing = measure_hashing(settings.hash_reps)
    elapsed = time.perf_counter() - started

    mode = "quick" if args.quick else "full"
    out(table(results))
    out()
    out(
        f"hash (chunk_keys, {HASH_TOKENS} tokens, chunk_tokens=256, one thread): "
        f"xxh3_128 {hashing['xxh3_128_int64_tokens_per_s'] / 1e6:.1f}M tok/s "
        f"(int32 ids {hashing['xxh3_128_int32_tokens_per_s'] / 1e6:.1f}M), "
        f"sha256 {hashing['sha256_int64_tokens_per_s'] / 1e6:.1f}M tok/s "
        f"(int32 ids {hashing['sha256_int32_tokens_per_s'] / 1e6:.1f}M)"
    )
    for note in [*notes, *NOTES]:
        out(f"* {note}")
    out(
        f"{mode} run: batches of ~{settings.batch_bytes // MiB} MiB, "
        f"{settings.warmup} warmup + {settings.reps} timed reps; {elapsed:.1f} s"
    )
    if args.json:
        emit_json(
            {
                "machine": machine_info(),
                "config": {
                    "mode": mode,
                    "batch_bytes": settings.batch_bytes,
                    "batch_chunks": {str(s.nbytes): settings.batch_chunks(s) for s in SIZES},
                    "reps": settings.reps,
                    "warmup": settings.warmup,
                    "tiers": [tut.name for tut in tiers],
                    "get_goals_at_2MiB": GET_GOALS,
                },
                "results": [r.as_json() for r in results],
                "hash_tokens_per_s": round(hashing["xxh3_128_int64_tokens_per_s"]),
                "hash_sha256_tokens_per_s": round(hashing["sha256_int64_tokens_per_s"]),
                "hash": {k: round(v) if isinstance(v, float) else v for k, v in hashing.items()},
                "notes": [*notes, *NOTES],
                "elapsed_s": round(elapsed, 1),
            }
        )


if __name__ == "__main__":
    main()
