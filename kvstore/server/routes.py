"""The ``/v1`` KV routes (docs/http_api.md): namespaces, lookup, put, get, leases,
delete, events.

Every store call blocks (LMDB, Redis, checksums over megabytes), so each runs
on a worker thread (``asyncio.to_thread``) and the event loop only moves
bytes. A put is received whole and verified whole before any block is
stored: a rejected request changes nothing.

Put, from the socket to the store::

    request.content ─► FrameDecoder ─► metadata: namespace known? sizes in bounds?
      (streamed,        (sans-IO,       (checked as soon as it arrives, before
       counted against   bounded)        the blocks are read)
       max_body_bytes)        │
                              ▼ blocks
        worker thread: verify_block ─► check_identity ─► decode ─► store.put
                       (checksum)      (key, namespace,   (raw KV)   (all or
                                        layout)                      nothing)
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
    check_identity,
    encode_block,
    payload_view,
    verify_block,
)
from kvstore.codec import decode_payload
from kvstore.errors import CorruptBlock, LayoutMismatch
from kvstore.events import MAX_SESSION_CHARS, parse_event
from kvstore.keys import ChunkKey, Namespace
from kvstore.server.leases import Lease, LeaseTable
from kvstore.server.state import EVENTS, LEASES, METRICS, STATE, STORE
from kvstore.store import SharedBlock, TieredStore
from kvstore.tiers.base import TierKind
from kvstore.wire import (
    API_PREFIX,
    FRAMES_CONTENT_TYPE,
    ErrorCode,
    FrameDecoder,
    FrameLimits,
    ReceivedBlock,
    WireError,
    digest_from_hex,
    encode_frames,
    keys_from_json,
    namespace_from_json,
)

# A compressed block may be a little larger than the raw one (zstd framing).
_CODEC_SLACK_BYTES = 64 << 10


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
    prefix = await asyncio.to_thread(store.lookup, namespace, keys)
    return web.json_response(
        {
            "num_chunks": prefix.num_chunks,
            "chunk_tokens": prefix.chunk_tokens,
            "total_chunks": prefix.total_chunks,
            "tiers": [tier.label for tier in prefix.tiers],
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
    return web.json_response({"accepted": True})


# -- put -----------------------------------------------------------------------------


async def put(request: web.Request) -> web.Response:
    """Receive a frames body, verify every block, then store the batch (or nothing)."""
    store = request.app[STORE]
    state = request.app[STATE]
    if request.content_type != FRAMES_CONTENT_TYPE:
        raise WireError(ErrorCode.BAD_REQUEST, f"a put body must be {FRAMES_CONTENT_TYPE}")
    limit = state.config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request.content_length, limit)
    async with state.put_slots:
        batch = await _receive(request, store, limit)
        stored = await asyncio.to_thread(_verify_and_store, store, batch)
    return web.json_response({"stored": stored})


@dataclass(slots=True)
class _PutBatch:
    """A put being received: namespace and session from its metadata, then its blocks."""

    namespace: Namespace
    session: str | None
    blocks: list[ReceivedBlock] = field(default_factory=list)


async def _receive(request: web.Request, store: TieredStore, limit: int) -> _PutBatch:
    decoder = FrameDecoder(
        FrameLimits(
            max_blocks=store.config.max_batch_chunks,
            max_block_bytes=HEADER_BYTES + store.config.max_chunk_bytes + _CODEC_SLACK_BYTES,
        )
    )
    batch: _PutBatch | None = None
    received: list[ReceivedBlock] = []
    total = 0
    while data := await request.content.readany():
        total += len(data)
        if total > limit:
            raise _too_large(total, limit)
        received += decoder.feed(data)
        if batch is None and decoder.meta is not None:
            batch = _check_put_meta(store, decoder.meta, limit)
    decoder.finish()
    assert batch is not None, "finish() raises unless the metadata arrived"
    batch.blocks = received
    return batch


def _check_put_meta(store: TieredStore, meta: dict[str, Any], limit: int) -> _PutBatch:
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
    return _PutBatch(namespace, session)


def _verify_and_store(store: TieredStore, batch: _PutBatch) -> int:
    """Verify every block (checksum, key, namespace, layout), then store them all.
    Runs on a worker thread."""
    namespace = batch.namespace
    chunk_nbytes = namespace.layout.chunk_nbytes
    payloads: list[memoryview | None] = []
    for block in batch.blocks:
        if block.data is None:
            payloads.append(None)
            continue
        try:
            header = verify_block(block.data)
            check_identity(header, namespace, block.key)
            if header.raw_len != chunk_nbytes:
                raise LayoutMismatch(
                    f"holds {header.raw_len} bytes of KV, the namespace's chunk is {chunk_nbytes}"
                )
            payloads.append(
                decode_payload(payload_view(block.data), header.dtype, header.codec, header.raw_len)
            )
        except (CorruptBlock, LayoutMismatch) as error:
            raise type(error)(f"block {block.index}: {error}") from None
    if not payloads:
        return 0
    keys = [block.key for block in batch.blocks]
    return store.put(namespace, keys, payloads, session=batch.session)


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
    """Stream the blocks as frames: each a complete, checksummed block."""
    entries, blocks = await asyncio.to_thread(_read_blocks, store, namespace, keys)
    pieces = list(encode_frames({"blocks": entries}, blocks))
    response = web.StreamResponse(headers={"Content-Type": FRAMES_CONTENT_TYPE})
    response.content_length = sum(memoryview(piece).nbytes for piece in pieces)
    await response.prepare(request)
    for piece in pieces:
        await response.write(piece)
    await response.write_eof()
    return response


def _read_blocks(
    store: TieredStore, namespace: Namespace, keys: list[ChunkKey]
) -> tuple[list[dict[str, Any]], list[bytes | memoryview]]:
    """Metadata entries and block bytes of a bytes get. Runs on a worker thread."""
    chunks = store.get(namespace, keys)
    entries: list[dict[str, Any]] = []
    blocks: list[bytes | memoryview] = []
    for key, chunk in zip(keys, chunks, strict=True):
        if chunk is None:
            entries.append({"key": key.hex(), "length": None, "tier": None})
            continue
        # A block read from a compressed tier comes back decoded: frame it again.
        block = chunk.block
        if block is None:
            block = memoryview(encode_block(namespace, key, None, chunk.payload).to_bytes())
        entries.append({"key": key.hex(), "length": block.nbytes, "tier": chunk.tier.label})
        blocks.append(block)
    return entries, blocks


async def _get_shared(
    request: web.Request, store: TieredStore, namespace: Namespace, keys: list[ChunkKey]
) -> web.Response:
    """Pin the DRAM blocks under a lease and say where they lie in the arena."""
    if not is_local(request):
        raise WireError(ErrorCode.BAD_REQUEST, "transfer 'shm' is only offered on the Unix socket")
    name = store.shared_memory_name
    if name is None:
        raise WireError(ErrorCode.NOT_FOUND, "this daemon has no DRAM tier; use 'bytes'")
    leases = request.app[LEASES]
    lease, shared, located = await asyncio.to_thread(_share, leases, namespace, keys)
    entries: list[dict[str, Any]] = []
    elsewhere = iter(located)
    for key, block in zip(keys, shared, strict=True):
        if block is not None:
            entries.append(
                {"key": key.hex(), "offset": block.offset, "length": block.nbytes, "tier": "dram"}
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
    name = store.shared_memory_name
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
