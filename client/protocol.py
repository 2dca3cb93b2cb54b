"""The client's logic, written once and without I/O.

Every operation is a generator that yields the HTTP exchanges it needs, one
at a time, receives each ``Reply``, and returns the method's result::

    operation = protocol.lookup(namespace, tokens)
    call = next(operation)                    # Call("POST", "/v1/namespaces", ...)
    while True:
        reply = <send call with httpx>        # the only line that differs
        call = operation.send(reply)          # ... until StopIteration(result)

``StoreClient`` (blocking) and ``AsyncStoreClient`` (asyncio) only drive
these generators over httpx, so the orchestration is the same for both:
register a namespace once per client, register again and retry once after
``unknown_namespace`` (the daemon restarted), lease -> copy -> release (on
the next get, or after ``RELEASE_DELAY_S``; see ``FinishedLeases``) -> fetch
inline for shared-memory gets, back off from a daemon
that failed, and degrade instead of raising where the engine must not stall
(``client.failures`` says which calls degrade). An exchange that fails is
thrown into the generator at the ``yield`` that asked for it.

Input is validated before the first exchange (keys, chunk layouts, ``out``
buffers), so a caller's mistake raises even when the daemon is down.

Concurrency: one ``ClientProtocol`` serves every thread (or task) of its
client. The namespace set, the shared-memory mapping and the back-off
deadline are each replaced by single assignments, without a lock: the worst
a race can do is register a namespace twice or map a segment twice, both
harmless. The counters are updated under ``_lock``. Shared-memory copies of
large batches of large blocks use one helper thread (``blocks.copy_leased``), and blocks
received as bytes through h11 are verified on another while the next ones
arrive (``blocks.FramesSink``; a blocking transport, which both shells use
for bytes gets when they have one, checksums them as they land,
``client.get_body``): memory bandwidth, not I/O, so they live
here rather than in a shell. A bytes get that fails waits for its
verification in flight before it returns (``FramesSink.settle``), so nothing
writes to the caller's buffers afterwards.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.client.blocks import (
    DEFAULT_VERIFY,
    FramesSink,
    Received,
    Verify,
    tier_of,
)
from kvstore.client.buffers import BufferPool
from kvstore.client.exchange import Call, Operation, Reply, checked, post, store_stats
from kvstore.client.failures import ClientStats, answer_field, from_reply, unavailable
from kvstore.client.finished_leases import RELEASE_DELAY_S, FinishedLeases
from kvstore.client.leased_copy import LeasedCopier
from kvstore.client.put_body import PutBody
from kvstore.errors import (
    BadRequest,
    ConfigError,
    KVStoreError,
    LayoutMismatch,
    RequestTooLarge,
    TierUnavailable,
    UnknownNamespace,
)
from kvstore.keys import ChunkKey, Namespace, TokensOrKeys, keys_of
from kvstore.kinds import TierKind
from kvstore.store.chunk import CachedPrefix, ChunkData, KVChunk, OutData, chunk_bytes
from kvstore.store.out_buffers import OutBuffers, host_arrays
from kvstore.store.stats import StoreStats
from kvstore.throttled_log import ThrottledLog
from kvstore.wire.events import (
    EVENT_CONTENT_TYPE,
    MAX_EVENT_KEYS,
    RequestFinished,
    RequestStarted,
    SessionEvent,
    Trigger,
    event_to_bytes,
)
from kvstore.wire.frames import Seal
from kvstore.wire.messages import API_PREFIX, GetTransfer, keys_to_bytes, namespace_to_json

log = logging.getLogger("kvstore.client")
_LEASE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
# Bytes of plain gets' payload buffers a client keeps for reuse (``client.buffers``).
BUFFER_POOL_BYTES = 256 << 20
@dataclass(frozen=True)
class ClientOptions:
    """How a client talks to its daemon, resolved (``connect`` makes them from a URL and
    its keywords): the token, sent as a bearer header; the time each I/O phase may
    take; whether gets go through shared memory; how long calls degrade without
    trying after the daemon failed one; how shared-memory copies are checked."""

    token: str | None = field(default=None, repr=False)
    timeout_s: float = 2.0
    shm: bool = False
    backoff_s: float = 1.0
    verify: Verify | str = DEFAULT_VERIFY

    def http(self, base_url: str) -> dict[str, Any]:
        """The keywords of the httpx client (either flavour) that carries the calls."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        return {"base_url": base_url, "timeout": self.timeout_s, "headers": headers}

    def protocol(self) -> ClientProtocol:
        return ClientProtocol(shm=self.shm, backoff_s=self.backoff_s, verify=self.verify)


DEFAULTS = ClientOptions()


class ClientProtocol:
    """The state and operations of one client; see the module docstring.

    ``shm``: get DRAM blocks through the daemon's shared-memory arena
    (same host only); otherwise every block travels in the response body.
    It turns off for good if the daemon has no arena or it cannot be mapped.
    A shared-memory get into ``out=`` tensors checked FAST also asks for the
    daemon's HBM blocks as device memory (``client.device``); that turns off
    for good (``device_memory``) if the HBM arena cannot be opened here.
    ``backoff_s``: after a failed exchange, calls degrade at once (no I/O)
    for this long, so a hung daemon costs the engine one timeout, not one
    per call. ``verify``: how a shared-memory copy is checked
    (``client.blocks.Verify``; blocks that travel as bytes are always
    checksummed).
    """

    def __init__(
        self,
        *,
        shm: bool,
        backoff_s: float,
        verify: Verify | str = DEFAULT_VERIFY,
        release_delay_s: float = RELEASE_DELAY_S,
    ) -> None:
        self.shm = shm
        self.backoff_s = backoff_s
        self.release_delay_s = release_delay_s
        try:
            self.verify = Verify(verify)
        except ValueError:
            raise ConfigError(f"verify must be 'fast' or 'full', not {verify!r}") from None
        self._lock = threading.Lock()
        self._stats = ClientStats()
        self._rejected_events = ThrottledLog(log, every_s=60.0)
        self._registered: frozenset[bytes] = frozenset()
        # How this client's puts carry their checksums: the best the daemon listed
        # registering a namespace (``put_seals``), in the header until it says.
        self._seal = Seal.HEADER
        self._down_until = 0.0
        # One worker, so each get's blocks are verified in order, one at a time.
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-verify")
        self._buffers = BufferPool(BUFFER_POOL_BYTES)
        self._leased = LeasedCopier(self.verify, self._buffers)
        self._finished = FinishedLeases()

    def client_stats(self) -> ClientStats:
        with self._lock:
            return self._stats.snapshot()

    @property
    def device_memory(self) -> bool:
        """Whether shared-memory gets into tensors still ask for HBM blocks."""
        return self._leased.device_memory

    def close(self) -> None:
        self._verifier.shutdown(wait=True)
        self._leased.close()

    # -- operations ---------------------------------------------------------

    def lookup(self, namespace: Namespace, tokens_or_keys: TokensOrKeys) -> Operation[CachedPrefix]:
        """How many leading chunks are cached, and the fastest tier holding each."""
        keys = keys_of(namespace, tokens_or_keys)
        nothing = CachedPrefix(namespace.chunk_tokens, (), (), len(keys))
        if not keys:
            return nothing
        path = f"/lookup?namespace={namespace.digest.hex()}"
        content = keys_to_bytes(keys)
        try:
            body = yield from self._namespaced(namespace, lambda: post(path, content=content))
            run = answer_field(body, "num_chunks", int)
            tiers = _tier_runs(answer_field(body, "tier_runs", list))
            load = body.get("load_chunks")  # None: all of them (and from older daemons)
            if not 0 <= run <= len(keys) or len(tiers) != run or not _load_ok(load, run):
                raise unavailable(f"malformed lookup answer {body!r}")
        except TierUnavailable:
            with self._lock:
                self._stats.lookups_failed += 1
            return nothing
        return CachedPrefix(namespace.chunk_tokens, tuple(keys[:run]), tiers, len(keys), load)

    def put(
        self,
        namespace: Namespace,
        tokens_or_keys: TokensOrKeys,
        kv_chunks: Sequence[ChunkData | None],
        *,
        session: str | None = None,
    ) -> Operation[int]:
        """Store chunk ``i`` under the ``i``-th chunk key; return how many were newly stored."""
        keys = keys_of(namespace, tokens_or_keys)
        if len(kv_chunks) > len(keys):
            raise LayoutMismatch(
                f"{len(kv_chunks)} chunks given for {len(keys)} full chunks of tokens"
            )
        if not kv_chunks:
            return 0
        payloads = _put_payloads(namespace, kv_chunks)

        def put_call() -> Call:
            # Made after the namespace is registered: the answer says who seals.
            body = PutBody(namespace, keys, payloads, session, seal=self._seal)
            return post("/put", body=body)

        try:
            answer = yield from self._namespaced(namespace, put_call)
            return answer_field(answer, "stored", int)
        except TierUnavailable:
            with self._lock:
                self._stats.puts_dropped += 1
            return 0

    def get(
        self,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        *,
        out: Sequence[OutData] | None = None,
    ) -> Operation[list[KVChunk | None]]:
        """The verified chunk for each key, or ``None``; with ``out``, payloads land in
        the caller's buffers (see ``TieredStore.get``)."""
        keys = list(keys)
        buffers = None if out is None else OutBuffers.of(out, namespace.layout, len(keys))
        if not keys:
            return []
        try:
            if self.shm:
                received = yield from self._get_shared(namespace, keys, buffers)
            else:
                received = yield from self._get_bytes(namespace, keys, host_arrays(buffers))
        except TierUnavailable:
            with self._lock:
                self._stats.gets_failed += 1
            return [None] * len(keys)
        if received.corrupt:
            with self._lock:
                self._stats.corrupt_blocks += received.corrupt
        return received.chunks if buffers is None else buffers.deliver(received.chunks)

    def delete(self, namespace: Namespace, keys: Sequence[ChunkKey]) -> Operation[int]:
        """Remove keys from every tier; raises ``TierUnavailable`` if the daemon cannot."""
        if not keys:
            return 0
        request = {"namespace": namespace.digest.hex(), "keys": [key.hex() for key in keys]}
        answer = yield from self._namespaced(namespace, lambda: post("/delete", request))
        return answer_field(answer, "deleted", int)

    def stats(self) -> Operation[StoreStats]:
        """The daemon's store counters; raises ``TierUnavailable`` if it cannot answer."""
        answer = yield from self._send(Call("GET", f"{API_PREFIX}/stats"))
        return store_stats(answer_field(answer, "store", dict))

    def request_started(
        self,
        session: str,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        trigger: Trigger = Trigger.USER,
        time: float | None = None,
        idle_since: float | None = None,
        user: str | None = None,
        namespace: Namespace | None = None,
        keys: Sequence[ChunkKey] = (),
    ) -> Operation[None]:
        """A request of ``session`` began (``kvstore.wire.events``); ``time`` defaults to now.
        ``idle_since``: when its previous request finished, if that may have been on
        another host (an engine that moves sessions between daemons knows). ``user``: who
        drives the session, so the predictor can tell one person's sessions apart.
        ``namespace``, ``keys``: the prompt's chain."""
        event = RequestStarted(
            session,
            trigger,
            prompt_tokens,
            cached_tokens,
            _now(time),
            *_chain(namespace, keys),
            idle_since=idle_since,
            user=user,
        )
        yield from self._report(event)

    def request_finished(
        self,
        session: str,
        *,
        steps: int,
        output_tokens: int,
        context_tokens: int,
        loaded_tokens: int,
        recomputed_tokens: int,
        tool_running: bool = False,
        time: float | None = None,
        namespace: Namespace | None = None,
        keys: Sequence[ChunkKey] = (),
    ) -> Operation[None]:
        """A request of ``session`` ended (``kvstore.wire.events``); ``time`` defaults to now.
        ``namespace``, ``keys``: the chain of its prompt and output."""
        event = RequestFinished(
            session,
            steps,
            output_tokens,
            context_tokens,
            tool_running,
            loaded_tokens,
            recomputed_tokens,
            _now(time),
            *_chain(namespace, keys),
        )
        yield from self._report(event)

    def _report(self, event: SessionEvent) -> Operation[None]:
        try:
            if event.keys:  # raw keys: no hex to write on the engine's interpreter
                call = post(
                    "/events",
                    content=event_to_bytes(event),
                    content_type=EVENT_CONTENT_TYPE,
                    retry=False,
                )
            else:
                call = post("/events", event.to_json(), retry=False)
            yield from self._send(call)
        except TierUnavailable:
            with self._lock:
                self._stats.events_dropped += 1
        except BadRequest as refused:  # advice, not a request: never raised into the engine
            with self._lock:
                self._stats.events_rejected += 1
            self._rejected_events.warning("the daemon refused a session event: %s", refused)

    # -- gets -----------------------------------------------------------------

    def _get_bytes(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        out: list[np.ndarray] | None,
        *,
        continues: bool = False,
    ) -> Operation[Received]:
        """A get of bytes over the socket; ``continues``: it reads what a shared-memory
        get left inline (so the daemon counts one get, not two)."""
        sink = FramesSink(namespace, keys, out, self._buffers, self._verifier)
        request = _get_request(namespace, keys, GetTransfer.BYTES, self._finished.take())
        if continues:
            request["continues"] = True
        try:
            yield from self._namespaced(namespace, lambda: post("/get", request, sink=sink))
        except BaseException:
            sink.settle()
            raise
        return sink.received

    def _get_shared(
        self, namespace: Namespace, keys: list[ChunkKey], buffers: OutBuffers | None
    ) -> Operation[Received]:
        """Lease the DRAM blocks (and, into ``out=`` tensors, the HBM ones), copy them
        out of the mapped arenas, release the lease (without waiting for the answer),
        then fetch the blocks held elsewhere, or that could not be copied, as bytes."""
        out = host_arrays(buffers)
        if self._leased.arena is None:
            yield from self._map_arena()
            if self._leased.arena is None:  # nothing to map: bytes from now on
                self.shm = False
                return (yield from self._get_bytes(namespace, keys, out))
        request = _get_request(namespace, keys, GetTransfer.SHM, self._finished.take())
        # Device copies are proven by generations alone (FAST), into the caller's tensors.
        tensors = buffers.tensors if buffers is not None and self.verify is Verify.FAST else None
        if tensors is not None and self.device_memory:
            request["device_memory"] = True
        lease = yield from self._namespaced(namespace, lambda: post("/get", request))
        try:
            received, fallbacks = self._leased.copy(lease, namespace, keys, buffers)
            if fallbacks:
                with self._lock:
                    self._stats.device_fallbacks += fallbacks
        finally:
            # No yield above, so this release cannot run while the operation is
            # being closed; a lease never released expires on the daemon.
            yield from self._release(lease)
        if received.inline:
            inline_out = [out[i] for i in received.inline] if out is not None else None
            fetched = yield from self._get_bytes(
                namespace, [keys[i] for i in received.inline], inline_out, continues=True
            )
            for position, index in enumerate(received.inline):
                received.chunks[index] = fetched.chunks[position]
            received.corrupt += fetched.corrupt
        return received

    def _map_arena(self) -> Operation[None]:
        reply = yield from self._exchange(Call("GET", f"{API_PREFIX}/shm"))
        if reply.status == 404:
            log.info("the daemon has no DRAM arena to share; getting blocks as bytes")
            return
        try:
            self._leased.open_arena(answer_field(checked(reply), "name", str))
        except TierUnavailable as error:  # e.g. another /dev/shm (a container)
            log.warning("getting blocks as bytes: %s", error)

    def _release(self, lease: Any) -> Operation[None]:
        """Give a lease back; the get does not wait for the answer (the copy is done).

        Where the daemon offers it, the lease is left for the next get to carry
        (``FinishedLeases``), with a release call delayed by ``release_delay_s``
        in case none comes. A release that fails costs nothing but its pins
        until the lease expires (the daemon's ``lease_ttl_s``); so does a get
        that carried it and failed.
        """
        lease_id = lease.get("lease") if isinstance(lease, dict) else None
        if not isinstance(lease_id, str) or not _LEASE_ID.fullmatch(lease_id):
            return
        if lease.get("release_with_get") is True:
            self._finished.add(lease_id)
            call = post(
                f"/leases/{lease_id}/release",
                wait=False,
                delay_s=self.release_delay_s,
                due=functools.partial(self._finished.claim, lease_id),
            )
        else:  # a daemon that does not take releases with a get
            call = post(f"/leases/{lease_id}/release", wait=False)
        try:
            reply = yield from self._exchange(call)
            if reply.status != 202:  # answered in place, not sent in the background
                checked(reply)
        except KVStoreError as error:
            log.debug("lease %s not released (it will expire): %s", lease_id, error)

    # -- exchanges --------------------------------------------------------------

    def _namespaced(self, namespace: Namespace, make: Callable[[], Call]) -> Operation[Any]:
        """Send a call that names ``namespace``, registering it first if this client
        has not; after ``unknown_namespace`` register again and retry once."""
        if namespace.digest not in self._registered:
            yield from self._register(namespace)
        try:
            return (yield from self._send(make()))
        except UnknownNamespace:
            self._registered -= {namespace.digest}
        yield from self._register(namespace)
        return (yield from self._send(make()))

    def _register(self, namespace: Namespace) -> Operation[None]:
        answer = yield from self._send(post("/namespaces", namespace_to_json(namespace)))
        digest = answer_field(answer, "namespace", str)
        if digest != namespace.digest.hex():
            raise KVStoreError(
                f"the daemon names namespace {namespace.model!r} {digest}, this client "
                f"{namespace.digest.hex()}: are they different kvstore versions?"
            )
        self._seal = _best_seal(answer.get("put_seals"))
        self._registered |= {namespace.digest}

    def _send(self, call: Call) -> Operation[Any]:
        """One exchange: its JSON answer (``None`` if it streamed into the sink), or
        the error it stands for (``client.failures``)."""
        return checked((yield from self._exchange(call)))

    def _exchange(self, call: Call) -> Operation[Reply]:
        """One exchange, unless the daemon failed less than ``backoff_s`` ago; a
        failure (thrown in by the shell, or a 5xx) starts a new back-off."""
        if time.monotonic() < self._down_until:
            raise unavailable("failed recently; not retried until its back-off ends")
        try:
            reply = yield call
            if reply.status >= 500:
                raise from_reply(reply.status, reply.content)
        except TierUnavailable:
            self._down_until = time.monotonic() + self.backoff_s
            raise
        return reply


# -- requests and answers ---------------------------------------------------------


def _get_request(
    namespace: Namespace, keys: list[ChunkKey], transfer: GetTransfer, release: list[str]
) -> dict[str, Any]:
    """A get's body; ``release``: finished leases it gives back (``FinishedLeases``)."""
    request: dict[str, Any] = {
        "namespace": namespace.digest.hex(),
        "keys": [key.hex() for key in keys],
        "transfer": transfer.value,
    }
    if release:  # only ever ids of a daemon that offered it: no field for any other
        request["release"] = release
    return request


def _best_seal(offered: Any) -> Seal:
    """The cheapest way to seal puts among those a daemon offers (``put_seals``):
    by the daemon, then trailing checksums, else (an older daemon) in the header."""
    names = offered if isinstance(offered, list) else []
    return next((seal for seal in (Seal.DAEMON, Seal.TRAILER) if seal.value in names), Seal.HEADER)


def _put_payloads(
    namespace: Namespace, kv_chunks: Sequence[ChunkData | None]
) -> list[memoryview | None]:
    """A put's payloads, every chunk validated (``chunk_bytes``) now, before anything
    is sent: views of the caller's data, not copies (CPU tensors), which
    ``PutBody`` frames as it sends them."""
    return [None if chunk is None else chunk_bytes(chunk, namespace.layout) for chunk in kv_chunks]


def _tier_runs(runs: list[Any]) -> tuple[TierKind, ...]:
    """A raw lookup's ``tier_runs`` (``[[label, count], ...]``) as one tier per chunk."""
    tiers: list[TierKind] = []
    for run in runs:
        if not (isinstance(run, list) and len(run) == 2 and isinstance(run[1], int)):
            raise unavailable(f"malformed lookup answer: tier run {run!r}")
        tiers += [tier_of(run[0])] * max(0, run[1])
    return tuple(tiers)


def _load_ok(load: Any, run: int) -> bool:
    """A lookup's ``load_chunks``: absent (load them all) or a count up to the run."""
    return load is None or (
        isinstance(load, int) and not isinstance(load, bool) and 0 <= load <= run
    )


def _now(when: float | None) -> float:
    return time.time() if when is None else when


def _chain(
    namespace: Namespace | None, keys: Sequence[ChunkKey]
) -> tuple[bytes | None, tuple[ChunkKey, ...]]:
    """An event's chain as the wire carries it: the namespace's digest and the keys."""
    if keys and namespace is None:
        raise BadRequest("a session event's keys need the namespace they belong to")
    if len(keys) > MAX_EVENT_KEYS:
        raise RequestTooLarge(
            f"a session event carries at most {MAX_EVENT_KEYS} keys, not {len(keys)}"
        )
    return (None if namespace is None else namespace.digest), tuple(keys)
