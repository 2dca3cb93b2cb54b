"""The ``/v1`` KV routes (docs/http_api.md): namespaces, lookup, put, get, leases,
delete, events.

Store calls that can block (LMDB, Redis, checksums over megabytes, the
store's lock) run on worker threads, and the event loop only moves bytes;
a lookup answerable from memory at once is answered on the loop
(``TieredStore.lookup_nowait``). A put is received whole and verified whole
before any block is stored: a rejected request changes nothing.

Put, from the socket to the store::

    request.content ─► FrameSplitter ─► metadata: namespace known? sizes in bounds?
      (chunks, counted    (frames.py; no     (checked as soon as it arrives, before
       against            copy on the         the blocks are read)
       max_body_bytes)    loop)    │
                                   ▼ every ~4 MiB of complete blocks, while the rest arrives
        worker thread, per block: land it (kvstore/landing.py): reserve a DRAM
          extent, copy the pieces in while checksumming them, check key,
          namespace, layout, one chunk; unpublished until the end
        or, with no extent to be had: join ─► verify_block ─► the same checks
                                   │
                                   ▼ once the whole body is in and every block passed
        worker thread: Landing.commit: landed blocks published, the others
        stored by store.serving.put_blocks (all or nothing: a failed put gives every
        extent back and stores nothing)

Get (``"bytes"``): ``store.serving.serve`` pins the batch, then ``frames.send_served``
streams it: DRAM blocks straight from the shared arena, the others read on a
worker a window ahead; the pins go back when the response ends, however it
ends.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvstore.block import (
    HEADER_BYTES,
    Block,
    check_identity,
    payload_view,
    stored_block,
    verify_block,
)
from kvstore.codec import decode_payload
from kvstore.errors import CorruptBlock, LayoutMismatch
from kvstore.events import MAX_SESSION_CHARS, parse_event
from kvstore.keys import ChunkKey, Namespace
from kvstore.landing import Landing
from kvstore.placement import Reserved
from kvstore.server.frames import ArrivedBlock, FrameSplitter, send_served
from kvstore.server.leases import Lease, LeaseTable
from kvstore.server.state import EVENTS, LEASES, METRICS, PREDICTOR, STATE, STORE
from kvstore.serving import SharedBlock
from kvstore.store import TieredStore
from kvstore.tiers.base import TierKind
from kvstore.tiers.dram import DRAMTier
from kvstore.wire import (
    API_PREFIX,
    FRAMES_CONTENT_TYPE,
    ErrorCode,
    FrameLimits,
    WireError,
    digest_from_hex,
    keys_from_json,
    namespace_from_json,
)

# A compressed block may be a little larger than the raw one (zstd framing).
_CODEC_SLACK_BYTES = 64 << 10
# A put hands its complete blocks to a worker for verification in batches of
# about this many bytes: large enough that the thread hop is noise next to the
# checksum (~0.4 ms), small enough to overlap verifying with receiving.
_VERIFY_BATCH_BYTES = 4 << 20


def add_routes(app: web.Application) -> None:
    app.router.add_post(f"{API_PREFIX}/namespaces", register_namespace)
    app.router.add_post(f"{API_PREFIX}/lookup", lookup)
    app.router.add_post(f"{API_PREFIX}/put", put)
    app.router.add_post(f"{API_PREFIX}/get", get)
    app.router.add_post(f"{API_PREFIX}/leases/{{lease_id}}/release", release_lease)
    app.router.add_get(f"{API_PREFIX}/shm", shared_memory)
    app.router.add_post(f"{API_PREFIX}/delete", delete)
    app.router.add_post(f"{API_PREFIX}/events", post_event)


def is_local(request: web.Request) -> bool:
    """Whether the request came over the Unix socket (the same host, the same user)."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


# -- control routes ----------------------------------------------------------------


async def register_namespace(request: web.Request) -> web.Response:
    namespace = namespace_from_json(await read_json(request))
    store = request.app[STORE]
    limit = request.app[STATE].config.max_namespaces
    known = {registered.digest for registered in store.registered_namespaces()}
    # Namespaces live as long as the daemon: bound them, as every other input is.
    if namespace.digest not in known and len(known) >= limit:
        raise WireError(
            ErrorCode.REQUEST_TOO_LARGE, f"{len(known)} namespaces registered; the limit is {limit}"
        )
    await asyncio.to_thread(store.register, namespace)
    return web.json_response({"namespace": namespace.digest.hex()})


async def lookup(request: web.Request) -> web.Response:
    store = request.app[STORE]
    namespace, keys = _namespace_and_keys(store, await read_json(request))
    prefix = store.lookup_nowait(namespace, keys)
    if prefix is None:
        prefix = await asyncio.to_thread(store.lookup, namespace, keys)
    return web.json_response(
        {
            "num_chunks": prefix.num_chunks,
            "chunk_tokens": prefix.chunk_tokens,
            "total_chunks": prefix.total_chunks,
            "tiers": [tier.label for tier in prefix.tiers],
            "load_chunks": prefix.load_chunks,
        }
    )


async def delete(request: web.Request) -> web.Response:
    store = request.app[STORE]
    namespace, keys = _namespace_and_keys(store, await read_json(request))
    deleted = await asyncio.to_thread(store.delete, namespace, keys)
    return web.json_response({"deleted": deleted})


async def post_event(request: web.Request) -> web.Response:
    event = parse_event(await read_json(request))
    request.app[EVENTS].append(event)
    request.app[METRICS].observe_event(event)
    predictor = request.app.get(PREDICTOR)
    if predictor is not None:
        predictor.submit(event)  # learnt from and acted on in order, off this request
    return web.json_response({"accepted": True})


# -- put -----------------------------------------------------------------------------


async def put(request: web.Request) -> web.Response:
    """Receive a frames body, verifying its blocks as they complete, then store the
    batch (or nothing)."""
    store = request.app[STORE]
    state = request.app[STATE]
    if request.content_type != FRAMES_CONTENT_TYPE:
        raise WireError(ErrorCode.BAD_REQUEST, f"a put body must be {FRAMES_CONTENT_TYPE}")
    limit = state.config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request.content_length, limit)
    async with state.put_slots:
        batch = await _receive(request, store, limit)
        if not batch.keys:
            return web.json_response({"stored": 0})
        stored = await asyncio.to_thread(
            batch.landing.commit, batch.keys, batch.blocks, batch.session
        )
    predictor = request.app.get(PREDICTOR)
    if predictor is not None:  # the session's latest chain, for its events without keys
        predictor.saw_put(batch.session, batch.namespace.digest, tuple(batch.keys))
    return web.json_response({"stored": stored})


@dataclass(slots=True)
class _PutBatch:
    """A put being received: namespace, session and keys from its metadata, then
    its verified blocks (landed in DRAM or ``Block``s; ``None`` where the metadata
    says absent). ``landing`` owns the DRAM extents blocks landed in."""

    namespace: Namespace
    session: str | None
    keys: list[ChunkKey]
    landing: Landing
    blocks: list[Block | Reserved | None] = field(default_factory=list)


async def _receive(request: web.Request, store: TieredStore, limit: int) -> _PutBatch:
    """Read the body; verify its blocks on workers while the rest arrives."""
    splitter = FrameSplitter(
        FrameLimits(
            max_blocks=store.config.max_batch_chunks,
            max_block_bytes=HEADER_BYTES + store.config.max_chunk_bytes + _CODEC_SLACK_BYTES,
        )
    )
    batch: _PutBatch | None = None
    verifying: list[asyncio.Future[list[Block | Reserved | None]]] = []
    arrived: list[ArrivedBlock] = []
    arrived_bytes = total = 0
    try:
        async for data, _ in request.content.iter_chunks():
            total += len(data)
            if total > limit:
                raise _too_large(total, limit)
            for block in splitter.feed(data):
                arrived.append(block)
                arrived_bytes += block.nbytes
            if batch is None and splitter.meta is not None:
                batch = _check_put_meta(store, splitter.meta, splitter.keys, limit)
            if batch is not None and arrived_bytes >= _VERIFY_BATCH_BYTES:
                verifying.append(_verify_soon(batch, arrived))
                arrived, arrived_bytes = [], 0
        splitter.finish()
        assert batch is not None, "finish() raises unless the metadata arrived"
        verifying.append(_verify_soon(batch, arrived))
        for verified in verifying:
            batch.blocks += await verified
    except BaseException:
        if batch is not None:  # off the loop: it takes the store's lock
            await asyncio.shield(asyncio.to_thread(batch.landing.abort))
        # Workers still landing give their extents back as they finish (a few ms):
        # wait for them, so that every extent is back before the answer goes out.
        await asyncio.shield(asyncio.gather(*verifying, return_exceptions=True))
        raise
    return batch


def _verify_soon(
    batch: _PutBatch, arrived: list[ArrivedBlock]
) -> asyncio.Future[list[Block | Reserved | None]]:
    loop = asyncio.get_running_loop()
    return loop.run_in_executor(None, _verify_blocks, batch, arrived)


def _check_put_meta(
    store: TieredStore, meta: dict[str, Any], keys: list[ChunkKey], limit: int
) -> _PutBatch:
    """Refuse a put by its metadata alone, before its blocks are read."""
    namespace = store.namespace(digest_from_hex(meta.get("namespace")))
    session = meta.get("session")
    if session is not None and (
        not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_CHARS
    ):
        raise WireError(
            ErrorCode.BAD_REQUEST, f"session must be null or 1 to {MAX_SESSION_CHARS} characters"
        )
    largest = HEADER_BYTES + namespace.layout.chunk_nbytes + _CODEC_SLACK_BYTES
    declared = 0
    for entry in meta["blocks"]:  # shape already checked by the decoder
        length = entry["length"]
        if length is not None and length > largest:
            raise WireError(
                ErrorCode.MALFORMED_BODY,
                f"a block of {length} bytes cannot hold one chunk of this namespace",
            )
        declared += length or 0
    if declared > limit:
        raise _too_large(declared, limit)
    return _PutBatch(namespace, session, keys, Landing(store, namespace, keys))


def _verify_blocks(batch: _PutBatch, arrived: list[ArrivedBlock]) -> list[Block | Reserved | None]:
    """Land each arrived block in DRAM, or else join it and verify it the same way
    (checksum, key, namespace, layout, one chunk, a payload that decodes); ready
    for ``Landing.commit``. Worker thread."""
    namespace = batch.namespace
    chunk_nbytes = namespace.layout.chunk_nbytes
    blocks: list[Block | Reserved | None] = []
    for block in arrived:
        if block.parts is None:
            blocks.append(None)
            continue
        parent = batch.keys[block.index - 1] if block.index else None
        landed = batch.landing.land(block.index, block.key, parent, block.parts)
        if landed is not None:
            blocks.append(landed)
            continue
        data = block.joined()
        assert data is not None
        try:
            header = verify_block(data)
            check_identity(header, namespace, block.key)
            if header.raw_len != chunk_nbytes:
                raise LayoutMismatch(
                    f"holds {header.raw_len} bytes of KV, the namespace's chunk is {chunk_nbytes}"
                )
            decode_payload(payload_view(data), header.dtype, header.codec, header.raw_len)
        except (CorruptBlock, LayoutMismatch) as error:
            raise type(error)(f"block {block.index}: {error}") from None
        blocks.append(stored_block(data))
    return blocks


def _too_large(size: int, limit: int) -> WireError:
    return WireError(
        ErrorCode.REQUEST_TOO_LARGE, f"body of {size} bytes; the limit is {limit} bytes"
    )


# -- get -----------------------------------------------------------------------------


async def get(request: web.Request) -> web.StreamResponse:
    store = request.app[STORE]
    body = await read_json(request)
    namespace, keys = _namespace_and_keys(store, body)
    transfer = body.get("transfer", "bytes")
    if transfer == "bytes":
        return await _get_bytes(request, store, namespace, keys)
    if transfer == "shm":
        return await _get_shared(request, store, namespace, keys)
    raise WireError(ErrorCode.BAD_REQUEST, "transfer must be 'bytes' or 'shm'")


async def _get_bytes(
    request: web.Request, store: TieredStore, namespace: Namespace, keys: list[ChunkKey]
) -> web.StreamResponse:
    """Stream the blocks as frames: each a complete, checksummed block, sent from
    where it lies; the pins ``serve`` took are given back however the response ends."""
    served = await asyncio.to_thread(store.serving.serve, namespace, keys)
    try:
        return await send_served(request, store, served)
    finally:
        # Shielded: a cancelled request must still unpin, and the call may wait
        # on the store's lock, so it runs on a worker, not on the loop.
        await asyncio.shield(asyncio.to_thread(store.serving.release_served, served))


async def _get_shared(
    request: web.Request, store: TieredStore, namespace: Namespace, keys: list[ChunkKey]
) -> web.Response:
    """Pin the DRAM blocks under a lease and say where they lie in the arena, with
    each extent's generation as it was when pinned (the client's proof, after
    copying, that the extent was not freed meanwhile: ``client.blocks``)."""
    if not is_local(request):
        raise WireError(ErrorCode.BAD_REQUEST, "transfer 'shm' is only offered on the Unix socket")
    name = store.serving.shared_memory_name
    if name is None:
        raise WireError(ErrorCode.NOT_FOUND, "this daemon has no DRAM tier; use 'bytes'")
    leases = request.app[LEASES]
    lease, shared, located = await asyncio.to_thread(_share, leases, namespace, keys)
    dram = store.tier(TierKind.DRAM)
    assert isinstance(dram, DRAMTier), "a shared-memory name comes from a DRAM tier"
    entries: list[dict[str, Any]] = []
    elsewhere = iter(located)
    for key, block in zip(keys, shared, strict=True):
        if block is not None:
            entries.append(
                {
                    "key": key.hex(),
                    "offset": block.offset,
                    "length": block.nbytes,
                    "tier": "dram",
                    # The client checks this counter after its copy (client.blocks).
                    "generation": block.generation,
                    "generation_at": dram.generation_offset(block.offset),
                }
            )
        elif next(elsewhere) is not None:
            entries.append({"key": key.hex(), "inline": True})
        else:
            entries.append({"key": key.hex(), "missing": True})
    return web.json_response(
        {"lease": lease.id, "expires_in_s": lease.ttl_s, "shm": name, "blocks": entries}
    )


def _share(
    leases: LeaseTable, namespace: Namespace, keys: Sequence[ChunkKey]
) -> tuple[Lease, list[SharedBlock | None], list[TierKind | None]]:
    """Lease the DRAM blocks; locate the others (inline or missing). Worker thread."""
    lease, shared = leases.grant(namespace, keys)
    others = [key for key, block in zip(keys, shared, strict=True) if block is None]
    located = leases.store.locate(namespace, others) if others else []
    return lease, shared, located


async def release_lease(request: web.Request) -> web.Response:
    released = await asyncio.to_thread(request.app[LEASES].release, request.match_info["lease_id"])
    return web.json_response({"released": released})


async def shared_memory(request: web.Request) -> web.Response:
    if not is_local(request):
        raise WireError(ErrorCode.BAD_REQUEST, "shared memory is only offered on the Unix socket")
    store = request.app[STORE]
    name = store.serving.shared_memory_name
    if name is None:
        raise WireError(ErrorCode.NOT_FOUND, "this daemon has no DRAM tier")
    return web.json_response({"name": name, "size": store.tier(TierKind.DRAM).capacity_bytes()})


# -- helpers -------------------------------------------------------------------------


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's JSON object; bounded by the app's ``client_max_size``."""
    try:
        data = await request.json()
    except ValueError as error:
        raise WireError(ErrorCode.BAD_REQUEST, f"body is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise WireError(ErrorCode.BAD_REQUEST, "body must be a JSON object")
    return data


def _namespace_and_keys(
    store: TieredStore, body: dict[str, Any]
) -> tuple[Namespace, list[ChunkKey]]:
    namespace = store.namespace(digest_from_hex(body.get("namespace")))
    return namespace, keys_from_json(body.get("keys"), store.config.max_batch_chunks)
