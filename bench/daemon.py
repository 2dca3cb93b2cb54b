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
          arena, check, release; also with
          verify="full": the get_full rows)
    unix  connect("unix://...", transfer=        a bare aiohttp app (its own process) over
          "bytes"): frames over the Unix socket  a Unix socket, fetched by httpx with the
                                                 client's own transport and settings
    tcp   connect("http://127.0.0.1:PORT",       the same bare app over loopback TCP, same
          token=..., transfer="bytes")           httpx settings, the same bearer header

The memcpy ceiling's source holds the payloads themselves, written before
anything is timed: memory never written reads as the kernel's one shared zero
page, which stays in cache, and made the ceiling a copy that read no DRAM
(~25% faster than any copy of real bytes, the store's included).

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
have the same ceiling. A put has no shared-memory path, so there is no ``shm``
put row: the daemon reads a put's body off the socket straight into its DRAM
arena (``kvstore/server/borrowed_body.py``), client -> kernel -> arena, and a
put through a shared segment would cost the same two copies (client ->
segment -> arena) plus a lease. Every put writes fresh keys
(the previous repetition's are deleted, untimed), so it is a real write.

It also measures lookups per second of a 32K-token prefix (256-token chunks:
128 keys, all cached) from 8 threads, each with its own ``StoreClient`` over
the Unix socket, passing token ids (the client hashes them, as an engine's
lookup would).

    python bench/daemon.py            # table on stdout
    python bench/daemon.py --json     # one JSON object on stdout, table on stderr
    python bench/daemon.py --quick    # smaller batches, fewer repetitions (< 1 min)
    python bench/daemon.py --paths shm  # a subset of shm,unix,tcp
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ceilings import RawDRAM  # noqa: E402
from common import (  # noqa: E402
    CHUNK_2MIB,
    CHUNK_16MIB,
    CLIENT_TIMEOUT_S,
    BatchThroughput,
    Case,
    ChunkSize,
    DaemonStats,
    GiB,
    KeySpace,
    MiB,
    ServerProcess,
    bench_arguments,
    bench_session,
    check_chunks,
    emit_json,
    format_table,
    log,
    machine_info,
    make_chunks,
    size_label,
    store_client,
    temp_dir,
    time_interleaved,
    verdict,
)
from daemon_lookups import (  # noqa: E402
    LOOKUP_CLIENTS,
    LOOKUP_LAYOUT,
    LOOKUP_TOKENS,
    measure_lookups,
)
from http_ceiling import BareHTTP, ceiling_process  # noqa: E402

from kvstore.client import StoreClient  # noqa: E402
from kvstore.keys import ChunkKey, Namespace  # noqa: E402
from kvstore.local.processes import HOST, free_port  # noqa: E402

SIZES = (CHUNK_2MIB, CHUNK_16MIB)
assert [size.nbytes for size in SIZES] == [2 * MiB, 16 * MiB]

PATHS = ("shm", "unix", "tcp")
# Goals from the issue: shm gets against memcpy, socket paths against bare aiohttp.
GOALS = {
    ("shm", "get"): 0.7,
    ("shm", "get_into"): 0.7,
    **{(path, op): 0.8 for path in ("unix", "tcp") for op in ("get", "get_into", "put")},
}

DRAM_BYTES = 3 * GiB // 2
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


@dataclass(frozen=True, kw_only=True)
class Result(BatchThroughput):
    """A ``BatchThroughput`` of one client path (shm, unix, tcp)."""

    path: str

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
prefault = true

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


# -- measurement -----------------------------------------------------------------


@dataclass
class Rep:
    """One timed repetition: its keys, and what the call returned (checked untimed)."""

    keys: list[ChunkKey] = field(default_factory=list)
    result: Any = None


@dataclass
class Clients:
    """The daemon's clients (one per path) and the bare ceilings."""

    store: dict[str, StoreClient]
    bare: dict[str, BareHTTP]
    memcpy: RawDRAM


def measure_size(
    clients: Clients, paths: list[str], size: ChunkSize, settings: Settings, seed: int
) -> list[Result]:
    """Gets (plain and into buffers) and puts of one chunk size, over ``paths``."""
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
    # Untimed: write the payloads into the ceiling's source. Left as np.zeros gave it,
    # every page of it is the kernel's shared zero page, which stays in cache, so the
    # "memcpy" read no DRAM at all and ran ~25% faster than a copy of the same bytes.
    clients.memcpy.put([])
    results: list[Result] = []

    # The chunks every get reads, stored once.
    keys = space.fresh().keys
    if unix.put(namespace, keys, chunks) != count:
        raise RuntimeError(f"put of {count} chunks did not store them all")
    outs = [torch.zeros_like(chunk) for chunk in chunks]
    for path, client in clients.store.items():
        check_chunks(path, client.get(namespace, keys), payloads, full=True)
        check_chunks(path, client.get(namespace, keys, out=outs), payloads, full=True)

    for path in paths:
        log(f"  {path:4} {size.label:>5} x {count}: get ...")

        def checked(rep: Rep, path: str = path) -> None:
            check_chunks(path, rep.result, payloads, full=False)

        def cases(op: str, client: StoreClient) -> dict[str, Case]:
            """``get`` and ``get_into`` of ``client``, as ``op`` and ``op``_into."""

            def get(rep: Rep) -> None:
                rep.result = client.get(namespace, keys)

            def get_into(rep: Rep) -> None:
                rep.result = client.get(namespace, keys, out=outs)

            return {
                op: Case(run=get, before=Rep, after=checked),
                op.replace("get", "get_into"): Case(run=get_into, before=Rep, after=checked),
            }

        timed = cases("get", clients.store[path])
        if path == "shm":  # the same path, every copy checksummed (verify="full")
            timed |= cases("get_full", clients.store["shm-full"])
            timed["ceiling"] = Case(run=lambda: clients.memcpy.get([]))
        else:
            bare = clients.bare[path]
            timed["ceiling"] = Case(run=lambda bare=bare: bare.get(batch_bytes, size.nbytes))
        samples = time_interleaved(timed, settings.reps, warmup=settings.warmup)
        for op in [op for op in timed if op != "ceiling"]:
            results.append(
                Result(
                    path=path,
                    op=op,
                    chunk_bytes=size.nbytes,
                    batch_chunks=count,
                    store=samples[op],
                    ceiling=samples["ceiling"],
                )
            )
    unix.delete(namespace, keys)

    for path in [path for path in paths if path != "shm"]:
        client = clients.store[path]
        bare = clients.bare[path]
        log(f"  {path:4} {size.label:>5} x {count}: put ...")
        held: list[ChunkKey] = []

        def fresh() -> Rep:
            return Rep(space.fresh().keys)

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
        results.append(
            Result(
                path=path,
                op="put",
                chunk_bytes=size.nbytes,
                batch_chunks=count,
                store=samples["put"],
                ceiling=samples["ceiling"],
            )
        )
    return results


# -- output ----------------------------------------------------------------------


def table(results: list[Result]) -> str:
    rows = []
    for r in results:
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
                verdict(r.ratio, r.goal),
            ]
        )
    return format_table(
        ["path", "op", "chunk", "batch", "GB/s", "ceiling GB/s", "ratio", "spread", "goal"], rows
    )


NOTES = [
    "GB/s: decimal, KV payload bytes per second (block headers and frame metadata not "
    "counted), median of the timed repetitions; store and ceiling interleaved; "
    "spread = (max-min)/median.",
    "Daemon: python -m kvstore serve, DRAM 1.5 GiB (prefault = true, populated before "
    "anything is timed) + LMDB (every chunk is served from DRAM), its own process; client, "
    "daemon and bare app share the machine's CPUs.",
    "Checksums of puts: over the Unix socket the daemon computes them as blocks land "
    "(seal 'daemon'); over TCP the client hashes each slice just before sending it and "
    "sends the checksum after the payload (seal 'trailer'), which the daemon verifies.",
    "shm ceiling: np.copyto of the payloads (written into their source array first, not "
    "read from never-written zero pages) into preallocated, touched buffers, one thread (the "
    "same for get and get_into); the client pays a lease round trip, copies with a helper "
    "thread from 4 MiB up, and checks each copy by its extent's generation (verify='fast', "
    "the default on x86-64); get_full/get_into_full: the same path with every copy checksummed "
    "(verify='full'), no goal of their own.",
    "unix/tcp ceiling: a bare aiohttp app in its own process answering a same-size body in "
    "chunk-sized writes (get), or reading and discarding one (put); httpx with the client's "
    "transport (kvstore.client.transports: sendall writes, larger reads), pool and timeout; "
    "the ceiling client discards the bytes it reads, the store client verifies every block.",
    "Put bodies, bare and store alike, go out as views of at most 1 MiB: whole multi-MiB "
    "pieces are quadratic in httpcore's default write path.",
    "No shm put: a put always travels over the socket (the unix row), read straight into "
    "the DRAM arena; through shared memory it would pay the same two copies (client -> "
    "segment -> arena as client -> kernel -> arena).",
]


def main(argv: list[str] | None = None) -> None:
    parser = bench_arguments(__doc__.splitlines()[0])
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset")
    args = parser.parse_args(argv)
    paths = [path for path in PATHS if path in args.paths.split(",")]
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
        stats = DaemonStats(addresses.socket_path)
        stack.callback(stats.close)
        stats.wait_prefaulted()

        def bare(uds: str | None, base_url: str, token: str | None) -> BareHTTP:
            client = BareHTTP(uds, base_url, token, CLIENT_TIMEOUT_S)
            stack.callback(client.close)
            return client

        clients = Clients(
            store={
                "shm": store_client(stack, addresses.unix_url, transfer="shm"),
                "shm-full": store_client(stack, addresses.unix_url, transfer="shm", verify="full"),
                "unix": store_client(stack, addresses.unix_url, transfer="bytes"),
                "tcp": store_client(
                    stack, addresses.tcp_url, token=addresses.token, transfer="bytes"
                ),
            },
            bare={
                "unix": bare(str(ceiling.socket_path), "http://kvstore", None),
                "tcp": bare(None, f"http://{HOST}:{ceiling_port}", addresses.token),
            },
            memcpy=RawDRAM(),
        )
        for index, size in enumerate(SIZES):
            results.extend(measure_size(clients, paths, size, settings, seed=index))
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
