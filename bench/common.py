"""Shared helpers for the benchmarks in ``bench/``: options, chunk sizes, timing, tables,
JSON, server processes, a private Redis.

Every benchmark here follows the same shape::

    with bench_session() as stack:            # SIGTERM -> SystemExit, cleanup on Ctrl-C
        redis = stack.enter_context(RedisServer())
        tmp = stack.enter_context(temp_dir("kvs-bench-"))
        samples = time_interleaved({"store": Case(run=..., before=...),
                                    "raw": Case(run=...)}, reps=5)
        samples["store"].median                 # seconds
    log(format_table(headers, rows))            # human output on stderr
    emit_json({"machine": machine_info(), ...}) # one JSON object on stdout

Conventions:

* Times are medians of ``reps`` repetitions after ``warmup`` untimed ones; a
  repetition's ``before`` and ``after`` hooks (fresh keys, deletes) run
  outside the timed region.
* Alternatives being compared (the store and the raw backend) are timed
  *interleaved*, one repetition of each in turn, so drift on a shared machine
  (page cache, CPU frequency, a neighbour) hits both alike.
* GB/s are decimal (1e9 bytes per second) of payload bytes.
* ``RedisServer`` only ever starts its own ``redis-server`` on a free loopback
  port, persistence off, and stops it on exit (also on Ctrl-C, SIGTERM, or
  via ``atexit`` if the interpreter exits some other way). It never talks to
  a Redis it did not start.
* Every server a benchmark starts (``spawn``) runs in its own session, so a
  Ctrl-C reaches only the benchmark, which stops it (``stop_process``); the
  kernel sends it SIGTERM if the benchmark dies without cleaning up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import numpy as np
import torch

import kvstore
from kvstore.client import StoreClient
from kvstore.keys import ChunkKey, KVLayout, Namespace, chunk_keys
from kvstore.local.processes import spawn, stop_process

# Ports this module must never use: the shared development Redis lives on 6379.


# -- output ------------------------------------------------------------------


def log(*parts: object) -> None:
    """Progress and human output go to stderr, so stdout stays one JSON object."""
    print(*parts, file=sys.stderr, flush=True)


def emit_json(payload: Mapping[str, Any]) -> None:
    """Write ``payload`` as one JSON object on stdout."""
    json.dump(payload, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table; numbers right-aligned, text left-aligned.

    Floats are printed as given by the caller (format them before passing if
    a particular precision matters); ``None`` prints as ``-``.
    """
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [len(header) for header in headers]
    for row in cells:
        for index, text in enumerate(row):
            widths[index] = max(widths[index], len(text))
    numeric = [
        all(isinstance(row[i], int | float) or row[i] is None for row in rows) and bool(rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            value.rjust(widths[i]) if numeric[i] else value.ljust(widths[i])
            for i, value in enumerate(values)
        ).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in cells)])


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def machine_info() -> dict[str, Any]:
    """What a reader needs to compare two runs: CPUs, memory, versions, GPU if any."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "platform": platform.platform(),
        "arch": platform.machine(),
        "python": platform.python_version(),
    }
    for module in ("numpy", "torch", "lmdb", "redis", "hiredis", "xxhash"):
        try:
            imported = __import__(module)
        except ImportError:
            info[module] = None
            continue
        info[module] = getattr(imported, "__version__", getattr(imported, "VERSION", None))
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["cuda"] = None
    if shutil.which("redis-server"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            version = subprocess.run(
                ["redis-server", "--version"], capture_output=True, text=True, timeout=5
            ).stdout
            info["redis_server"] = (
                version.split("v=", 1)[-1].split()[0] if "v=" in version else None
            )
    return info


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _memory_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


MiB = 1 << 20
GiB = 1 << 30
VOCAB = 128_256  # Llama-3's vocabulary, so token ids look like an engine's


@dataclass(frozen=True)
class ChunkSize:
    """A chunk size and the bfloat16 layout that gives exactly that many bytes."""

    label: str
    layout: KVLayout

    @property
    def nbytes(self) -> int:
        return self.layout.chunk_nbytes


# Llama-3.1-8B's KV is 128 KiB per token (32 layers, 8 KV heads of 128, bf16):
# 16 tokens of it are a 2 MiB chunk (vLLM's block), 128 tokens 16 MiB.
CHUNK_2MIB = ChunkSize(
    "2MiB", KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, chunk_tokens=16)
)
CHUNK_16MIB = ChunkSize(
    "16MiB", KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, chunk_tokens=128)
)


def make_chunks(size: ChunkSize, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` CPU bf16 chunks of random KV (``torch.randn``), reproducible by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(size.layout.chunk_shape, generator=generator, dtype=torch.bfloat16)
        for _ in range(count)
    ]


@dataclass(frozen=True)
class Chain:
    """A token sequence and the chunk keys it hashes to (``kvstore.keys.chunk_keys``)."""

    tokens: np.ndarray
    keys: list[ChunkKey]


class KeySpace:
    """Fresh token sequences (hence fresh chunk keys) for every repetition: a put is
    then a real write, never a "chunk already held", and a lookup a first one."""

    def __init__(self, namespace: Namespace, count: int, seed: int) -> None:
        self._namespace = namespace
        self._count = count
        self._rng = np.random.default_rng(seed)

    def fresh(self) -> Chain:
        tokens = self._rng.integers(
            0, VOCAB, size=self._count * self._namespace.chunk_tokens, dtype=np.int64
        )
        return Chain(tokens, chunk_keys(self._namespace, tokens))


def check_chunks(
    label: str, got: Sequence[Any], payloads: Sequence[np.ndarray], full: bool
) -> None:
    """Every chunk came back (a failed call degrades to misses); first and last
    byte for byte when ``full``."""
    missing = sum(chunk is None for chunk in got)
    if missing:
        raise RuntimeError(f"{label}: {missing} of {len(got)} chunks missed")
    if full:
        for index in (0, len(payloads) - 1):
            if bytes(got[index].payload) != payloads[index].tobytes():
                raise RuntimeError(f"{label}: chunk {index} did not round-trip")


def redis_key(namespace: Namespace, key: ChunkKey, prefix: str = "kvs") -> bytes:
    """The key a block has in Redis (the layout of ``tiers/redis_tier.py``)."""
    return f"{prefix}:{namespace.digest.hex()}:".encode() + key


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB"


def verdict(ratio: float, goal: float | None) -> str | None:
    """The goal column of a table: ``ok``/``MISS`` against ``goal`` (``None``: no goal)."""
    if goal is None:
        return None
    return f"{'ok' if ratio >= goal else 'MISS'} (>= {goal})"


def bench_arguments(description: str) -> argparse.ArgumentParser:
    """The options every benchmark takes (``--json``, ``--quick``); add your own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer reps")
    return parser


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


# -- timing ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """Wall-clock seconds of each timed repetition."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repetitions were."""
        return (max(self.seconds) - min(self.seconds)) / self.median if self.median else 0.0


@dataclass(frozen=True)
class BatchThroughput:
    """One op on one batch of chunks: the store's timings against the ceiling's,
    measured in the same run, and the ratio every benchmark reports."""

    op: str
    chunk_bytes: int
    batch_chunks: int
    store: Sample
    ceiling: Sample

    @property
    def batch_bytes(self) -> int:
        return self.chunk_bytes * self.batch_chunks

    @property
    def gbps(self) -> float:
        return gbps(self.batch_bytes, self.store.median)

    @property
    def ceiling_gbps(self) -> float:
        return gbps(self.batch_bytes, self.ceiling.median)

    @property
    def ratio(self) -> float:
        return self.gbps / self.ceiling_gbps


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by nearest rank (of 100 values, p99 is the
    largest but one; of fewer, the largest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _nothing() -> None:
    return None


@dataclass(slots=True)
class Case:
    """One thing to time. ``before``/``after`` run around every repetition, untimed.

    ``before`` may return a value; it is passed to ``run`` and ``after`` (e.g.
    the fresh keys of this repetition). With ``before`` left alone, ``run``
    and ``after`` are called without arguments.
    """

    run: Callable[..., object]
    before: Callable[[], object] | None = None
    after: Callable[..., object] | None = None


def time_interleaved(cases: Mapping[str, Case], reps: int, *, warmup: int = 1) -> dict[str, Sample]:
    """Time every case ``warmup + reps`` times, one repetition of each in turn.

    Returns the timed (non-warmup) samples by case name.
    """
    if reps < 1:
        raise ValueError("reps must be at least 1")
    timings: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(warmup + reps):
        for name, case in cases.items():
            elapsed = _time_once(case)
            if rep >= warmup:
                timings[name].append(elapsed)
    return {name: Sample(tuple(values)) for name, values in timings.items()}


def time_reps(run: Callable[[], object], reps: int, *, warmup: int = 1) -> Sample:
    """Time ``run`` alone; see ``time_interleaved``."""
    return time_interleaved({"run": Case(run=run)}, reps, warmup=warmup)["run"]


def _time_once(case: Case) -> float:
    if case.before is None:
        start = time.perf_counter()
        result = case.run()
        elapsed = time.perf_counter() - start
        del result  # freed outside the timed region
        if case.after is not None:
            case.after()
        return elapsed
    state = case.before()
    start = time.perf_counter()
    result = case.run(state)
    elapsed = time.perf_counter() - start
    del result
    if case.after is not None:
        case.after(state)
    return elapsed


# -- lifecycle ---------------------------------------------------------------


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def bench_session() -> Iterator[contextlib.ExitStack]:
    """An ``ExitStack`` whose resources are released on normal exit, Ctrl-C or SIGTERM.

    SIGTERM is turned into ``SystemExit`` for the duration, so ``finally``
    blocks and context managers run as they do for Ctrl-C (``KeyboardInterrupt``).
    """
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        with contextlib.ExitStack() as stack:
            yield stack
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def temp_dir(prefix: str = "kvs-bench-", base: str | Path | None = None) -> Iterator[Path]:
    """A temporary directory (default: the system temp dir, a real filesystem here),
    removed on exit whatever happens."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- child processes ---------------------------------------------------------


CLIENT_TIMEOUT_S = 60.0  # per I/O phase; generous, a failed call would read as a miss


def store_client(stack: contextlib.ExitStack, url: str, **options: Any) -> StoreClient:
    """``kvstore.connect(url, **options)`` with the benchmarks' timeout, a daemon's client
    (not an embedded store), closed when ``stack`` closes."""
    client = kvstore.connect(url, timeout_s=CLIENT_TIMEOUT_S, **options)
    assert isinstance(client, StoreClient)
    stack.callback(client.close)
    return client


def answers_healthz(socket_path: Path) -> bool:
    """Whether ``GET /healthz`` over the Unix socket answers 200 (raw HTTP, no client)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            sock.connect(str(socket_path))
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: kvstore\r\nConnection: close\r\n\r\n")
            return sock.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


class DaemonStats:
    """A daemon's ``GET /v1/stats`` over its Unix socket, on one connection kept open,
    so it is cheap enough to poll (how far its DRAM arena is prefaulted, what its
    write-through has copied)."""

    def __init__(self, socket_path: Path, timeout_s: float = 10.0) -> None:
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(socket_path)),
            base_url="http://kvstore",
            timeout=timeout_s,
        )

    def get(self) -> dict[str, Any]:
        response = self._http.get("/v1/stats")
        response.raise_for_status()
        body = response.json()
        assert isinstance(body, dict)
        return body

    def tier(self, label: str) -> dict[str, Any]:
        """The counters of one tier (``kvstore.store.stats.TierCounters``)."""
        counters = self.get()["store"]["tiers"][label]
        assert isinstance(counters, dict)
        return counters

    def wait_prefaulted(self, timeout_s: float = 120.0) -> None:
        """Wait until the daemon has populated its DRAM arena (``tiers.prefault``), so
        that nothing is timed against first-touch page faults or the thread making them."""
        deadline = time.monotonic() + timeout_s
        while not self.get()["daemon"]["dram_prefault"]["done"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the DRAM arena was not prefaulted in {timeout_s:.0f} s")
            time.sleep(0.1)

    def close(self) -> None:
        self._http.close()


class ServerProcess:
    """A server subprocess that answers ``/healthz`` on a Unix socket once it is up.

    A context manager: started on entry, stopped (SIGTERM, then SIGKILL) on
    exit, whatever happened in between.
    """

    def __init__(self, name: str, argv: Sequence[str], socket_path: Path, log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.socket_path = socket_path
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return int(self.proc.pid)

    def __enter__(self) -> ServerProcess:
        # The daemon reads KVSTORE_* variables; none of the caller's may leak in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        self.proc = spawn(self.argv, self.log_path, env=env, new_session=True)
        deadline = time.monotonic() + 60.0
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited while starting:\n{self.log_tail()}")
                if answers_healthz(self.socket_path):
                    return self
                time.sleep(0.05)
            raise RuntimeError(f"{self.name} did not answer /healthz:\n{self.log_tail()}")
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *_exc: object) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, timeout_s=20.0)

    def log_tail(self, nbytes: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")
        return ""


def dram_daemon(root: Path, capacity: str, predictor: str) -> tuple[ServerProcess, Path]:
    """A ``kvstore serve`` of one prefaulted DRAM tier of ``capacity`` on a Unix socket
    under ``root``, its ``[predictor]`` table ``predictor`` (TOML lines); enter the
    process to start it. Returns it and its socket's path."""
    socket_path = root / "kvstore.sock"
    config = root / "kvstore.toml"
    config.write_text(
        f'data_dir = "{root / "data"}"\n\n'
        f'[tiers.dram]\ncapacity = "{capacity}"\nprefault = true\n\n'
        f'[daemon]\nsocket_path = "{socket_path}"\nlog_level = "warning"\n\n'
        f"[predictor]\n{predictor}\n"
    )
    argv = [sys.executable, "-m", "kvstore", "serve", "--config", str(config)]
    return ServerProcess("kvstore serve", argv, socket_path, root / "daemon.log"), socket_path
