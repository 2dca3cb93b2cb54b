"""``POST /v1/put``: a frames body received, verified whole, then stored (or nothing).

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
"""

from __future__ import annotations

import asyncio
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
from kvstore.events import MAX_SESSION_CHARS
from kvstore.keys import ChunkKey, Namespace
from kvstore.landing import Landing
from kvstore.placement import Reserved
from kvstore.server.frames import ArrivedBlock, FrameSplitter
from kvstore.server.state import PREDICTOR, STATE, STORE
from kvstore.store import TieredStore
from kvstore.wire import (
    FRAMES_CONTENT_TYPE,
    ErrorCode,
    FrameLimits,
    WireError,
    digest_from_hex,
)

# A compressed block may be a little larger than the raw one (zstd framing).
_CODEC_SLACK_BYTES = 64 << 10
# A put hands its complete blocks to a worker for verification in batches of
# about this many bytes: large enough that the thread hop is noise next to the
# checksum (~0.4 ms), small enough to overlap verifying with receiving.
_VERIFY_BATCH_BYTES = 4 << 20


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
