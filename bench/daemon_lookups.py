"""Lookups per second through a real daemon: the lookup row of ``bench/daemon.py``.

``LOOKUP_CLIENTS`` threads, each with its own ``StoreClient`` over the Unix
socket, look up the same cached 32K-token prefix (256-token chunks: 128
keys), passing token ids, so the client hashes them as an engine's lookup
would. The payload size does not matter to a lookup, so the chunks are tiny.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from common import CLIENT_TIMEOUT_S, VOCAB, percentile

import kvstore
from kvstore.client import StoreClient
from kvstore.keys import KVLayout, Namespace, chunk_keys

# The payload size does not matter to a lookup, so the chunks are tiny (8 KiB).
LOOKUP_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=256)
LOOKUP_TOKENS = 32_768
LOOKUP_CLIENTS = 8


@dataclass
class LookupResult:
    lookups: int
    seconds: float
    latencies_s: list[float]
    client_cpu_s: float
    daemon_cpu_s: float

    @property
    def per_s(self) -> float:
        return self.lookups / self.seconds

    def percentile_ms(self, q: float) -> float:
        return 1e3 * percentile(self.latencies_s, q)


def measure_lookups(url: str, daemon_pid: int, seconds: float) -> LookupResult:
    """``LOOKUP_CLIENTS`` threads, each with its own ``StoreClient``, looking up the
    same cached 32K-token prefix (token ids: the client hashes them) for ``seconds``."""
    namespace = Namespace("bench-daemon-lookup", LOOKUP_LAYOUT)
    tokens = np.random.default_rng(99).integers(0, VOCAB, size=LOOKUP_TOKENS, dtype=np.int64)
    want = LOOKUP_TOKENS // LOOKUP_LAYOUT.chunk_tokens
    chunks = torch.randn((want, *LOOKUP_LAYOUT.chunk_shape), dtype=torch.bfloat16)
    clients: list[StoreClient] = []
    threads: list[threading.Thread] = []
    stop = threading.Event()
    barrier = threading.Barrier(LOOKUP_CLIENTS + 1)
    try:
        for _ in range(LOOKUP_CLIENTS):
            client = kvstore.connect(url, transfer="bytes", timeout_s=CLIENT_TIMEOUT_S)
            assert isinstance(client, StoreClient)
            clients.append(client)
        if clients[0].put(namespace, tokens, list(chunks)) != want:
            raise RuntimeError("lookup prefix: not every chunk was stored")
        for client in clients:  # registers the namespace, opens the connection
            if client.lookup(namespace, tokens).num_chunks != want:
                raise RuntimeError("lookup prefix: not every chunk is cached")
        latencies: list[list[float]] = [[] for _ in clients]
        failures: list[str] = []

        def loop(client: StoreClient, mine: list[float]) -> None:
            try:
                barrier.wait()
            except threading.BrokenBarrierError:  # the main thread gave up
                return
            while not stop.is_set():
                start = time.perf_counter()
                found = client.lookup(namespace, tokens).num_chunks
                mine.append(time.perf_counter() - start)
                if found != want:
                    failures.append(f"a lookup found {found} of {want} chunks")
                    return

        threads = [
            threading.Thread(target=loop, args=(client, mine), daemon=True)
            for client, mine in zip(clients, latencies, strict=True)
        ]
        for thread in threads:
            thread.start()
        barrier.wait(timeout=60.0)
        cpu0, daemon0, start = time.process_time(), _cpu_seconds(daemon_pid), time.perf_counter()
        time.sleep(seconds)
        stop.set()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu0
        daemon_cpu = _cpu_seconds(daemon_pid) - daemon0
        if failures:
            raise RuntimeError(failures[0])
        if any(client.client_stats().lookups_failed for client in clients):
            raise RuntimeError("a lookup failed (degraded to 'nothing cached')")
        everything = [value for mine in latencies for value in mine]
        clients[0].delete(namespace, chunk_keys(namespace, tokens))
        return LookupResult(len(everything), elapsed, everything, cpu, daemon_cpu)
    finally:
        stop.set()  # also on Ctrl-C: no thread may be mid-call when its client closes
        barrier.abort()
        for thread in threads:
            thread.join(timeout=CLIENT_TIMEOUT_S)
        for client in clients:
            client.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
