"""Clients too slow to serve, against a real daemon over raw sockets: a body trickled a
byte at a time is cut off at its deadline (``body_deadline_s``) however steadily it
trickles, so its put slot comes back and a normal put issued meanwhile succeeds; nothing
of it is stored; and connections trickling their headers are closed at
``header_timeout_s``."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from support import http_kv, kv
from support.daemon import Daemon
from support.http_kv import frames_body, lookup, make_chain, put, register

from kvstore.wire.frames import FRAMES_CONTENT_TYPE

# Deadlines small enough for a test, the pace slow enough to miss them by far, and
# the idle timeout long enough that it is never what cuts a trickle off.
DEADLINE_S = 1.0
EVERY_S = 0.2
IDLE_TIMEOUT_S = 5.0
TRICKLE_FOR_S = 8.0
# Deadline, plus a poll slice, the answer and aiohttp's lingering read of a refused body.
CUT_OFF_WITHIN_S = DEADLINE_S + 4.0


@dataclass
class Trickle:
    """One connection sending ``drip`` a byte at a time after ``head``."""

    head: bytes
    drip: bytes
    sock: socket.socket | None = None
    reply: bytes = b""
    ended_after_s: float | None = None  # None: still open when the trickling stopped


def _connect(path: Path, head: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(path))
    sock.sendall(head)
    sock.setblocking(False)
    return sock


def _trickle_all(path: Path, trickles: Sequence[Trickle]) -> None:
    """Open every connection, then send each one byte every ``EVERY_S`` (for at most
    ``TRICKLE_FOR_S``), reading what the daemon answers, until it ends them."""
    started = time.monotonic()
    for trickle in trickles:
        trickle.sock = _connect(path, trickle.head)
    try:
        for step in range(int(TRICKLE_FOR_S / EVERY_S)):
            open_ones = [t for t in trickles if t.ended_after_s is None]
            if not open_ones:
                return
            for trickle in open_ones:
                _send_byte(trickle, bytes([trickle.drip[step % len(trickle.drip)]]), started)
            _read_answers(open_ones, started)
    finally:
        for trickle in trickles:
            if trickle.sock is not None:
                trickle.sock.close()


def _send_byte(trickle: Trickle, byte: bytes, started: float) -> None:
    assert trickle.sock is not None
    try:
        trickle.sock.send(byte)
    except OSError:  # BrokenPipe, ConnectionReset: the daemon ended it
        trickle.ended_after_s = time.monotonic() - started


def _read_answers(trickles: Sequence[Trickle], started: float) -> None:
    """Wait ``EVERY_S``, keeping what each connection answers and noting when it ends."""
    until = time.monotonic() + EVERY_S
    while (left := until - time.monotonic()) > 0:
        live = [t for t in trickles if t.ended_after_s is None]
        if not live:
            return
        readable, _, _ = select.select([t.sock for t in live], [], [], left)
        for trickle in live:
            if trickle.sock not in readable:
                continue
            assert trickle.sock is not None
            try:
                data = trickle.sock.recv(65536)
            except OSError:
                data = b""
            trickle.reply += data
            if not data:
                trickle.ended_after_s = time.monotonic() - started


def _put_head(body: bytes) -> bytes:
    return (
        f"POST /v1/put HTTP/1.1\r\nHost: kvstore\r\nContent-Type: {FRAMES_CONTENT_TYPE}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()


def _dram_used(daemon: Daemon) -> int:
    with daemon.client() as client:
        return int(client.get("/v1/stats").json()["store"]["tiers"]["dram"]["used_bytes"])


def test_trickled_bodies_are_cut_off_at_their_deadline_and_free_their_put_slots(
    daemon_factory: Callable[..., Daemon],
) -> None:
    slots = 2
    daemon = daemon_factory(
        daemon={
            "max_concurrent_puts": slots,
            "body_deadline_base_s": DEADLINE_S,
            "body_timeout_s": IDLE_TIMEOUT_S,
        }
    )
    ns = http_kv.namespace_for("trickled")
    with daemon.client() as client:
        register(client, ns)
    used = _dram_used(daemon)
    chains = [make_chain(ns, 3, start=1000 * i) for i in range(slots)]
    bodies = [frames_body(ns, chain.keys, chain.blocks) for chain in chains]
    # Every put slot held by a body that never stops arriving, and one JSON body too.
    lookup_body = b'{"namespace": "%s", "keys": []}' % ns.digest.hex().encode()
    trickles = [Trickle(_put_head(body) + body[:8], body[8:]) for body in bodies]
    trickles.append(
        Trickle(
            b"POST /v1/lookup HTTP/1.1\r\nHost: kvstore\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(lookup_body),
            lookup_body,
        )
    )
    normal = make_chain(ns, 2, start=9000)
    with ThreadPoolExecutor(1) as pool:
        trickling = pool.submit(_trickle_all, daemon.socket_path, trickles)
        time.sleep(3 * EVERY_S)  # both slots are taken
        issued = time.monotonic()
        with daemon.client(timeout_s=TRICKLE_FOR_S) as client:
            assert put(client, normal) == 2
        waited_s = time.monotonic() - issued
        trickling.result(timeout=TRICKLE_FOR_S + 10)
    assert waited_s < CUT_OFF_WITHIN_S
    for trickle in trickles:
        assert trickle.ended_after_s is not None and trickle.ended_after_s < CUT_OFF_WITHIN_S
        # Answered 408 when the answer could still be read, else simply dropped.
        assert trickle.reply == b"" or trickle.reply.startswith(b"HTTP/1.1 408"), trickle.reply
    assert trickles[-1].reply.startswith(b"HTTP/1.1 408")  # aiohttp read the body's rest
    assert b"request_timeout" in trickles[-1].reply
    with daemon.client() as client:
        for chain in chains:  # not a block of the trickled puts was kept
            assert lookup(client, ns, chain.keys)["num_chunks"] == 0
        assert lookup(client, ns, normal.keys)["num_chunks"] == 2
    assert _dram_used(daemon) == used + len(normal.keys) * kv.ARENA_SLOT


def test_connections_trickling_their_headers_are_closed_at_the_header_deadline(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory(daemon={"header_timeout_s": DEADLINE_S})
    trickles = [
        Trickle(b"GET /healthz HTTP/1.1\r\nHost: kvstore\r\nX-Slow: ", b"abcdefgh")
        for _ in range(20)
    ]
    _trickle_all(daemon.socket_path, trickles)
    for trickle in trickles:
        assert trickle.ended_after_s is not None and trickle.ended_after_s < CUT_OFF_WITHIN_S
        assert trickle.reply == b""  # headers never complete: nothing to answer
    with daemon.client() as client:  # a request that sends its headers at once is served
        assert client.get("/healthz").json() == {"ok": True}


def test_bodies_that_trickle_from_the_start_never_hold_a_put_slot(
    daemon_factory: Callable[..., Daemon],
) -> None:
    """Eight puts that send their headers, then a byte every ``EVERY_S``, against two
    slots and a deadline far longer than the test: a normal put is stored at once,
    because a slot is taken once ``put_start_bytes`` of a body are here."""
    slots, tricklers = 2, 8
    daemon = daemon_factory(
        daemon={
            "max_concurrent_puts": slots,
            "body_deadline_base_s": 60.0,
            "body_timeout_s": 60.0,
            "put_start_bytes": 4096,
        }
    )
    ns = http_kv.namespace_for("starved")
    with daemon.client() as client:
        register(client, ns)
    chains = [make_chain(ns, 3, start=1000 * i) for i in range(tricklers)]
    bodies = [frames_body(ns, chain.keys, chain.blocks) for chain in chains]
    assert min(len(body) for body in bodies) > 4096
    trickles = [Trickle(_put_head(body) + body[:8], body[8:]) for body in bodies]
    normal = make_chain(ns, 2, start=90_000)
    with ThreadPoolExecutor(1) as pool:
        trickling = pool.submit(_trickle_all, daemon.socket_path, trickles)
        time.sleep(3 * EVERY_S)  # every trickle has sent its headers and some bytes
        issued = time.monotonic()
        with daemon.client(timeout_s=TRICKLE_FOR_S) as client:
            assert put(client, normal) == 2
        waited_s = time.monotonic() - issued
        trickling.result(timeout=TRICKLE_FOR_S + 10)
    assert waited_s < 2.0  # with slots taken by headers: until a trickle's deadline
    with daemon.client() as client:
        assert lookup(client, ns, normal.keys)["num_chunks"] == 2
        for chain in chains:
            assert lookup(client, ns, chain.keys)["num_chunks"] == 0
