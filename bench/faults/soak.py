"""Soak: mixed load on a daemon over DRAM + LMDB + Redis for a set time, with a Redis
fault every ``FAULT_EVERY_S`` (paused for a while, or restarted empty), and the
daemon's resources sampled every second.

Three clients (shared memory, bytes over the Unix socket, TCP with a token) put,
look up and get chains at random, each read checked byte for byte against what
was put under that key (a miss is allowed: blocks in Redis vanish with its
restarts). What a leak or a slow drift would show, as the growth between the
end of warm-up (the first fifth) and the end:

* ``rss_growth_mib_per_hour``, ``fds_growth``: the daemon process;
* ``lmdb_growth_mib``: the LMDB file (it only grows while freed pages cannot be
  reused, e.g. behind a stale reader);
* ``stale_readers_max``: LMDB reader slots of dead processes;
* ``p99_drift``: p99 latency of the last tenth of requests over the first tenth
  after warm-up.

``wrong_bytes`` and ``errors_raised`` (an exception that reached a client's
caller) must be zero.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from faults.campaign import (
    CHAIN_CHUNKS,
    CHAIN_LAYOUT,
    DaemonSpec,
    Report,
    Scale,
    chain_chunks,
    chain_tokens,
    open_fds,
    rss_bytes,
    same_bytes,
    tcp_settings,
)
from kvstore import Namespace, connect
from kvstore.keys import chunk_keys
from kvstore.local.redis_server import RedisServer

NAME = "soak"
NAMESPACE = Namespace("soak", CHAIN_LAYOUT)
CHAINS = 600  # distinct chains the load draws from (~75 MiB: DRAM, LMDB and Redis all used)
FAULT_EVERY_S = 10.0
PAUSE_S = 2.0
# The soak runs for this share of its scale's seconds: 30 s short, 15 minutes long, and
# the rest is left for starting, stopping and a slow machine.
SOAK_SHARE = 0.5


@dataclass
class _Load:
    """What the clients did, under ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    written: set[int] = field(default_factory=set)
    latencies: list[float] = field(default_factory=list)
    requests: int = 0
    wrong_bytes: int = 0
    errors_raised: list[str] = field(default_factory=list)


def run(scale: Scale, workdir: Path) -> Report:
    seconds = SOAK_SHARE * scale.seconds
    with RedisServer(workdir / "redis") as redis:
        tcp = tcp_settings()
        spec = DaemonSpec(
            workdir / "daemon",
            tiers=(
                '[tiers.dram]\ncapacity = "24MiB"\n\n[tiers.ssd]\ncapacity = "48MiB"\n\n'
                f'[tiers.redis]\ncapacity = "256MiB"\nurl = "{redis.url}"\n'
                "socket_timeout_s = 0.5\nconnect_timeout_s = 0.5\n"
            ),
            daemon=tcp,
        )
        urls = [
            (spec.url, {"transfer": "shm"}),
            (spec.url, {"transfer": "bytes"}),
            (f"http://{tcp['tcp_host']}:{tcp['tcp_port']}", {"token": tcp["auth_token"]}),
        ]
        load = _Load()
        with spec.process() as daemon:
            stop = threading.Event()
            clients = [
                threading.Thread(target=_client, args=(url, options, load, stop, seed))
                for seed, (url, options) in enumerate(urls)
            ]
            for client in clients:
                client.start()
            samples, faults = _watch(daemon.pid, spec, redis, seconds)
            stop.set()
            for client in clients:
                client.join(timeout=30)
    return Report(NAME, _figures(load, samples, faults, seconds), ("wrong_bytes", "errors_raised"))


def _client(
    url: str, options: dict[str, Any], load: _Load, stop: threading.Event, seed: int
) -> None:
    rng = random.Random(seed)
    with connect(url, timeout_s=2.0, backoff_s=0.1, **options) as store:
        while not stop.is_set():
            chain = rng.randrange(CHAINS)
            tokens = chain_tokens(chain)
            started = time.perf_counter()
            try:
                if rng.random() < 0.3:
                    if store.put(NAMESPACE, tokens, chain_chunks(chain)) == CHAIN_CHUNKS:
                        with load.lock:
                            load.written.add(chain)
                else:
                    store.lookup(NAMESPACE, tokens)
                    got = store.get(NAMESPACE, chunk_keys(NAMESPACE, tokens))
                    wrong = _wrong(got, chain)
                    with load.lock:
                        load.wrong_bytes += wrong
            except Exception as error:  # noqa: BLE001 - nothing may reach the engine
                with load.lock:
                    load.errors_raised.append(f"{type(error).__name__}: {error}")
            with load.lock:
                load.requests += 1
                load.latencies.append(time.perf_counter() - started)


def _wrong(got: list[Any], chain: int) -> int:
    """Chunks read back that differ from what chain ``chain`` holds (misses are fine)."""
    expected = chain_chunks(chain)
    return sum(
        1
        for chunk, tensor in zip(got, expected, strict=True)
        if chunk is not None and not same_bytes(chunk, tensor)
    )


def _watch(
    pid: int, spec: DaemonSpec, redis: RedisServer, seconds: float
) -> tuple[list[dict[str, float]], int]:
    """Sample the daemon every second and fault Redis every ``FAULT_EVERY_S``, for
    ``seconds``; the samples, and how many faults were injected."""
    started = time.monotonic()
    samples: list[dict[str, float]] = []
    faults = 0
    next_fault = started + FAULT_EVERY_S
    lmdb_path = spec.root / "data" / "lmdb"
    while (now := time.monotonic()) - started < seconds:
        if now >= next_fault:
            if faults % 2 == 0:
                redis.pause()
                time.sleep(PAUSE_S)
                redis.resume()
            else:
                redis.stop()
                time.sleep(PAUSE_S)
                redis.start()
            faults += 1
            next_fault = time.monotonic() + FAULT_EVERY_S
        samples.append(
            {
                "t": time.monotonic() - started,
                "rss": rss_bytes(pid),
                "fds": open_fds(pid),
                "lmdb": _file_size(lmdb_path / "data.mdb"),
                "stale_readers": _stale_readers(lmdb_path),
            }
        )
        time.sleep(1.0)
    return samples, faults


def _figures(
    load: _Load, samples: list[dict[str, float]], faults: int, seconds: float
) -> dict[str, Any]:
    warm = samples[len(samples) // 5] if samples else None
    last = samples[-1] if samples else None
    hours = (last["t"] - warm["t"]) / 3600 if warm and last and last["t"] > warm["t"] else 0
    latencies = load.latencies[len(load.latencies) // 5 :]
    tenth = max(1, len(latencies) // 10)
    first = float(np.percentile(latencies[:tenth], 99) * 1000) if latencies else 0.0
    final = float(np.percentile(latencies[-tenth:], 99) * 1000) if latencies else 0.0
    mib = 1 << 20
    return {
        "seconds": round(seconds, 1),
        "requests": load.requests,
        "chains_written": len(load.written),
        "faults_injected": faults,
        "wrong_bytes": load.wrong_bytes,
        "errors_raised": len(load.errors_raised),
        "first_errors": load.errors_raised[:3],
        "rss_start_mib": round(warm["rss"] / mib, 1) if warm else 0,
        "rss_end_mib": round(last["rss"] / mib, 1) if last else 0,
        "rss_growth_mib_per_hour": (
            round((last["rss"] - warm["rss"]) / mib / hours, 1) if warm and last and hours else 0
        ),
        "fds_growth": int(last["fds"] - warm["fds"]) if warm and last else 0,
        "lmdb_growth_mib": round((last["lmdb"] - warm["lmdb"]) / mib, 1) if warm and last else 0,
        "stale_readers_max": int(max((s["stale_readers"] for s in samples), default=0)),
        "p99_first_ms": round(first, 2),
        "p99_last_ms": round(final, 2),
        "p99_drift": round(final / first, 2) if first else 0,
    }


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _stale_readers(path: Path) -> int:
    """LMDB reader slots held by processes that no longer exist."""
    try:
        env = lmdb.open(str(path), readonly=True, lock=True, max_dbs=0)
    except lmdb.Error:
        return 0
    try:
        table = env.readers()
    finally:
        env.close()
    stale = 0
    for line in table.splitlines()[1:]:
        fields = line.split()
        if not fields or not fields[0].isdigit():
            continue
        try:
            os.kill(int(fields[0]), 0)
        except ProcessLookupError:
            stale += 1
        except PermissionError:
            pass
    return stale
