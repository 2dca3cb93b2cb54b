#!/usr/bin/env python3
"""How long the ``kvstore`` command and the daemon take to start, against peers that do
the same with nothing of kvstore around them, timed interleaved in the same run.

    command                           peer
    --------------------------------  ------------------------------------------------
    kvstore --help, --version         python -c pass (the interpreter's own start)
    kvstore stats / ready /           python -c: httpx asking the same daemon the same
      namespaces --url unix://...     route over the same socket, printing the JSON
    kvstore serve (DRAM + LMDB),      an aiohttp app with one route, /healthz, on a Unix
      spawn to /healthz answering     socket: spawn to its first answer

The commands' figure is how much longer than their peer they take (ratio); the
interpreter's start is the floor under all of them. Everything runs as a fresh
process each time, as an operator's shell or a readiness probe would run it.

    python bench/startup.py [--json] [--quick]
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    ServerProcess,
    bench_arguments,
    bench_session,
    emit_json,
    format_table,
    log,
    machine_info,
    percentile,
    temp_dir,
)
from faults.campaign import DaemonSpec  # noqa: E402

KVSTORE = [sys.executable, "-m", "kvstore"]


def ask(socket_path: Path, route: str) -> list[str]:
    """A bare client's argv: GET ``route`` over the socket with httpx, print the JSON."""
    code = (
        "import httpx, json, sys; "
        f"t = httpx.HTTPTransport(uds={str(socket_path)!r}); "
        "c = httpx.Client(transport=t, base_url='http://kvstore'); "
        f"print(json.dumps(c.get({route!r}).json()))"
    )
    return [sys.executable, "-c", code]


def bare_server(root: Path) -> ServerProcess:
    """The serving peer: aiohttp with nothing but ``/healthz``, on ``root/bare.sock``."""
    socket_path = root / "bare.sock"
    code = (
        "from aiohttp import web\n"
        "async def ok(request): return web.json_response({'ok': True})\n"
        "app = web.Application(); app.router.add_get('/healthz', ok)\n"
        f"web.run_app(app, path={str(socket_path)!r}, print=None)\n"
    )
    return ServerProcess("bare aiohttp", [sys.executable, "-c", code], socket_path, root / "log")


def run_once(argv: Sequence[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def spawn_to_serving(start: Callable[[], Any]) -> float:
    """Seconds from spawning a server to its first ``/healthz`` answer (polled every 50 ms
    by ``ServerProcess``); the server is stopped after, untimed."""
    server = start()
    started = time.perf_counter()
    with server:
        return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    args = bench_arguments(__doc__.splitlines()[0]).parse_args(argv)
    reps = 5 if args.quick else 15
    out: Callable[..., None] = log if args.json else print
    with bench_session() as stack:
        root = stack.enter_context(temp_dir("kvs-bench-start-", "/tmp"))
        daemon = DaemonSpec(root / "daemon")
        stack.enter_context(daemon.process())
        url = ["--url", daemon.url]
        pairs: dict[str, tuple[list[str], list[str]]] = {
            "kvstore --help": ([*KVSTORE, "--help"], [sys.executable, "-c", "pass"]),
            "kvstore --version": ([*KVSTORE, "--version"], [sys.executable, "-c", "pass"]),
            "kvstore stats": ([*KVSTORE, "stats", *url], ask(daemon.socket_path, "/v1/stats")),
            "kvstore ready": ([*KVSTORE, "ready", *url], ask(daemon.socket_path, "/readyz")),
            "kvstore namespaces": (
                [*KVSTORE, "namespaces", *url],
                ask(daemon.socket_path, "/v1/namespaces"),
            ),
        }
        times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in pairs}
        for command, peer in pairs.values():
            run_once(command), run_once(peer)  # warm the page cache
        for _ in range(reps):
            for name, (command, peer) in pairs.items():
                times[name][0].append(run_once(command))
                times[name][1].append(run_once(peer))
        serve: tuple[list[float], list[float]] = ([], [])
        for index in range(max(3, reps // 3)):
            spec = DaemonSpec(root / f"serve{index}")
            serve[0].append(spawn_to_serving(spec.process))
            bare_root = root / f"bare{index}"
            bare_root.mkdir()
            serve[1].append(spawn_to_serving(lambda r=bare_root: bare_server(r)))
        times["kvstore serve to /healthz"] = serve

    rows = []
    results = []
    for name, (command, peer) in times.items():
        median, peer_median = percentile(command, 0.5), percentile(peer, 0.5)
        results.append(
            {
                "command": name,
                "median_s": round(median, 4),
                "max_s": round(max(command), 4),
                "peer_median_s": round(peer_median, 4),
                "ratio": round(median / peer_median, 3),
                "runs": len(command),
            }
        )
        rows.append(
            [
                name,
                f"{median:.3f}",
                f"{max(command):.3f}",
                f"{peer_median:.3f}",
                f"{median / peer_median:.2f}x",
            ]
        )
    out(format_table(["command", "median s", "max s", "peer median s", "ratio"], rows))
    if args.json:
        emit_json({"benchmark": "startup", "machine": machine_info(), "results": results})


if __name__ == "__main__":
    main()
