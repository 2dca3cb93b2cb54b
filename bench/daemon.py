#!/usr/bin/env python3
"""Put and get throughput through a real ``kvstore serve`` daemon, against bare ceilings.

A daemon is started as an operator would (``python -m kvstore serve --config
FILE``: DRAM 1.5 GiB, LMDB in a temp dir, Unix socket, TCP on a free loopback
port with a random token) and driven by ``kvstore.connect`` clients, one
``put``/``get`` call per batch of chunks (2 MiB and 16 MiB chunks of bfloat16
K/V). Each path is measured against the best the same transport does with
nothing of kvstore around it, timed interleaved in the same run:

    path  client                                 ceiling
    ----  -------------------------------------  ------------------------------------------
    shm   connect("unix://...", transfer="shm")  np.copyto of the same bytes into
          (gets: lease, copy out of the mapped   preallocated, touched buffers (one thread)
          arena, verify, release)
    unix  connect("unix://...", transfer=        a bare aiohttp app (its own process) over
          "bytes"): frames over the Unix socket  a Unix socket, fetched by httpx with the
                                                 client's own transport and settings
    tcp   connect("http://127.0.0.1:PORT",       the same bare app over loopback TCP, same
          token=..., transfer="bytes")           httpx settings, the same bearer header

The bare app answers a get with a body of the same size, written in pieces
of one chunk (as the daemon writes one block at a time), from distinct,
touched memory; the client reads it and throws it away. A bare put sends
the chunks' own buffers with a ``Content-Length`` to a handler that reads
and discards them, as views of at most 1 MiB: httpcore re-slices the unsent
rest of a piece (a copy) after every partial ``send``, which makes a whole
multi-MiB piece quadratic on a Unix socket's ~200 KiB send buffer, and the
ceiling is the transport used well.

Gets are measured twice: ``get`` (the client allocates each chunk) and
``get_into`` (``get(..., out=)`` into the caller's preallocated tensors); both
have the same ceiling. A put has no shared-memory path (it always travels
over the socket), so there is no ``shm`` put row. Every put writes fresh keys
(the previous repetition's are deleted, untimed), so it is a real write.

It also measures lookups per second of a 32K-token prefix (256-token chunks:
128 keys, all cached) from 8 threads, each with its own ``StoreClient`` over
the Unix socket, passing token ids (the client hashes them, as an engine's
lookup would).

    python bench/daemon.py            # table on stdout
    python bench/daemon.py --json     # one JSON object on stdout, table on stderr
    python bench/daemon.py --quick    # smaller batches, fewer repetitions (< 1 min)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ceilings import RawDRAM  # noqa: E402
from common import (  # noqa: E402
    HOST,
    Case,
    Sample,
    bench_session,
    emit_json,
    format_table,
    free_port,
    gbps,
    log,
    machine_info,
    spawn,
    stop_process,
    temp_dir,
    time_interleaved,
)

import kvstore  # noqa: E402
from kvstore.client import StoreClient  # noqa: E402
from kvstore.client.transports import transport  # noqa: E402
from kvstore.keys import ChunkKey, KVLayout, Namespace, chunk_keys  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class ChunkSize:
    """A chunk size and the bfloat16 layout that gives exactly that many bytes."""

    label: str
    layout: KVLayout

    @property
    def nbytes(self) -> int:
        return self.layout.chunk_nbytes


# Llama-3.1-8B's KV (32 layers, 8 KV heads of 128, bf16) is 128 KiB per token:
# 16 tokens are a 2 MiB chunk (vLLM's block), 128 tokens 16 MiB.
SIZES = (
    ChunkSize("2MiB", KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, chunk_tokens=16)),
    ChunkSize("16MiB", KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, chunk_tokens=128)),
)
assert [size.nbytes for size in SIZES] == [2 * MiB, 16 * MiB]

PATHS = ("shm", "unix", "tcp")
# Goals from the issue: shm gets against memcpy, socket paths against bare aiohttp.
GOALS = {
    ("shm", "get"): 0.7,
    ("shm", "get_into"): 0.7,
    **{(path, op): 0.8 for path in ("unix", "tcp") for op in ("get", "get_into", "put")},
}

DRAM_BYTES = 3 * GiB // 2
VOCAB = 128_256  # Llama-3's vocabulary, so ids look like an engine's
# Lookups: a 32K-token prefix of 256-token chunks. The payload size does not
# matter to a lookup, so the chunks are tiny (8 KiB) and all 128 fit anywhere.
LOOKUP_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=256)
LOOKUP_TOKENS = 32_768
LOOKUP_CLIENTS = 8
CLIENT_TIMEOUT_S = 60.0  # per I/O phase; generous, a failed call would read as a miss
PUT_SLICE_BYTES = 1 << 20  # the bare put's body pieces (see the module docstring)


@dataclass(frozen=True)
class Settings:
    batch_bytes: int
    reps: int
    warmup: int
    lookup_seconds: float

    def batch_chunks(self, size: ChunkSize) -> int:
        return max(2, self.batch_bytes // size.nbytes)


FULL = Settings(batch_bytes=128 * MiB, reps=9, warmup=1, lookup_seconds=5.0)
QUICK = Settings(batch_bytes=32 * MiB, reps=5, warmup=1, lookup_seconds=2.0)


@dataclass
class Result:
    path: str
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

    @property
    def goal(self) -> float | None:
        return GOALS.get((self.path, self.op))

    def as_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "op": self.op,
            "chunk_bytes": self.chunk_bytes,
            "batch_chunks": self.batch_chunks,
            "gbps": round(self.gbps, 4),
            "ceiling_gbps": round(self.ceiling_gbps, 4),
            "ratio": round(self.ratio, 4),
            "goal": self.goal,
        }


# -- processes -------------------------------------------------------------------


def _answers_healthz(socket_path: Path) -> bool:
    """Whether ``GET /healthz`` over the Unix socket answers 200 (raw HTTP, no client)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            sock.connect(str(socket_path))
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: kvstore\r\nConnection: close\r\n\r\n")
            return sock.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


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
        self.proc = spawn(self.argv, self.log_path, env=env)
        deadline = time.monotonic() + 60.0
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited while starting:\n{self.log_tail()}")
                if _answers_healthz(self.socket_path):
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


@dataclass(frozen=True)
class Addresses:
    """Where the daemon listens, and the token its TCP site wants."""

    unix_url: str
    tcp_url: str
    token: str
    socket_path: Path


def daemon_process(
    root: Path, dram_bytes: int, max_body_bytes: int
) -> tuple[ServerProcess, Addresses]:
    """``kvstore serve`` over ``root`` (DRAM + LMDB, Unix socket, TCP with a token).

    Returns the process (not yet started) and its addresses.
    """
    port = free_port()
    token = secrets.token_hex(16)
    socket_path = root / "kvstore.sock"
    config = root / "kvstore.toml"
    config.write_text(
        f"""\
data_dir = "{root / "data"}"
promote_on_hit = false

[tiers.dram]
capacity = {dram_bytes}

[tiers.ssd]
capacity = "4GiB"
path = "{root / "lmdb"}"

[daemon]
socket_path = "{socket_path}"
tcp_host = "{HOST}"
tcp_port = {port}
auth_token = "{token}"
max_body_bytes = {max_body_bytes}
flush_on_exit = false
log_level = "warning"
"""
    )
    argv = [sys.executable, "-m", "kvstore", "serve", "--config", str(config)]
    addresses = Addresses(f"unix://{socket_path}", f"http://{HOST}:{port}", token, socket_path)
    return ServerProcess("kvstore serve", argv, socket_path, root / "daemon.log"), addresses


def ceiling_process(root: Path) -> tuple[ServerProcess, int]:
    """The bare aiohttp app of ``serve_ceiling`` (this file, ``--serve-ceiling``)."""
    port = free_port()
    socket_path = root / "ceiling.sock"
    argv = [sys.executable, __file__, "--serve-ceiling", str(socket_path), str(port)]
    return ServerProcess("ceiling server", argv, socket_path, root / "ceiling.log"), port


# -- the bare aiohttp ceiling (its own process) -------------------------------------


def serve_ceiling(socket_path: str, port: int) -> None:
    """A minimal aiohttp app on a Unix socket and a TCP port, until SIGTERM/SIGINT.

    ``POST /get?nbytes=N&piece=P`` answers N bytes written P at a time, from
    distinct random memory (a zero-filled buffer could be served from the one
    zero page); ``POST /put`` reads its body and discards it.
    """
    bodies: dict[int, bytes] = {}

    def body_of(nbytes: int) -> memoryview:
        if nbytes not in bodies:
            bodies.clear()  # one size at a time
            bodies[nbytes] = np.random.default_rng(nbytes).bytes(nbytes)
        return memoryview(bodies[nbytes])

    async def get(request: web.Request) -> web.StreamResponse:
        nbytes, piece = int(request.query["nbytes"]), int(request.query["piece"])
        body = body_of(nbytes)
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = nbytes
        await response.prepare(request)
        for start in range(0, nbytes, piece):
            await response.write(body[start : start + piece])
        await response.write_eof()
        return response

    async def put(request: web.Request) -> web.Response:
        received = 0
        while data := await request.content.readany():
            received += len(data)
        return web.json_response({"received": received})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/get", get)
        app.router.add_post("/put", put)
        app.router.add_get("/healthz", healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        try:
            await web.TCPSite(runner, HOST, port).start()
            await web.UnixSite(runner, socket_path).start()  # last: healthz means all up
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())


class BareHTTP:
    """httpx against the bare app, with the transport and settings ``connect`` gives
    a ``StoreClient`` (same pool, timeout, and bearer header over TCP)."""

    def __init__(self, uds: str | None, base_url: str, token: str | None) -> None:
        self._http = httpx.Client(
            base_url=base_url,
            transport=transport(uds, 64),
            timeout=httpx.Timeout(CLIENT_TIMEOUT_S),
            headers={"Authorization": f"Bearer {token}"} if token else None,
        )

    def get(self, nbytes: int, piece: int) -> int:
        """Fetch an ``nbytes`` body and throw it away; how many bytes came."""
        request = self._http.build_request(
            "POST", "/get", params={"nbytes": nbytes, "piece": piece}
        )
        response = self._http.send(request, stream=True)
        received = 0
        try:
            for data in response.iter_bytes():
                received += len(data)
        finally:
            response.close()
        if response.status_code != 200 or received != nbytes:
            raise RuntimeError(f"bare get: HTTP {response.status_code}, {received} bytes")
        return received

    def put(self, pieces: Sequence[memoryview]) -> None:
        """Send ``pieces`` as one body, piece by piece (not joined), with a length."""
        length = sum(piece.nbytes for piece in pieces)
        content: Any = iter(pieces)  # bytes-like views; httpx's hint says bytes
        response = self._http.post(
            "/put",
            content=content,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(length)},
        )
        if response.status_code != 200 or response.json()["received"] != length:
            raise RuntimeError(f"bare put: HTTP {response.status_code} {response.text[:200]}")

    def close(self) -> None:
        self._http.close()


# -- measurement -----------------------------------------------------------------


@dataclass
class Rep:
    """One timed repetition: its keys, and what the call returned (checked untimed)."""

    keys: list[ChunkKey] = field(default_factory=list)
    result: Any = None


class KeySpace:
    """Fresh token sequences (hence fresh chunk keys) for every repetition."""

    def __init__(self, namespace: Namespace, count: int, seed: int) -> None:
        self._namespace = namespace
        self._count = count
        self._rng = np.random.default_rng(seed)

    def fresh(self) -> list[ChunkKey]:
        tokens = self._rng.integers(
            0, VOCAB, size=self._count * self._namespace.chunk_tokens, dtype=np.int64
        )
        return chunk_keys(self._namespace, tokens)


@dataclass
class Clients:
    """The daemon's clients (one per path) and the bare ceilings."""

    store: dict[str, StoreClient]
    bare: dict[str, BareHTTP]
    memcpy: RawDRAM


def check_chunks(path: str, got: list[Any], payloads: list[np.ndarray], full: bool) -> None:
    """Every chunk came back (a failed call degrades to misses); first and last
    byte for byte when ``full``."""
    missing = sum(chunk is None for chunk in got)
    if missing:
        raise RuntimeError(f"{path}: {missing} of {len(got)} chunks missed")
    if full:
        for index in (0, len(payloads) - 1):
            if bytes(got[index].payload) != payloads[index].tobytes():
                raise RuntimeError(f"{path}: chunk {index} did not round-trip")


def measure_size(clients: Clients, size: ChunkSize, settings: Settings, seed: int) -> list[Result]:
    """Gets (plain and into buffers) and puts of one chunk size, over every path."""
    count = settings.batch_chunks(size)
    chunks = make_chunks(size, count, seed)
    payloads = [chunk.view(torch.uint8).reshape(-1).numpy() for chunk in chunks]
    # The bare put's body: the same buffers, as views of at most PUT_SLICE_BYTES.
    pieces = [
        payload.data[start : start + PUT_SLICE_BYTES]
        for payload in payloads
        for start in range(0, payload.nbytes, PUT_SLICE_BYTES)
    ]
    batch_bytes = count * size.nbytes
    namespace = Namespace(f"bench-daemon-{size.label}", size.layout)
    space = KeySpace(namespace, count, seed)
    unix = clients.store["unix"]
    clients.memcpy.load(payloads)
    results: list[Result] = []

    # The chunks every get reads, stored once.
    keys = space.fresh()
    if unix.put(namespace, keys, chunks) != count:
        raise RuntimeError(f"put of {count} chunks did not store them all")
    outs = [torch.zeros_like(chunk) for chunk in chunks]
    for path in PATHS:
        client = clients.store[path]
        check_chunks(path, client.get(namespace, keys), payloads, full=True)
        check_chunks(path, client.get(namespace, keys, out=outs), payloads, full=True)

    for path in PATHS:
        client = clients.store[path]
        log(f"  {path:4} {size.label:>5} x {count}: get ...")

        def get(rep: Rep, client: StoreClient = client) -> None:
            rep.result = client.get(namespace, keys)

        def get_into(rep: Rep, client: StoreClient = client) -> None:
            rep.result = client.get(namespace, keys, out=outs)

        def checked(rep: Rep, path: str = path) -> None:
            check_chunks(path, rep.result, payloads, full=False)

        if path == "shm":
            ceiling = Case(run=lambda: clients.memcpy.get([]))
        else:
            bare = clients.bare[path]
            ceiling = Case(run=lambda bare=bare: bare.get(batch_bytes, size.nbytes))
        samples = time_interleaved(
            {
                "get": Case(run=get, before=Rep, after=checked),
                "get_into": Case(run=get_into, before=Rep, after=checked),
                "ceiling": ceiling,
            },
            settings.reps,
            warmup=settings.warmup,
        )
        for op in ("get", "get_into"):
            results.append(Result(path, op, size.nbytes, count, samples[op], samples["ceiling"]))
    unix.delete(namespace, keys)

    for path in PATHS[1:]:
        client = clients.store[path]
        bare = clients.bare[path]
        log(f"  {path:4} {size.label:>5} x {count}: put ...")
        held: list[ChunkKey] = []

        def fresh() -> Rep:
            return Rep(space.fresh())

        def put(rep: Rep, client: StoreClient = client) -> None:
            rep.result = client.put(namespace, rep.keys, chunks)

        def stored(rep: Rep, path: str = path, held: list[ChunkKey] = held) -> None:
            if rep.result != count:
                raise RuntimeError(f"{path}: put stored {rep.result} of {count} chunks")
            if held:
                unix.delete(namespace, held)
            held[:] = rep.keys

        samples = time_interleaved(
            {
                "put": Case(run=put, before=fresh, after=stored),
                "ceiling": Case(run=lambda bare=bare: bare.put(pieces)),
            },
            settings.reps,
            warmup=settings.warmup,
        )
        unix.delete(namespace, held)
        results.append(Result(path, "put", size.nbytes, count, samples["put"], samples["ceiling"]))
    return results


def make_chunks(size: ChunkSize, count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(size.layout.chunk_shape, generator=generator, dtype=torch.bfloat16)
        for _ in range(count)
    ]


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
        ordered = sorted(self.latencies_s)
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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


# -- output ----------------------------------------------------------------------


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB"


def table(results: list[Result]) -> str:
    rows = []
    for r in results:
        verdict = None
        if r.goal is not None:
            verdict = f"{'ok' if r.ratio >= r.goal else 'MISS'} (>= {r.goal})"
        rows.append(
            [
                r.path,
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
        ["path", "op", "chunk", "batch", "GB/s", "ceiling GB/s", "ratio", "spread", "goal"], rows
    )


NOTES = [
    "GB/s: decimal, KV payload bytes per second (block headers and frame metadata not "
    "counted), median of the timed repetitions; store and ceiling interleaved; "
    "spread = (max-min)/median.",
    "Daemon: python -m kvstore serve, DRAM 1.5 GiB + LMDB (every chunk is served from DRAM), "
    "its own process; client, daemon and bare app share the machine's CPUs.",
    "shm ceiling: np.copyto into preallocated, touched buffers, one thread (the same for get "
    "and get_into); the client also checksums what it copies and pays a lease round trip.",
    "unix/tcp ceiling: a bare aiohttp app in its own process answering a same-size body in "
    "chunk-sized writes (get), or reading and discarding one (put); httpx with the client's "
    "transport (kvstore.client.transports: sendall writes, larger reads), pool and timeout; "
    "the ceiling client discards the bytes it reads, the store client verifies every block.",
    "Put bodies, bare and store alike, go out as views of at most 1 MiB: whole multi-MiB "
    "pieces are quadratic in httpcore's default write path.",
    "No shm put: a put always travels over the socket (the unix row).",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer reps")
    parser.add_argument(
        "--serve-ceiling", nargs=2, metavar=("SOCKET", "PORT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.serve_ceiling:
        serve_ceiling(args.serve_ceiling[0], int(args.serve_ceiling[1]))
        return
    settings = QUICK if args.quick else FULL
    out: Callable[..., None] = log if args.json else print
    started = time.perf_counter()

    results: list[Result] = []
    with bench_session() as stack:
        # Under /tmp: a Unix socket path must stay under 108 bytes.
        root = stack.enter_context(temp_dir("kvs-bench-daemon-", "/tmp"))
        largest = max(settings.batch_chunks(size) * size.nbytes for size in SIZES)
        daemon, addresses = daemon_process(root, DRAM_BYTES, 2 * largest)
        stack.enter_context(daemon)
        ceiling, ceiling_port = ceiling_process(root)
        stack.enter_context(ceiling)
        log(f"  daemon pid {daemon.pid} on {addresses.unix_url} and {addresses.tcp_url}")

        def connect(url: str, **options: Any) -> StoreClient:
            client = kvstore.connect(url, timeout_s=CLIENT_TIMEOUT_S, **options)
            assert isinstance(client, StoreClient)
            stack.callback(client.close)
            return client

        def bare(uds: str | None, base_url: str, token: str | None) -> BareHTTP:
            client = BareHTTP(uds, base_url, token)
            stack.callback(client.close)
            return client

        clients = Clients(
            store={
                "shm": connect(addresses.unix_url, transfer="shm"),
                "unix": connect(addresses.unix_url, transfer="bytes"),
                "tcp": connect(addresses.tcp_url, token=addresses.token, transfer="bytes"),
            },
            bare={
                "unix": bare(str(ceiling.socket_path), "http://kvstore", None),
                "tcp": bare(None, f"http://{HOST}:{ceiling_port}", addresses.token),
            },
            memcpy=RawDRAM(),
        )
        for index, size in enumerate(SIZES):
            results.extend(measure_size(clients, size, settings, seed=index))
        for path, client in clients.store.items():
            degraded = client.client_stats()
            if degraded.gets_failed or degraded.puts_dropped or degraded.corrupt_blocks:
                raise RuntimeError(f"{path}: the client degraded: {degraded}")
        clients.memcpy.close()
        log(f"  lookups: {LOOKUP_CLIENTS} threads x {settings.lookup_seconds:.0f} s ...")
        lookups = measure_lookups(addresses.unix_url, daemon.pid, settings.lookup_seconds)
    elapsed = time.perf_counter() - started

    mode = "quick" if args.quick else "full"
    out(table(results))
    out()
    out(
        f"lookup ({LOOKUP_TOKENS} tokens = {LOOKUP_TOKENS // LOOKUP_LAYOUT.chunk_tokens} "
        f"cached chunks, {LOOKUP_CLIENTS} threads with a StoreClient each, unix socket): "
        f"{lookups.per_s:,.0f}/s, p50 {lookups.percentile_ms(0.5):.2f} ms, "
        f"p99 {lookups.percentile_ms(0.99):.2f} ms; CPU busy: client "
        f"{lookups.client_cpu_s / lookups.seconds:.2f}, daemon "
        f"{lookups.daemon_cpu_s / lookups.seconds:.2f} cores of {os.cpu_count()}"
    )
    for note in NOTES:
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
                    "dram_bytes": DRAM_BYTES,
                    "goals": {f"{path}/{op}": goal for (path, op), goal in GOALS.items()},
                },
                "results": [r.as_json() for r in results],
                "lookups_per_s": round(lookups.per_s),
                "lookup_clients": LOOKUP_CLIENTS,
                "lookup_prefix_tokens": LOOKUP_TOKENS,
                "lookup": {
                    "client_kind": "threads, one StoreClient each, unix socket, token ids",
                    "seconds": round(lookups.seconds, 2),
                    "lookups": lookups.lookups,
                    "p50_ms": round(lookups.percentile_ms(0.5), 3),
                    "p99_ms": round(lookups.percentile_ms(0.99), 3),
                    "client_cpu_cores": round(lookups.client_cpu_s / lookups.seconds, 2),
                    "daemon_cpu_cores": round(lookups.daemon_cpu_s / lookups.seconds, 2),
                },
                "notes": NOTES,
                "elapsed_s": round(elapsed, 1),
            }
        )


if __name__ == "__main__":
    main()
