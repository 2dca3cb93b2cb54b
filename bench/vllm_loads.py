#!/usr/bin/env python3
"""Loads into vLLM's KV cache on CPU through kvstore's connector, against memcpy.

A returning request's KV comes back from the daemon's shared-memory DRAM arena
into vLLM's paged cache: one page per layer per block, each layer's pages in a
tensor of its own (vLLM-CPU's layout). This times ``client.vllm.worker``'s
load of one request's blocks, as vLLM's worker calls it, against a real
``kvstore serve`` daemon (DRAM, predictor off: nothing else runs) and against
the ceiling of that load, measured in the same run::

    memcpy          one copy of the load's bytes, host buffer to host buffer
    in place        the worker's load as shipped: each block copied once, from
                    the arena into its pages (``CachePages.destinations``),
                    checked FAST (the extent's generation, on x86-64)
    in place, full  the same with every block checksummed as it is copied
                    (``verify="full"``)
    staged          the path a device's cache takes, and CPU's before: every
                    block into a staging buffer, then scattered into the pages
                    (two copies)

Cases run interleaved, repetition by repetition, on two page shapes: the
serving benchmark's model (8 layers, 2 KV heads of 128, bf16, 32-token
blocks: 256 KiB a block) and Llama-3.1-8B's (32 layers, 8 KV heads of 128,
bf16, 16-token blocks: 2 MiB a block). Ratios: each case's GB/s against
memcpy's, and its time against staged's. Every load is checked bit for bit
against the pages that were saved.

    python bench/vllm_loads.py            # table on stderr
    python bench/vllm_loads.py --json     # one JSON object on stdout
    python bench/vllm_loads.py --quick    # smaller loads, fewer reps (< 1 min)
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from common import (
    CLIENT_TIMEOUT_S,
    Case,
    DaemonStats,
    Sample,
    bench_arguments,
    bench_session,
    dram_daemon,
    emit_json,
    format_table,
    gbps,
    log,
    machine_info,
    temp_dir,
    time_interleaved,
)

import kvstore
from kvstore.client.connect import KVClient
from kvstore.client.vllm.pages import BlockTransfer, PageFormat
from kvstore.client.vllm.worker import WorkerSide

SHAPES = {
    "bench model": PageFormat(
        model="bench-loads@main",
        layer_names=tuple(f"layers.{i}.attn" for i in range(8)),
        num_kv_heads=2,
        head_size=128,
        dtype="bfloat16",
        block_size=32,
    ),
    "Llama-3.1-8B": PageFormat(
        model="bench-loads-llama@main",
        layer_names=tuple(f"layers.{i}.attn" for i in range(32)),
        num_kv_heads=8,
        head_size=128,
        dtype="bfloat16",
        block_size=16,
    ),
}
BATCH_BLOCKS = 32  # the connector's default batch_blocks


@dataclass
class Shape:
    """One page shape's caches, workers and request, ready to time."""

    pages: PageFormat
    blocks: int
    source: dict[str, torch.Tensor]
    target: dict[str, torch.Tensor]
    loaders: dict[str, WorkerSide]
    hashes: tuple[bytes, ...]
    store: KVClient  # the loaders' FAST client

    @property
    def load_bytes(self) -> int:
        return self.blocks * self.pages.block_bytes

    def transfer(self) -> BlockTransfer:
        """The request's load: its blocks into the second half of the cache."""
        block_ids = tuple(range(self.blocks, 2 * self.blocks))
        return BlockTransfer("load", None, 0, self.hashes, block_ids)

    def check(self) -> None:
        """The loaded pages are the saved ones, bit for bit (as integers: random bits
        make NaNs, which never equal themselves)."""
        for name in self.pages.layer_names:
            loaded = self.target[name][self.blocks :].view(torch.int16)
            if not torch.equal(loaded, self.source[name][: self.blocks].view(torch.int16)):
                raise AssertionError(f"layer {name} did not load back bit for bit")


def cache(pages: PageFormat, blocks: int, seed: int) -> dict[str, torch.Tensor]:
    """vLLM-CPU's cache of ``blocks`` blocks: per layer ``[B, H, N, C]`` views of one
    allocation, layer after layer (its LBHNC layout)."""
    page = pages.page_elements
    memory = torch.empty(pages.num_layers * blocks * page, dtype=pages.torch_dtype)
    memory.view(torch.int16).random_(generator=torch.Generator().manual_seed(seed))
    shape = (blocks, pages.num_kv_heads, pages.block_size, pages.state_size)
    return {
        name: memory[layer * blocks * page : (layer + 1) * blocks * page].view(shape)
        for layer, name in enumerate(pages.layer_names)
    }


def prepare(
    stack: ExitStack, name: str, pages: PageFormat, load_mib: int, stores: dict[str, KVClient]
) -> Shape:
    """Save one request's blocks through a worker side and wait until they are stored."""
    blocks = max(1, (load_mib << 20) // pages.block_bytes)
    source, target = cache(pages, 2 * blocks, seed=1), cache(pages, 2 * blocks, seed=2)
    hashes = tuple(hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(blocks))
    saver = WorkerSide(stores["fast"], [pages], BATCH_BLOCKS)
    saver.register(source)
    stack.callback(saver.close)
    saver.save([BlockTransfer("save", None, 0, hashes, tuple(range(blocks)))])
    deadline = time.monotonic() + 120.0
    while not saver.finished({"save"}).saved:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: the saves were not out in 120 s")
        time.sleep(0.01)
    if saver.saves.counts.saved != blocks:
        raise RuntimeError(f"{name}: {saver.saves.counts.saved} of {blocks} blocks were saved")
    loaders = {}
    for verify, store in stores.items():
        loader = WorkerSide(store, [pages], BATCH_BLOCKS)
        loader.register(target)
        stack.callback(loader.close)
        loaders[verify] = loader
    return Shape(pages, blocks, source, target, loaders, hashes, stores["fast"])


def staged_load(shape: Shape, staging: torch.Tensor) -> None:
    """Every block into staging, then scattered into its pages: two copies."""
    loader = shape.loaders["fast"]
    transfer = shape.transfer()
    keys = shape.pages.keys(None, transfer.hashes)
    namespace = shape.pages.namespace(None)
    for start in range(0, len(keys), BATCH_BLOCKS):
        stop = min(len(keys), start + BATCH_BLOCKS)
        chunks = shape.store.get(namespace, keys[start:stop], out=list(staging[: stop - start]))
        if any(chunk is None for chunk in chunks):
            raise AssertionError("a staged load missed")
        loader.caches[0].scatter(staging, range(stop - start), transfer.block_ids[start:stop])


def in_place_load(shape: Shape, verify: str) -> None:
    loader = shape.loaders[verify]
    loader.load([shape.transfer()])
    if loader.take_failed_blocks():
        raise AssertionError(f"an in-place load ({verify}) missed")


def cases(shape: Shape) -> dict[str, Case]:
    staging = shape.loaders["fast"].caches[0].staging(BATCH_BLOCKS)
    source = np.ones(shape.load_bytes, dtype=np.uint8)
    target = np.empty_like(source)
    return {
        "memcpy": Case(run=lambda: np.copyto(target, source)),
        "in place": Case(run=lambda: in_place_load(shape, "fast"), after=shape.check),
        "in place, full": Case(run=lambda: in_place_load(shape, "full"), after=shape.check),
        "staged": Case(run=lambda: staged_load(shape, staging), after=shape.check),
    }


def summary(samples: dict[str, Sample], load_bytes: int) -> dict[str, dict[str, Any]]:
    ceiling, staged = samples["memcpy"].median, samples["staged"].median
    return {
        case: {
            "ms_p50": 1e3 * sample.median,
            "spread": sample.spread,
            "gbps": gbps(load_bytes, sample.median),
            "vs_memcpy": ceiling / sample.median,
            "vs_staged": staged / sample.median,
        }
        for case, sample in samples.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--load-mib", type=int, help="KV per load (default 128, quick 32)")
    parser.add_argument("--reps", type=int, help="timed repetitions (default 15, quick 5)")
    args = parser.parse_args(argv)
    load_mib = args.load_mib or (32 if args.quick else 128)
    reps = args.reps or (5 if args.quick else 15)
    results: dict[str, Any] = {}
    with bench_session() as stack:
        root = stack.enter_context(temp_dir("kvs-loads-"))
        capacity = f"{len(SHAPES) * load_mib + 256}MiB"
        process, socket_path = dram_daemon(root, capacity, predictor="enabled = false")
        stack.enter_context(process)
        stats = DaemonStats(socket_path)
        stats.wait_prefaulted(120.0)
        stats.close()
        stores = {}
        for verify in ("fast", "full"):
            store = kvstore.connect(
                f"unix://{socket_path}", timeout_s=CLIENT_TIMEOUT_S, verify=verify
            )
            stack.callback(store.close)
            stores[verify] = store
        for name, pages in SHAPES.items():
            shape = prepare(stack, name, pages, load_mib, stores)
            log(f"{name}: {shape.blocks} blocks of {pages.block_bytes >> 10} KiB, {reps} reps")
            samples = time_interleaved(cases(shape), reps)
            results[name] = {
                "blocks": shape.blocks,
                "block_bytes": pages.block_bytes,
                "page_bytes": pages.page_bytes,
                "cases": summary(samples, shape.load_bytes),
            }
    rows = [
        [name, case, f["ms_p50"], f["gbps"], f["vs_memcpy"], f["vs_staged"], f["spread"]]
        for name, shape_results in results.items()
        for case, f in shape_results["cases"].items()
    ]
    log(format_table(["pages", "case", "ms p50", "GB/s", "x memcpy", "x staged", "spread"], rows))
    if args.json:
        settings = {"load_mib": load_mib, "reps": reps, "batch_blocks": BATCH_BLOCKS}
        emit_json({"machine": machine_info(), "settings": settings, "shapes": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
