"""The client against real stores: the same scenarios for both flavours (sync, async)
over every transport (an embedded store; a ``kvstore serve`` daemon over its Unix
socket with bytes or shared-memory gets, and over TCP with a token)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import kv
from support.clients import FLAVOURS, opened, run_in_threads
from support.daemon import Daemon

from kvstore import (
    KVLayout,
    KVStoreError,
    LayoutMismatch,
    Namespace,
    RequestTooLarge,
    TierKind,
    chunk_keys,
    connect,
)
from kvstore.client import ClientStats
from kvstore.client.address import TOKEN_ENV
from kvstore.store.chunk import ChunkPages
from kvstore.store.stats import StoreStats

DAEMON_TRANSPORTS = ("unix-bytes", "unix-shm", "tcp")
EMBEDDED_TOML = """\
data_dir = "{root}"
max_batch_chunks = 1024
max_lookup_chunks = 2048

[tiers.dram]
capacity = "16MiB"

[tiers.ssd]
capacity = "64MiB"
"""


@dataclass
class Target:
    """Where a scenario connects: a URL, ``connect`` options, and the daemon if any."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)
    daemon: Daemon | None = None


def daemon_target(daemon: Daemon, transport: str, **options: Any) -> Target:
    if transport == "tcp":
        assert daemon.tcp_url is not None
        return Target(daemon.tcp_url, {"token": daemon.token, **options}, daemon)
    if transport == "unix-shm-full":  # shared memory, every copy checksummed
        return Target(daemon.url, {"transfer": "shm", "verify": "full", **options}, daemon)
    return Target(daemon.url, {"transfer": transport.removeprefix("unix-"), **options}, daemon)


@pytest.fixture(params=FLAVOURS)
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=("embedded", *DAEMON_TRANSPORTS))
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    if request.param == "embedded":
        config = tmp_path / "store.toml"
        config.write_text(EMBEDDED_TOML.format(root=tmp_path))
        return Target(f"embedded://{config}")
    return daemon_target(request.getfixturevalue("daemon"), request.param)


@pytest.fixture
def ns(request: pytest.FixtureRequest) -> Namespace:
    """A namespace of this test's own: the session's daemon keeps its data."""
    return kv.namespace(salt=request.node.name)


def same_bytes(chunk: Any, tensor: torch.Tensor) -> bool:
    return chunk is not None and bytes(chunk.payload) == tensor.view(torch.uint8).numpy().tobytes()


def daemon_stats(daemon: Daemon) -> dict[str, Any]:
    with daemon.client() as http:
        return dict(http.get("/v1/stats").json()["daemon"])


def lease_releases(daemon: Daemon) -> float:
    """Lease releases the daemon answered, from its Prometheus counters."""
    with daemon.client() as http:
        text = http.get("/metrics").text
    pattern = re.compile(r'^kvstore_http_requests_total\{[^}]*route="[^"]*release"[^}]*\} (\S+)$')
    return sum(float(match.group(1)) for match in map(pattern.match, text.splitlines()) if match)


# -- the store's methods, every flavour over every transport --------------------------


def test_put_lookup_get_round_trip_bit_for_bit(flavour: str, target: Target, ns: Namespace):
    tokens = np.concatenate([kv.tokens(4), np.arange(5)])  # 4 full chunks and a partial one
    chunks = kv.chunks(6, seed=1)
    releases = lease_releases(target.daemon) if target.daemon else 0.0

    async def scenario() -> None:
        async with opened(flavour, target.url, **target.options) as store:
            assert (await store.lookup(ns, tokens)).num_tokens == 0
            assert await store.put(ns, tokens, chunks[:4], session="agent-1") == 4
            prefix = await store.lookup(ns, tokens)
            assert (prefix.num_chunks, prefix.total_chunks) == (4, 4)
            assert prefix.tiers == (TierKind.DRAM,) * 4
            assert prefix.keys == tuple(chunk_keys(ns, tokens))
            got = await store.get(ns, prefix.keys)
            assert [chunk.key for chunk in got] == list(prefix.keys)
            assert all(same_bytes(c, t) for c, t in zip(got, chunks, strict=False))
            assert torch.equal(got[3].tensor(), chunks[3])
            assert await store.put(ns, tokens, chunks[:4]) == 0  # a key names its content
            longer = kv.tokens(6)
            assert (await store.lookup(ns, longer)).num_chunks == 4
            assert await store.put(ns, longer, [None] * 4 + chunks[4:]) == 2
            assert (await store.lookup(ns, longer)).num_chunks == 6
            assert await store.client_stats() == ClientStats()

    asyncio.run(scenario())
    if target.daemon is not None:  # the shared-memory path is the one taken, and only there
        taken = lease_releases(target.daemon) > releases
        assert taken is (target.options.get("transfer") == "shm")
        assert daemon_stats(target.daemon)["leases_outstanding"] == 0


def test_get_into_out_buffers(flavour: str, target: Target, ns: Namespace) -> None:
    tokens, chunks = kv.tokens(3), kv.chunks(3, seed=2)
    missing = chunk_keys(ns, kv.tokens(1, start=90_000))

    async def scenario() -> None:
        async with opened(flavour, target.url, **target.options) as store:
            await store.put(ns, tokens, chunks)
            keys = chunk_keys(ns, tokens) + missing
            out = [torch.empty(kv.LAYOUT.chunk_shape, dtype=torch.float16) for _ in keys]
            got = await store.get(ns, keys, out=out)
            assert got[3] is None
            for chunk, buffer, expected in zip(got, out, chunks, strict=False):
                assert torch.equal(buffer, expected)
                payload = np.frombuffer(chunk.payload, dtype=np.uint8)
                assert np.shares_memory(payload, buffer.view(torch.uint8).numpy())
            with pytest.raises(LayoutMismatch):
                await store.get(ns, keys, out=out[:2])

    asyncio.run(scenario())


def test_get_into_pages(flavour: str, target: Target, ns: Namespace) -> None:
    """Each chunk lands in its pages, over every transport (straight from shared memory,
    through staging elsewhere); a miss leaves its pages as they were."""
    tokens, chunks = kv.tokens(2), kv.chunks(2, seed=4)
    missing = chunk_keys(ns, kv.tokens(1, start=91_000))
    cache = torch.zeros((2, 3, kv.LAYOUT.chunk_nbytes // 2), dtype=torch.uint8)  # 2 layers

    async def scenario() -> None:
        async with opened(flavour, target.url, **target.options) as store:
            await store.put(ns, tokens, chunks)
            keys = chunk_keys(ns, tokens) + missing
            rows = [layer.numpy() for layer in cache]  # a block is row b of every layer
            pages = [ChunkPages((rows[0][block], rows[1][block])) for block in (2, 0, 1)]
            got = await store.get(ns, keys, out=pages)
            assert got[2] is None and not cache[:, 1].any()
            for block, chunk, expected in zip((2, 0), got, chunks, strict=False):
                assert chunk is not None and chunk.payload.nbytes == 0
                assert torch.equal(chunk.tensor(), expected)
                landed = cache[:, block].reshape(-1)
                assert torch.equal(landed, expected.view(torch.uint8).reshape(-1))

    asyncio.run(scenario())


def test_delete(flavour: str, target: Target, ns: Namespace) -> None:
    tokens, chunks = kv.tokens(4), kv.chunks(4, seed=3)
    keys = chunk_keys(ns, tokens)

    async def scenario() -> None:
        async with opened(flavour, target.url, **target.options) as store:
            await store.put(ns, tokens, chunks)
            assert await store.delete(ns, keys[2:]) == 2
            assert (await store.lookup(ns, tokens)).num_chunks == 2
            got = await store.get(ns, keys)
            assert [same_bytes(c, t) for c, t in zip(got, chunks, strict=True)] == [
                True,
                True,
                False,
                False,
            ]
            assert await store.delete(ns, keys[2:]) == 0

    asyncio.run(scenario())


def test_events_and_stats(flavour: str, target: Target, ns: Namespace) -> None:
    received = daemon_stats(target.daemon)["events_received"] if target.daemon else 0

    async def scenario() -> None:
        async with opened(flavour, target.url, **target.options) as store:
            before = await store.stats()
            await store.lookup(ns, kv.tokens(2))
            after = await store.stats()
            assert isinstance(after, StoreStats) and TierKind.DRAM in after.tiers
            assert after.lookups == before.lookups + 1
            await store.request_started("agent-7", prompt_tokens=120, cached_tokens=96)
            await store.request_finished(
                "agent-7",
                steps=3,
                output_tokens=20,
                context_tokens=140,
                loaded_tokens=96,
                recomputed_tokens=24,
                tool_running=True,
            )
            assert await store.client_stats() == ClientStats()

    asyncio.run(scenario())
    if target.daemon is not None:
        assert daemon_stats(target.daemon)["events_received"] == received + 2


def test_an_event_the_daemon_refuses_is_dropped_and_counted_never_raised(
    flavour: str, daemon: Daemon
) -> None:
    """An engine whose clock is a day off: its events are refused, its requests go on."""
    target = daemon_target(daemon, "unix-bytes")

    async def scenario() -> None:
        async with opened(flavour, target.url, **target.options) as store:
            await store.request_started(
                "skewed", prompt_tokens=10, cached_tokens=0, time=time.time() + 86_400
            )
            stats = await store.client_stats()
            assert (stats.events_rejected, stats.events_dropped) == (1, 0)

    asyncio.run(scenario())


def test_caller_mistakes_raise(flavour: str, target: Target, ns: Namespace) -> None:
    async def scenario() -> None:
        async with opened(flavour, target.url, **target.options) as store:
            with pytest.raises(RequestTooLarge):  # the stores allow 2048 keys per lookup
                await store.lookup(ns, kv.tokens(2049))
            with pytest.raises(RequestTooLarge):  # and 1024 chunks per get
                await store.get(ns, chunk_keys(ns, kv.tokens(1025)))
            wrong_dtype = [torch.zeros(kv.LAYOUT.chunk_shape, dtype=torch.float32)]
            with pytest.raises(LayoutMismatch):
                await store.put(ns, kv.tokens(1), wrong_dtype)
            keys, shape = chunk_keys(ns, kv.tokens(1)), kv.LAYOUT.chunk_shape
            for out, message in (
                (wrong_dtype, "contiguous float16 tensor"),
                ([torch.zeros(7, dtype=torch.float16)], "one chunk needs"),
                ([torch.zeros(shape, dtype=torch.float16)[:, 0]], "contiguous"),
                ([torch.empty(shape, dtype=torch.float16, device="meta")], "'meta'"),
            ):
                with pytest.raises(LayoutMismatch, match=message):
                    await store.get(ns, keys, out=out)

    asyncio.run(scenario())


# 3 MiB chunks: bodies far past the socket buffers (partial sends, many reads per
# block) and leases large enough to be copied by two threads.
BIG_LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, chunk_tokens=192)


@pytest.mark.parametrize("transport", (*DAEMON_TRANSPORTS, "unix-shm-full"))
def test_multi_mib_chunks_round_trip_bit_for_bit(
    flavour: str, transport: str, daemon: Daemon, request: pytest.FixtureRequest
) -> None:
    target = daemon_target(daemon, transport)
    ns = Namespace("big-chunks", BIG_LAYOUT, tenant_salt=request.node.name)
    tokens = np.arange(3 * BIG_LAYOUT.chunk_tokens)
    generator = torch.Generator().manual_seed(8)
    chunks = [
        torch.randn(BIG_LAYOUT.chunk_shape, generator=generator).to(torch.bfloat16)
        for _ in range(3)
    ]
    keys = chunk_keys(ns, tokens)

    async def scenario() -> None:
        async with opened(flavour, target.url, **target.options) as store:
            assert await store.put(ns, tokens, chunks) == 3
            for _ in range(2):  # the second time in reused buffers
                got = await store.get(ns, keys)
                assert all(same_bytes(c, t) for c, t in zip(got, chunks, strict=True))
                del got
            out = [torch.empty_like(chunk) for chunk in chunks]
            got = await store.get(ns, keys, out=out)
            assert all(
                torch.equal(buffer, chunk) for buffer, chunk in zip(out, chunks, strict=True)
            )
            for chunk, buffer in zip(got, out, strict=True):
                payload = np.frombuffer(chunk.payload, dtype=np.uint8)
                assert np.shares_memory(payload, buffer.view(torch.uint8).numpy())
            assert await store.client_stats() == ClientStats()

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", ("unix-bytes", "tcp"))
def test_a_cancelled_async_get_returns_only_once_nothing_writes_to_its_buffers(
    transport: str, daemon: Daemon, request: pytest.FixtureRequest
) -> None:
    """An asyncio bytes get reads its body on a worker thread; cancelled mid-body, it
    still waits for that thread, so the caller's buffers are its own again."""
    target = daemon_target(daemon, transport)
    ns = Namespace("cancelled", BIG_LAYOUT, tenant_salt=request.node.name)
    count = 16  # 48 MiB: far more than one loop turn's worth
    tokens = np.arange(count * BIG_LAYOUT.chunk_tokens)
    chunks = [
        torch.full(BIG_LAYOUT.chunk_shape, float(i), dtype=torch.bfloat16) for i in range(count)
    ]
    keys = chunk_keys(ns, tokens)

    async def scenario() -> None:
        async with opened("async", target.url, timeout_s=30, **target.options) as store:
            assert await store.put(ns, tokens, chunks) == count
            out = [torch.zeros_like(chunk) for chunk in chunks]
            getting = asyncio.ensure_future(store.get(ns, keys, out=out))
            await asyncio.sleep(0.005)
            getting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await getting
            landed = [buffer.clone() for buffer in out]
            await asyncio.sleep(0.2)
            assert all(torch.equal(a, b) for a, b in zip(out, landed, strict=True))
            got = await store.get(ns, keys, out=out)  # and the client carries on
            assert all(chunk is not None for chunk in got)
            assert all(torch.equal(a, b) for a, b in zip(out, chunks, strict=True))

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", ("unix-bytes", "tcp"))
def test_a_cancelled_async_put_returns_only_once_nothing_reads_its_chunks(
    transport: str, daemon: Daemon, request: pytest.FixtureRequest
) -> None:
    """An asyncio put sends its body on a worker thread; cancelled mid-body, it still
    waits for that thread, so what the caller writes into its tensors afterwards
    never reaches the store under the old keys."""
    target = daemon_target(daemon, transport)
    ns = Namespace("cancelled-put", BIG_LAYOUT, tenant_salt=request.node.name)
    count = 16
    tokens = np.arange(count * BIG_LAYOUT.chunk_tokens)
    chunks = [
        torch.full(BIG_LAYOUT.chunk_shape, float(i + 1), dtype=torch.bfloat16) for i in range(count)
    ]
    originals = [chunk.clone() for chunk in chunks]
    keys = chunk_keys(ns, tokens)

    async def scenario() -> None:
        async with opened("async", target.url, timeout_s=30, **target.options) as store:
            await store.lookup(ns, keys)  # registered: the put's first request is the body
            putting = asyncio.ensure_future(store.put(ns, tokens, chunks))
            await asyncio.sleep(0.005)
            putting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await putting
            for chunk in chunks:
                chunk.zero_()  # the caller's buffers are its own again
            await asyncio.sleep(0.5)  # a put still sending in the background is done by now
            got = await store.get(ns, keys)
            for chunk, original in zip(got, originals, strict=True):
                assert chunk is None or same_bytes(chunk, original)

    asyncio.run(scenario())


def test_a_finished_lease_rides_on_the_next_get_or_goes_back_after_a_delay(
    flavour: str, daemon: Daemon, ns: Namespace
) -> None:
    """Shared-memory gets in a row cost one request each: each gives back the lease
    of the one before in its body, with no release request; the last lease goes
    back by a request of its own once ``release_delay_s`` has passed, or at
    ``close``, whichever comes first."""
    target = daemon_target(daemon, "unix-shm")
    tokens, chunks = kv.tokens(3), kv.chunks(3, seed=5)
    keys = chunk_keys(ns, tokens)
    held = daemon_stats(daemon)["leases_outstanding"]

    def outstanding() -> int:
        return int(daemon_stats(daemon)["leases_outstanding"]) - held

    async def scenario() -> None:
        async with opened(flavour, target.url, **target.options) as store:
            store.client._protocol.release_delay_s = 1.0
            await store.put(ns, tokens, chunks)
            releases = lease_releases(daemon)
            for _ in range(3):
                got = await store.get(ns, keys)
                assert all(same_bytes(c, t) for c, t in zip(got, chunks, strict=True))
            assert outstanding() == 1 and lease_releases(daemon) == releases
            deadline = time.monotonic() + 10.0
            while outstanding() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the async flavour's timer runs on this loop
            assert outstanding() == 0 and lease_releases(daemon) == releases + 1
            store.client._protocol.release_delay_s = 60.0
            await store.get(ns, keys)
            assert outstanding() == 1
        assert outstanding() == 0  # close sent it at once

    asyncio.run(scenario())


# -- many clients at once --------------------------------------------------------------


@pytest.mark.parametrize("transport", DAEMON_TRANSPORTS)
def test_32_concurrent_clients_get_every_byte_right(
    flavour: str, transport: str, daemon: Daemon, ns: Namespace
) -> None:
    """32 clients, each on its own thread (sync) or task (async), put, look up and get
    chains of their own and one chain they all share, verifying every byte."""
    target = daemon_target(daemon, transport)
    shared_tokens, shared_chunks = kv.tokens(4, start=1_000_000), kv.chunks(4, seed=99)

    async def worker(index: int) -> None:
        async with opened(flavour, target.url, **target.options) as store:
            for round_ in range(3):
                tokens = kv.tokens(3, start=(index * 10 + round_) * 1000)
                chunks = kv.chunks(3, seed=index * 10 + round_)
                for chain, data in ((tokens, chunks), (shared_tokens, shared_chunks)):
                    await store.put(ns, chain, data, session=f"worker-{index}")
                    prefix = await store.lookup(ns, chain)
                    assert prefix.num_chunks == len(data)
                    got = await store.get(ns, prefix.keys)
                    assert all(same_bytes(c, t) for c, t in zip(got, data, strict=True))
            assert await store.client_stats() == ClientStats()

    if flavour == "sync":
        run_in_threads(32, worker)
    else:

        async def all_tasks() -> None:
            await asyncio.gather(*(worker(index) for index in range(32)))

        asyncio.run(all_tasks())


# -- a daemon that stops answering, dies, comes back ---------------------------------


TIMEOUT_S, BACKOFF_S = 0.5, 0.2
MARGIN_S = 1.0


async def timed(call: Any) -> tuple[Any, float]:
    start = time.monotonic()
    result = await call
    return result, time.monotonic() - start


@pytest.mark.parametrize("transport", ["unix-shm", "tcp"])
def test_a_stopped_daemon_costs_a_bounded_wait_then_the_client_carries_on(
    flavour: str, transport: str, daemon: Daemon, ns: Namespace
) -> None:
    """SIGSTOP: connections are accepted by the kernel, answers never come. Every call
    degrades within its timeout; after SIGCONT the same client works again."""
    target = daemon_target(daemon, transport, timeout_s=TIMEOUT_S, backoff_s=BACKOFF_S)
    tokens, chunks = kv.tokens(3), kv.chunks(3, seed=4)
    assert daemon.proc is not None
    proc = daemon.proc

    async def scenario() -> None:
        async with opened(flavour, target.url, **target.options) as store:
            await store.put(ns, tokens, chunks)
            keys = (await store.lookup(ns, tokens)).keys
            proc.send_signal(signal.SIGSTOP)
            try:
                prefix, waited = await timed(store.lookup(ns, tokens))
                assert prefix.num_tokens == 0 and waited < TIMEOUT_S + MARGIN_S
                await asyncio.sleep(BACKOFF_S)
                got, waited = await timed(store.get(ns, keys))
                assert got == [None] * 3 and waited < TIMEOUT_S + MARGIN_S
                await asyncio.sleep(BACKOFF_S)
                stored, waited = await timed(store.put(ns, kv.tokens(2, start=7), kv.chunks(2)))
                assert stored == 0 and waited < TIMEOUT_S + MARGIN_S
                _, waited = await timed(
                    store.request_started("s", prompt_tokens=1, cached_tokens=0)
                )
                assert waited < MARGIN_S  # within the back-off: dropped without trying
            finally:
                proc.send_signal(signal.SIGCONT)
            await asyncio.sleep(BACKOFF_S)
            got = await store.get(ns, keys)
            assert all(same_bytes(c, t) for c, t in zip(got, chunks, strict=True))
            stats = await store.client_stats()
            assert (stats.lookups_failed, stats.gets_failed, stats.puts_dropped) == (1, 1, 1)
            assert stats.events_dropped == 1

    asyncio.run(scenario())


def test_a_restarted_daemon_is_found_again_and_the_namespace_registered_again(
    flavour: str, daemon_factory: Any, ns: Namespace
) -> None:
    """SIGKILL, then a new daemon on the same socket: a new shared-memory segment and
    no namespaces. The client's dead keep-alive connections, its registration and its
    mapping are all renewed without the caller noticing (over shared memory, the path
    with the most state; TCP reconnects are covered by the SIGSTOP test)."""
    private = daemon_factory()
    target = daemon_target(private, "unix-shm", timeout_s=TIMEOUT_S, backoff_s=BACKOFF_S)
    tokens, chunks = kv.tokens(3), kv.chunks(3, seed=5)
    segment = daemon_stats(private)["shared_memory"]

    async def scenario() -> None:
        async with opened(flavour, target.url, **target.options) as store:
            assert await store.put(ns, tokens, chunks) == 3
            assert (await store.lookup(ns, tokens)).num_chunks == 3
            private.kill()
            # The fixture polls the socket while the daemon starts again; a stale
            # socket file would only make it poll a refusing socket.
            private.socket_path.unlink(missing_ok=True)
            prefix, waited = await timed(store.lookup(ns, tokens))
            assert prefix.num_tokens == 0 and waited < TIMEOUT_S
            private.start()
            await asyncio.sleep(BACKOFF_S)
            # A new daemon: DRAM is empty and it has never heard of the namespace.
            assert (await store.lookup(ns, tokens)).num_tokens == 0
            assert await store.put(ns, tokens, chunks) == 3
            prefix = await store.lookup(ns, tokens)
            got = await store.get(ns, prefix.keys)
            assert all(same_bytes(c, t) for c, t in zip(got, chunks, strict=True))
            assert (await store.client_stats()).lookups_failed == 1

    asyncio.run(scenario())
    assert daemon_stats(private)["shared_memory"] != segment


# -- TCP needs the token -------------------------------------------------------------------


def test_a_wrong_or_missing_token_raises_at_the_first_call(
    flavour: str, daemon: Daemon, ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert daemon.tcp_url is not None
    monkeypatch.delenv(TOKEN_ENV, raising=False)

    async def scenario() -> None:
        for token in ("wrong", None):
            async with opened(flavour, daemon.tcp_url, token=token) as store:
                with pytest.raises(KVStoreError, match="unauthorized"):
                    await store.lookup(ns, kv.tokens(1))
        monkeypatch.setenv(TOKEN_ENV, daemon.token or "")
        async with opened(flavour, daemon.tcp_url) as store:
            assert (await store.lookup(ns, kv.tokens(1))).num_tokens == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", ["unix-shm", "unix-bytes"])
def test_a_get_counts_once_with_its_misses_whatever_its_transfer(
    transport: str, daemon: Daemon, ns: Namespace
) -> None:
    target = daemon_target(daemon, transport)
    with connect(target.url, **target.options) as store:
        store.put(ns, kv.tokens(3), kv.chunks(3))
        keys = store.lookup(ns, kv.tokens(3)).keys
        absent = chunk_keys(ns, kv.tokens(1, start=70_000))
        before = store.stats()
        got = store.get(ns, [*keys, *absent])
        after = store.stats()
    assert [chunk is not None for chunk in got] == [True, True, True, False]
    assert (after.gets - before.gets, after.get_misses - before.get_misses) == (1, 1)
