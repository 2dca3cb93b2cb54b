"""The ``/v1`` KV routes (docs/http_api.md): namespaces, lookup, get, leases, delete,
events; the put route is ``kvstore.server.put``.

Store calls that can block (LMDB, Redis, checksums over megabytes, the
store's lock) run on worker threads, and the event loop only moves bytes;
a lookup answerable from memory at once is answered on the loop
(``TieredStore.lookup_nowait``).

Get (``"bytes"``): ``SharedServing.serve`` pins the batch, then ``get_frames.send_served``
streams it: DRAM blocks straight from the shared arena, the others read on a
worker a window ahead; the pins go back when the response ends, however it
ends.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvstore.keys import ChunkKey, Namespace
from kvstore.kinds import TierKind
from kvstore.server.connection import is_local
from kvstore.server.get_frames import send_served
from kvstore.server.leases import Lease, LeaseTable
from kvstore.server.metrics import EventRejection
from kvstore.server.put import put
from kvstore.server.state import EVENTS, LEASES, METRICS, PREDICTOR, SERVING, STATE, STORE
from kvstore.store.shared import ServedGet, SharedBlock, SharedServing
from kvstore.store.tiered_store import TieredStore
from kvstore.wire import strict_json
from kvstore.wire.codes import ErrorCode, WireError
from kvstore.wire.events import EVENT_CONTENT_TYPE, parse_event, parse_event_bytes
from kvstore.wire.frames import Seal
from kvstore.wire.messages import (
    API_PREFIX,
    KEYS_CONTENT_TYPE,
    GetTransfer,
    digest_from_hex,
    keys_from_bytes,
    keys_from_json,
    namespace_from_json,
)


def add_routes(app: web.Application) -> None:
    app.router.add_post(f"{API_PREFIX}/namespaces", register_namespace)
    app.router.add_post(f"{API_PREFIX}/lookup", lookup)
    app.router.add_post(f"{API_PREFIX}/put", put)
    app.router.add_post(f"{API_PREFIX}/get", get)
    app.router.add_post(f"{API_PREFIX}/leases/{{lease_id}}/release", release_lease)
    app.router.add_get(f"{API_PREFIX}/shm", shared_memory)
    app.router.add_post(f"{API_PREFIX}/delete", delete)
    app.router.add_post(f"{API_PREFIX}/events", post_event)


# -- control routes ----------------------------------------------------------------


async def register_namespace(request: web.Request) -> web.Response:
    namespace = namespace_from_json(await read_json(request))
    store = request.app[STORE]
    # Bounded, as every input is: a full table forgets its least recently named namespace
    # (whose client re-registers when next told it is unknown) rather than refuse this one.
    limit = request.app[STATE].config.max_namespaces
    await asyncio.to_thread(functools.partial(store.register, namespace, limit=limit))
    # How this client may seal its puts on this connection (kvstore.wire.Seal).
    seals = list(Seal) if is_local(request) else [Seal.HEADER, Seal.TRAILER]
    return web.json_response(
        {"namespace": namespace.digest.hex(), "put_seals": [seal.value for seal in seals]}
    )


async def lookup(request: web.Request) -> web.Response:
    """A lookup of JSON keys, or of raw keys (``KEYS_CONTENT_TYPE``, its namespace in
    the query): what an engine's scheduler sends, on the path of every new request."""
    store = request.app[STORE]
    limit = store.config.max_lookup_chunks
    raw = request.content_type == KEYS_CONTENT_TYPE
    if raw:
        namespace = store.namespace(digest_from_hex(request.query.get("namespace")))
        keys = keys_from_bytes(await _read_body(request), limit)
    else:
        namespace, keys = _namespace_and_keys(store, await read_json(request), limit)
    prefix = store.lookup_nowait(namespace, keys)
    if prefix is None:
        prefix = await asyncio.to_thread(store.lookup, namespace, keys)
    answer: dict[str, Any] = {
        "num_chunks": prefix.num_chunks,
        "chunk_tokens": prefix.chunk_tokens,
        "total_chunks": prefix.total_chunks,
        "load_chunks": prefix.load_chunks,
    }
    if raw:  # as compact as the question: one [label, count] per run of a tier
        answer["tier_runs"] = [
            [tier.label, len(list(run))] for tier, run in itertools.groupby(prefix.tiers)
        ]
    else:
        answer["tiers"] = [tier.label for tier in prefix.tiers]
    return web.json_response(answer)


async def delete(request: web.Request) -> web.Response:
    store = request.app[STORE]
    namespace, keys = _namespace_and_keys(store, await read_json(request))
    deleted = await asyncio.to_thread(store.delete, namespace, keys)
    return web.json_response({"deleted": deleted})


async def post_event(request: web.Request) -> web.Response:
    """Keep a session event and hand it to the predictor; one that is malformed, or
    whose time is off the daemon's clock by more than the config allows, is
    refused and counted, and reaches neither."""
    metrics = request.app[METRICS]
    try:
        if request.content_type == EVENT_CONTENT_TYPE:
            event = parse_event_bytes(await _read_body(request))
        else:
            event = parse_event(await read_json(request))
    except WireError:
        metrics.reject_event(EventRejection.INVALID)
        raise
    config = request.app[STATE].config
    now = time.time()
    if not now - config.event_time_behind_s <= event.time <= now + config.event_time_ahead_s:
        metrics.reject_event(EventRejection.CLOCK_SKEW)
        raise WireError(
            ErrorCode.BAD_REQUEST,
            f"time {event.time:.17g} is off the daemon's clock ({now:.3f}) by more than "
            f"{config.event_time_ahead_s:g} s ahead or {config.event_time_behind_s:g} s behind",
        )
    request.app[EVENTS].append(event)
    metrics.observe_event(event)
    predictor = request.app.get(PREDICTOR)
    if predictor is not None:
        predictor.submit(event)  # learnt from and acted on in order, off this request
    return web.json_response({"accepted": True})


# -- get -----------------------------------------------------------------------------


async def get(request: web.Request) -> web.StreamResponse:
    """A get of either transfer; it first gives back the leases its body names
    (``release``), on the worker thread it needs anyway, so a shared-memory
    client that gets continuously sends one request per get, not two."""
    store = request.app[STORE]
    body = await read_json(request)
    namespace, keys = _namespace_and_keys(store, body)
    continues = body.get("continues", False)
    if not isinstance(continues, bool):
        raise WireError(ErrorCode.BAD_REQUEST, "continues must be true or false")
    device_memory = body.get("device_memory", False)
    if not isinstance(device_memory, bool):
        raise WireError(ErrorCode.BAD_REQUEST, "device_memory must be true or false")
    asked = _GetRequest(
        namespace, keys, _released(body, request.app[LEASES]), continues, device_memory
    )
    named = body.get("transfer", GetTransfer.BYTES.value)
    transfer = next((transfer for transfer in GetTransfer if transfer.value == named), None)
    if transfer is GetTransfer.BYTES:
        return await _get_bytes(request, asked)
    if transfer is GetTransfer.SHM:
        return await _get_shared(request, asked)
    raise WireError(
        ErrorCode.BAD_REQUEST, f"transfer must be one of {[t.value for t in GetTransfer]}"
    )


@dataclass(frozen=True, slots=True)
class _GetRequest:
    """A get as its body asked for it: the chunks, and the leases it gives back."""

    namespace: Namespace
    keys: list[ChunkKey]
    released: list[str]
    continues: bool = False  # it reads what a shared-memory get left inline
    device_memory: bool = False  # its client can copy out of the HBM arena (``"shm"``)


def _released(body: dict[str, Any], leases: LeaseTable) -> list[str]:
    """The ids of the leases a get gives back (``"release"``, optional): those its
    client finished copying since its last get (``client.protocol``)."""
    ids = body.get("release", [])
    if (
        not isinstance(ids, list)
        or len(ids) > leases.max_leases
        or not all(isinstance(lease_id, str) for lease_id in ids)
    ):
        raise WireError(ErrorCode.BAD_REQUEST, "release must be a list of lease ids")
    return ids


async def _get_bytes(request: web.Request, asked: _GetRequest) -> web.StreamResponse:
    """Stream the blocks as frames: each a complete, checksummed block, sent from
    where it lies; the pins ``serve`` took are given back however the response ends."""
    serving = request.app[SERVING]
    served = await asyncio.to_thread(_serve, request.app[LEASES], serving, asked)
    try:
        return await send_served(request, serving, served)
    finally:
        # Shielded: a cancelled request must still unpin, and the call may wait
        # on the store's lock, so it runs on a worker, not on the loop.
        release = functools.partial(serving.release_served, served, continues=asked.continues)
        await asyncio.shield(asyncio.to_thread(release))


def _serve(leases: LeaseTable, serving: SharedServing, asked: _GetRequest) -> ServedGet:
    """Give back the leases ``asked`` releases, then pin the batch. Worker thread."""
    if asked.released:
        leases.release_many(asked.released)
    return serving.serve(asked.namespace, asked.keys)


async def _get_shared(request: web.Request, asked: _GetRequest) -> web.Response:
    """Pin the DRAM blocks under a lease and say where they lie in the arena, with
    each extent's generation as it was when pinned (the client's proof, after
    copying, that the extent was not freed meanwhile: ``client.blocks``).

    A client that can copy device memory (``device_memory``) is shown the HBM
    blocks the same way, in the HBM arena whose handle the answer carries
    (``"hbm"``, ``kvstore.tiers.hbm``), if that arena is shared; otherwise HBM
    blocks are ``inline``, as every other block not in DRAM.

    ``release_with_get`` tells the client that it may give this lease back by
    naming it in a later get (``_released``), so a client that gets again soon
    sends one request per get rather than two.
    """
    if not is_local(request):
        raise WireError(ErrorCode.BAD_REQUEST, "transfer 'shm' is only offered on the Unix socket")
    serving = request.app[SERVING]
    name = serving.shared_memory_name
    if name is None:
        raise WireError(ErrorCode.NOT_FOUND, "this daemon has no DRAM tier; use 'bytes'")
    hbm = serving.hbm_handle if asked.device_memory else None
    lease, shared, located = await asyncio.to_thread(
        _share, request.app[LEASES], asked, hbm is not None
    )
    entries: list[dict[str, Any]] = []
    elsewhere = iter(located)
    for key, block in zip(asked.keys, shared, strict=True):
        if block is not None:
            entries.append(
                {
                    "key": key.hex(),
                    "offset": block.offset,
                    "length": block.nbytes,
                    "tier": block.tier.label,
                    # The client checks this counter after its copy (client.blocks).
                    "generation": block.generation,
                    "generation_at": serving.generation_offset(block),
                }
            )
        elif next(elsewhere) is not None:
            entries.append({"key": key.hex(), "inline": True})
        else:
            entries.append({"key": key.hex(), "missing": True})
    grant: dict[str, Any] = {
        "lease": lease.id,
        "expires_in_s": lease.ttl_s,
        "release_with_get": True,
        "shm": name,
        "blocks": entries,
    }
    if hbm is not None:
        grant["hbm"] = hbm.to_json()
    return web.json_response(grant)


def _share(
    leases: LeaseTable, asked: _GetRequest, hbm: bool
) -> tuple[Lease, list[SharedBlock | None], list[TierKind | None]]:
    """Give back the leases ``asked`` releases (first: it frees their slots), lease
    the DRAM blocks (and with ``hbm`` the HBM ones), and locate the others (inline
    or missing). Worker thread."""
    if asked.released:
        leases.release_many(asked.released)
    lease, shared = leases.grant(asked.namespace, asked.keys, hbm=hbm)
    others = [key for key, block in zip(asked.keys, shared, strict=True) if block is None]
    located = leases.serving.locate(asked.namespace, others) if others else []
    leases.serving.count_shared_get(located.count(None))
    return lease, shared, located


async def release_lease(request: web.Request) -> web.Response:
    released = await asyncio.to_thread(request.app[LEASES].release, request.match_info["lease_id"])
    return web.json_response({"released": released})


async def shared_memory(request: web.Request) -> web.Response:
    if not is_local(request):
        raise WireError(ErrorCode.BAD_REQUEST, "shared memory is only offered on the Unix socket")
    name = request.app[SERVING].shared_memory_name
    if name is None:
        raise WireError(ErrorCode.NOT_FOUND, "this daemon has no DRAM tier")
    size = request.app[STORE].tier(TierKind.DRAM).capacity_bytes()
    return web.json_response({"name": name, "size": size})


# -- helpers -------------------------------------------------------------------------


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's JSON object (``kvstore.wire.strict_json``), read as ``_read_body``."""
    try:
        data = strict_json.loads(await _read_body(request))
    except ValueError as error:
        raise WireError(ErrorCode.BAD_REQUEST, f"body is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise WireError(ErrorCode.BAD_REQUEST, "body must be a JSON object")
    return data


async def _read_body(request: web.Request) -> bytes:
    """The request's body: bounded in size by the app's ``client_max_size``, and in
    time by ``body_deadline_s`` of its length."""
    config = request.app[STATE].config
    deadline_s = config.body_deadline_s(request.content_length or config.max_json_bytes)
    try:
        async with asyncio.timeout(deadline_s):
            return await request.read()
    except TimeoutError:
        raise WireError(
            ErrorCode.REQUEST_TIMEOUT, f"body not received within {deadline_s:g} s"
        ) from None


def _namespace_and_keys(
    store: TieredStore, body: dict[str, Any], limit: int | None = None
) -> tuple[Namespace, list[ChunkKey]]:
    """The body's namespace and keys, at most ``limit`` (default: a batch's) of them."""
    namespace = store.namespace(digest_from_hex(body.get("namespace")))
    limit = store.config.max_batch_chunks if limit is None else limit
    return namespace, keys_from_json(body.get("keys"), limit)
