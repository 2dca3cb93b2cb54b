"""The fault proxy against a real redis-server: PING through it in every mode, and each
answer (or its absence) within a bounded time.

Raw sockets with a 0.5 s timeout stand for a Redis client: what each mode must
look like to one is an answer, a timeout, or a reset, and nothing else.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from faults.proxy import Fault, FaultProxy

from kvstore.local.processes import HOST
from kvstore.local.redis_server import RedisServer

TIMEOUT_S = 0.5
PONG = b"+PONG\r\n"


@pytest.fixture
def proxy(clean_redis: RedisServer) -> Iterator[FaultProxy]:
    with FaultProxy(clean_redis.port) as proxy:
        yield proxy


def connect(proxy: FaultProxy, timeout_s: float = TIMEOUT_S) -> socket.socket:
    return socket.create_connection((HOST, proxy.port), timeout=timeout_s)


def read_exactly(sock: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {nbytes} bytes")
        data += chunk
    return data


def ping(sock: socket.socket) -> bytes:
    sock.sendall(b"PING\r\n")
    return read_exactly(sock, len(PONG))


def timed(call: object) -> float:
    assert callable(call)
    started = time.monotonic()
    call()
    return time.monotonic() - started


def test_pass_through_answers_at_once(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        started = time.monotonic()
        assert ping(sock) == PONG
        assert time.monotonic() - started < TIMEOUT_S
    assert proxy.counters.accepted == 1


def test_latency_delays_each_way_and_clears(proxy: FaultProxy) -> None:
    with connect(proxy, timeout_s=3.0) as sock:
        assert ping(sock) == PONG
        proxy.set(Fault.LATENCY, delay_s=0.2)
        started = time.monotonic()
        assert ping(sock) == PONG
        assert 0.4 <= time.monotonic() - started < 1.5  # 0.2 s there, 0.2 s back
        proxy.clear()
        started = time.monotonic()
        assert ping(sock) == PONG
        assert time.monotonic() - started < TIMEOUT_S


def test_latency_does_not_add_up_along_a_long_reply(
    proxy: FaultProxy, clean_redis: RedisServer
) -> None:
    """Chunks are delayed from their arrival, so a reply of many chunks pays the delay
    once, not once per chunk."""
    value = bytes(range(256)) * 4096  # 1 MiB: 16 or more reads of the proxy
    clean_redis.command("SET", "big", value)
    with connect(proxy, timeout_s=3.0) as sock:
        proxy.set(Fault.LATENCY, delay_s=0.1)
        started = time.monotonic()
        sock.sendall(b"GET big\r\n")
        header = f"${len(value)}\r\n".encode()
        assert read_exactly(sock, len(header) + len(value) + 2) == header + value + b"\r\n"
        assert 0.2 <= time.monotonic() - started < 1.2


def test_stall_holds_old_and_new_links_then_resumes(proxy: FaultProxy) -> None:
    with connect(proxy) as old:
        assert ping(old) == PONG
        proxy.set(Fault.STALL)
        old.sendall(b"PING\r\n")
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            old.recv(64)
        assert TIMEOUT_S * 0.9 <= time.monotonic() - started < 1.5
        with connect(proxy) as new:  # still accepted: a hung server, not a dead one
            new.sendall(b"PING\r\n")
            with pytest.raises(TimeoutError):
                new.recv(64)
            proxy.clear()
            # What was held goes through once the stall ends, on both links.
            assert read_exactly(new, len(PONG)) == PONG
            assert read_exactly(old, len(PONG)) == PONG


def test_reset_breaks_established_links_and_refuses_new_ones(proxy: FaultProxy) -> None:
    with connect(proxy) as old:
        assert ping(old) == PONG
        proxy.set(Fault.RESET)
        with pytest.raises(ConnectionResetError):
            old.recv(64)
    # The handshake is the kernel's; the proxy resets the connection it accepts.
    # The reset may land while connecting or at the first read: either way it is one.
    with pytest.raises(ConnectionResetError), connect(proxy) as new:
        new.recv(64)
    assert proxy.counters.reset_established == 1
    assert proxy.counters.reset_on_accept == 1
    proxy.clear()
    with connect(proxy) as again:
        assert ping(again) == PONG


def test_bandwidth_paces_each_way_without_a_gap_a_read_timeout_would_see(
    proxy: FaultProxy,
) -> None:
    """50 kB at 100 kB/s each way: about 0.5 s up and 0.5 s down, while every read of
    a 0.5 s-timeout socket gets bytes (a per-read timeout never fires)."""
    value = b"v" * 50_000
    command = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n%s\r\n" % (len(value), value)
    with connect(proxy) as sock:
        proxy.set(Fault.BANDWIDTH, bytes_per_s=100_000)
        assert timed(lambda: ping(sock)) < TIMEOUT_S  # a small command is not held up
        sock.settimeout(3.0)
        up = timed(lambda: (sock.sendall(command), read_exactly(sock, 5)))
        sock.settimeout(TIMEOUT_S)
        reply = f"${len(value)}\r\n".encode() + value + b"\r\n"
        got: list[bytes] = []
        down = timed(
            lambda: (sock.sendall(b"GET k\r\n"), got.append(read_exactly(sock, len(reply))))
        )
        assert got == [reply]
        assert 0.4 <= up < 2.0, up
        assert 0.4 <= down < 2.0, down
        proxy.clear()
        assert timed(lambda: ping(sock)) < TIMEOUT_S


def test_half_open_never_answers_nor_closes_and_stays_dead(proxy: FaultProxy) -> None:
    with connect(proxy) as old:
        assert ping(old) == PONG
        proxy.set(Fault.HALF_OPEN)
        old.sendall(b"PING\r\n")  # the send succeeds: the socket is open
        for _ in range(2):  # a timeout each time, never an EOF (b"") or a reset
            with pytest.raises(TimeoutError):
                old.recv(64)
        with connect(proxy) as new:
            new.sendall(b"PING\r\n")
            with pytest.raises(TimeoutError):
                new.recv(64)
        proxy.clear()
        # A link the fault caught has lost its peer for good; a new one passes.
        old.sendall(b"PING\r\n")
        with pytest.raises(TimeoutError):
            old.recv(64)
        with connect(proxy) as fresh:
            assert ping(fresh) == PONG
    assert proxy.counters.bytes_dropped >= 3 * len(b"PING\r\n")


def test_the_link_limit_resets_one_more(clean_redis: RedisServer) -> None:
    with FaultProxy(clean_redis.port, max_connections=2) as proxy:
        with connect(proxy) as first, connect(proxy) as second:
            assert ping(first) == PONG and ping(second) == PONG
            with pytest.raises(ConnectionResetError), connect(proxy) as third:
                third.recv(64)
        assert proxy.counters.reset_on_accept == 1


def test_an_unreachable_upstream_resets_the_client(tmp_path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    port = server.port
    server.close()  # nothing listens there now
    with FaultProxy(port) as proxy, pytest.raises(ConnectionResetError), connect(proxy) as sock:
        sock.recv(64)


def test_close_closes_every_socket_and_the_thread(clean_redis: RedisServer) -> None:
    proxy = FaultProxy(clean_redis.port)
    with proxy:
        clients = [connect(proxy) for _ in range(3)]
        for sock in clients:
            assert ping(sock) == PONG
        proxy.set(Fault.STALL)  # even links held by a fault are let go
    try:
        for sock in clients:
            assert sock.recv(64) == b""  # closed by the proxy, not left hanging
    finally:
        for sock in clients:
            sock.close()
    assert proxy.open_links == 0
    assert not any(thread.name == "fault-proxy" for thread in threading.enumerate())
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((HOST, proxy.port), timeout=TIMEOUT_S)
