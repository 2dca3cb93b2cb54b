"""``POST /v1/put``: a frames body received straight into the store, verified whole,
then stored (or nothing).

From the socket to the store, on one worker thread per put::

    socket (kvstore.server.borrowed_body: the body read off the connection, not
      │     through aiohttp's buffers; Content-Length required)
      ▼
    wait, on the event loop, for the body's first ``put_start_bytes`` (or all of it)
      │     to be here; only then take one of ``max_concurrent_puts`` slots
      ▼
    metadata: namespace known? sizes in bounds?   (before any block is read)
      │
      ▼ per block: its header, then
    land it (kvstore/server/landing.py): into a reservation of the DRAM arena, or a
    buffer of its own when none is to be had; recv_into it, checksum each step as
    it lands, check key, namespace, layout, one chunk (a block sent without its
    checksum in the header is checksummed the same way, into its header, and
    checked against its trailer: see below)
      │
      ▼ once the whole body is in and every block passed
    Landing.commit: landed blocks published, the others stored by
    serving.put_blocks (all or nothing: a failed put gives every extent
    back and stores nothing)

A put slot is taken by bytes, not by headers: a client that sends a put's
headers and then trickles its body waits for its first ``put_start_bytes``
holding nothing (no slot, no thread) until its deadline cuts it off, so any
number of them cannot keep a normal put from a slot. A client that sends that
much and then stalls holds its slot until ``body_timeout_s`` of silence or its
deadline, ``body_deadline_s(length)`` counted from the slot; ``max_concurrent_puts``
such clients delay a normal put by at most that long.

A failed put reads and drops the rest of its body (for up to
``_DISCARD_S``) before answering, so that a client still sending reads the
error rather than a connection reset; the connection then closes.

Where a block's checksum travels (``"seal"`` in the metadata,
``kvstore.wire.Seal``): in its header (the default), or after its payload
(``"trailer"``: the client hashes each slice just before sending it, so it
reads every payload once, not twice; what ``kvstore.client`` sends over TCP),
or nowhere (``"daemon"``, Unix socket only: the daemon computes the checksum
from the bytes that landed, in the pass that would otherwise verify them; a
same-host socket is a kernel copy, and a checksum on both sides of it cost
the client a quarter of its CPU while guarding nothing). Either way the
daemon checksums what landed, in one pass, and stores the block with its
checksum in the header, which every later read verifies.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvstore.block import HEADER_BYTES, TRAILER_BYTES, Block
from kvstore.errors import CorruptBlock
from kvstore.keys import ChunkKey, Namespace
from kvstore.server.borrowed_body import BodyTimeLimit, SocketBody, borrow
from kvstore.server.connection import is_local
from kvstore.server.landing import Landing
from kvstore.server.state import PREDICTOR, SERVING, STATE
from kvstore.store.reservation import Filled
from kvstore.store.shared import SharedServing
from kvstore.wire.codes import ErrorCode, WireError
from kvstore.wire.events import MAX_SESSION_CHARS
from kvstore.wire.frames import (
    FRAMES_CONTENT_TYPE,
    META_LENGTH,
    FrameLimits,
    Seal,
    meta_length,
    parse_meta,
)
from kvstore.wire.messages import digest_from_hex

# A compressed block may be a little larger than the raw one (zstd framing).
_CODEC_SLACK_BYTES = 64 << 10
# How long a failed put keeps reading its body so that the client sees the answer.
_DISCARD_S = 2.0


async def put(request: web.Request) -> web.Response:
    """Receive a frames body into the store, verifying its blocks as they arrive,
    then store the batch (or nothing)."""
    serving = request.app[SERVING]
    state = request.app[STATE]
    config = state.config
    if request.content_type != FRAMES_CONTENT_TYPE:
        raise WireError(ErrorCode.BAD_REQUEST, f"a put body must be {FRAMES_CONTENT_TYPE}")
    limit = config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request.content_length, limit)
    time_limit = BodyTimeLimit(
        config.body_deadline_s(request.content_length or 0), config.body_timeout_s
    )
    async with borrow(request, time_limit) as body:
        await body.arrived(min(body.remaining, config.put_start_bytes))
        async with state.put_slots:
            body.start_clock()
            receiving = asyncio.to_thread(_receive, body, serving, limit, is_local(request))
            batch = await _to_the_end(receiving)
            if not batch.keys:
                return web.json_response({"stored": 0})
            stored = await asyncio.to_thread(
                batch.landing.commit, batch.keys, batch.blocks, batch.session
            )
    predictor = request.app.get(PREDICTOR)
    if predictor is not None:  # the session's latest chain, for its events without keys
        predictor.saw_put(batch.session, batch.namespace.digest, tuple(batch.keys))
    return web.json_response({"stored": stored})


async def _to_the_end(receiving: Awaitable[_PutBatch]) -> _PutBatch:
    """The worker's batch. Cancelled meanwhile, still wait for the worker before
    raising: it reads the borrowed socket, which must outlive it (it ends within
    a poll slice once aiohttp closes the connection)."""
    future = asyncio.ensure_future(receiving)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait([future])
            except asyncio.CancelledError:
                continue
        raise


@dataclass(slots=True)
class _PutBatch:
    """A put being received: namespace, session and keys from its metadata, then
    its verified blocks (``Filled`` reservations of the DRAM arena, or ``Block``s;
    ``None`` where the metadata says absent). ``landing`` owns the reservations.
    ``seal``: where the blocks' checksums travel."""

    namespace: Namespace
    session: str | None
    keys: list[ChunkKey]
    landing: Landing
    seal: Seal
    blocks: list[Block | Filled | None] = field(default_factory=list)


def _receive(body: SocketBody, serving: SharedServing, limit: int, local: bool) -> _PutBatch:
    """Read and check the metadata, then every block (worker thread). A failure
    gives back what landed and drains the body before raising. ``local``: the
    put came over the Unix socket, so the daemon may seal its blocks."""
    limits = FrameLimits(
        max_blocks=serving.config.max_batch_chunks,
        max_block_bytes=HEADER_BYTES + serving.config.max_chunk_bytes + _CODEC_SLACK_BYTES,
    )
    batch: _PutBatch | None = None
    try:
        length = meta_length(body.read_exact(META_LENGTH.size), limits)
        meta, entries = parse_meta(body.read_exact(length), limits)
        batch = _check_put_meta(serving, meta, [key for key, _ in entries], limit, local)
        for index, (_, nbytes) in enumerate(entries):
            block = None if nbytes is None else _receive_block(body, batch, index, nbytes)
            batch.blocks.append(block)
        if body.remaining:
            raise WireError(ErrorCode.MALFORMED_BODY, "bytes after the last block")
    except BaseException:
        if batch is not None:
            batch.landing.abort()
        body.discard(_DISCARD_S)
        raise
    return batch


def _receive_block(body: SocketBody, batch: _PutBatch, index: int, nbytes: int) -> Block | Filled:
    """Block ``index`` of ``nbytes``, received and verified (``Landing.land``)."""
    if nbytes < HEADER_BYTES:
        raise CorruptBlock(f"block {index}: {nbytes} bytes is shorter than a block header")
    header_bytes = body.read_exact(HEADER_BYTES)

    def read_trailer() -> bytes:
        return body.read_exact(TRAILER_BYTES)

    key = batch.keys[index]
    return batch.landing.land(
        index,
        key,
        batch.keys[index - 1] if index else None,
        header_bytes,
        nbytes,
        body.readinto,
        seal=batch.seal,
        read_trailer=read_trailer,
    )


def _check_put_meta(
    serving: SharedServing,
    meta: dict[str, Any],
    keys: list[ChunkKey],
    limit: int,
    local: bool,
) -> _PutBatch:
    """Refuse a put by its metadata alone, before its blocks are read."""
    namespace = serving.namespace(digest_from_hex(meta.get("namespace")))
    named = meta.get("seal", Seal.HEADER.value)
    seal = next((seal for seal in Seal if seal.value == named), None)
    if seal is None:
        raise WireError(
            ErrorCode.BAD_REQUEST, f"seal must be one of {[seal.value for seal in Seal]}"
        )
    if seal is Seal.DAEMON and not local:
        raise WireError(ErrorCode.BAD_REQUEST, "seal 'daemon' is only taken on the Unix socket")
    session = meta.get("session")
    if session is not None and (
        not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_CHARS
    ):
        raise WireError(
            ErrorCode.BAD_REQUEST, f"session must be null or 1 to {MAX_SESSION_CHARS} characters"
        )
    largest = HEADER_BYTES + namespace.layout.chunk_nbytes + _CODEC_SLACK_BYTES
    declared = 0
    for entry in meta["blocks"]:  # shape already checked by parse_meta
        length = entry["length"]
        if length is not None and length > largest:
            raise WireError(
                ErrorCode.MALFORMED_BODY,
                f"a block of {length} bytes cannot hold one chunk of this namespace",
            )
        declared += length or 0
    if declared > limit:
        raise _too_large(declared, limit)
    return _PutBatch(namespace, session, keys, Landing(serving, namespace, keys), seal)


def _too_large(size: int, limit: int) -> WireError:
    return WireError(
        ErrorCode.REQUEST_TOO_LARGE, f"body of {size} bytes; the limit is {limit} bytes"
    )
