"""Reading blocks out of a tier: verify, decode, and overlap the two with the copy.

A verified read costs a copy (the tier hands over an owned buffer) plus a
checksum over the same bytes; done one after the other the two costs add up.
So a batch from a local tier (LMDB) is read in windows of a few MiB, and each
window is checksummed on a worker thread while the caller's thread copies the
next one. Both xxhash and numpy's copy release the GIL, so on two cores the
checksum hides behind the copy (measured on LMDB at 2 MiB chunks: 0.60 of
raw py-lmdb serially, 0.81-0.84 overlapped with 8 MiB windows; 2 MiB
windows gave 0.69-0.73, the hand-off per window costing more than the cache
locality saves).

A remote tier (Redis) is read in one round trip per batch: there the wire is
the bottleneck, and splitting the batch would add round trips.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from kvstore.block import HEADER_BYTES, Codec, check_identity, verify_block, verify_parts
from kvstore.codec import decode_payload
from kvstore.errors import CorruptBlock, LayoutMismatch
from kvstore.keys import ChunkKey, Namespace
from kvstore.store.chunk import KVChunk
from kvstore.store.guarded import GuardedTier
from kvstore.tiers.base import BlockDestination, Buffer

# Verified reads from a local tier go in windows of about this many bytes.
VERIFY_WINDOW_BYTES = 8 << 20


@dataclass
class ReadOutcome:
    """What one read of a tier produced. ``failed``: the tier stopped answering."""

    chunks: list[tuple[int, KVChunk]] = field(default_factory=list)
    bad: list[ChunkKey] = field(default_factory=list)
    absent: list[ChunkKey] = field(default_factory=list)
    bytes_read: int = 0
    failed: bool = False

    def merge(self, other: ReadOutcome) -> None:
        self.chunks += other.chunks
        self.bad += other.bad
        self.absent += other.absent
        self.bytes_read += other.bytes_read


def check_window(
    tier: GuardedTier,
    namespace: Namespace,
    keys: Sequence[ChunkKey],
    indices: Sequence[int],
    buffers: Sequence[Buffer | None],
) -> ReadOutcome:
    """Verify and decode what a tier returned for ``keys[i] for i in indices``.

    The checksum is checked when the tier's reads cross a trust boundary;
    the key, namespace and layout always, and that the block holds exactly one
    chunk of it (another writer's block of the right identity but another size
    is refused, never handed on).
    """
    outcome = ReadOutcome()
    for index, buffer in zip(indices, buffers, strict=True):
        key = keys[index]
        if buffer is None:
            outcome.absent.append(key)
            continue
        try:
            header = verify_block(buffer, check_payload=tier.verifies_reads)
            check_identity(header, namespace, key, whole_chunk=True)
            raw = decode_payload(
                memoryview(buffer)[HEADER_BYTES:], header.dtype, header.codec, header.raw_len
            )
        except (CorruptBlock, LayoutMismatch):
            outcome.bad.append(key)
            continue
        outcome.bytes_read += len(buffer)
        block = memoryview(buffer) if header.codec is Codec.NONE else None
        outcome.chunks.append((index, KVChunk(key, tier.kind, namespace.layout, raw, block)))
    return outcome


def check_copied(
    tier: GuardedTier,
    namespace: Namespace,
    keys: Sequence[ChunkKey],
    indices: Sequence[int],
    destinations: Sequence[BlockDestination],
) -> ReadOutcome:
    """``check_window`` for blocks a tier copied straight into the caller's buffers."""
    outcome = ReadOutcome()
    for index, destination in zip(indices, destinations, strict=True):
        key = keys[index]
        try:
            header = verify_parts(
                destination.header.data, destination.payload.data, check_payload=tier.verifies_reads
            )
            check_identity(header, namespace, key, whole_chunk=True)
            if header.codec is not Codec.NONE:
                # A compressed block that happened to be exactly one chunk long was
                # copied in place as it is stored; decode it where it landed.
                raw = decode_payload(
                    destination.payload.tobytes(), header.dtype, header.codec, header.raw_len
                )
                np.copyto(destination.payload, np.frombuffer(raw, dtype=np.uint8))
        except (CorruptBlock, LayoutMismatch):
            outcome.bad.append(key)
            continue
        outcome.bytes_read += HEADER_BYTES + destination.payload.size
        chunk = KVChunk(key, tier.kind, namespace.layout, destination.payload.data)
        outcome.chunks.append((index, chunk))
    return outcome


class BlockReader:
    """Reads batches from tiers; owns the checksum worker thread."""

    def __init__(self) -> None:
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-verify")

    def read(
        self,
        tier: GuardedTier,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        indices: Sequence[int],
    ) -> ReadOutcome:
        """Read, verify and decode ``keys[i] for i in indices`` from ``tier``."""
        step = _window(tier, namespace, len(indices))
        if step >= len(indices):
            buffers = tier.get_many(namespace.digest, [keys[i] for i in indices])
            if buffers is None:
                return ReadOutcome(failed=True)
            return check_window(tier, namespace, keys, indices, buffers)
        outcome = ReadOutcome()
        checks: list[Future[ReadOutcome]] = []
        for start in range(0, len(indices), step):
            window = indices[start : start + step]
            buffers = tier.get_many(namespace.digest, [keys[i] for i in window])
            if buffers is None:
                outcome.failed = True
                break
            checks.append(
                self._verifier.submit(check_window, tier, namespace, keys, window, buffers)
            )
        for check in checks:
            outcome.merge(check.result())
        return outcome

    def read_into(
        self,
        tier: GuardedTier,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        indices: Sequence[int],
        payloads: Sequence[np.ndarray],
    ) -> ReadOutcome:
        """``read`` into the caller's buffers: ``payloads[j]`` receives ``keys[indices[j]]``.

        The tier copies each payload straight into place. A block it cannot
        place (a miss, or stored compressed, so of another size) is read the
        ordinary way and, if found, decoded into place.
        """
        headers = np.empty((len(indices), HEADER_BYTES), dtype=np.uint8)
        destinations = [BlockDestination(headers[j], payloads[j]) for j in range(len(indices))]
        step = _window(tier, namespace, len(indices))
        outcome = ReadOutcome()
        checks: list[Future[ReadOutcome]] = []
        unplaced: list[int] = []
        for start in range(0, len(indices), step):
            window = list(range(start, min(start + step, len(indices))))
            copied = tier.get_many_into(
                namespace.digest,
                [keys[indices[j]] for j in window],
                [destinations[j] for j in window],
            )
            if copied is None:
                outcome.failed = True
                break
            placed = [j for j, ok in zip(window, copied, strict=True) if ok]
            unplaced += [j for j, ok in zip(window, copied, strict=True) if not ok]
            verify = partial(
                check_copied,
                tier,
                namespace,
                keys,
                [indices[j] for j in placed],
                [destinations[j] for j in placed],
            )
            if step >= len(indices):
                # One window: no copy to hide the check behind, and a hand-off to the
                # worker costs a GIL switch (up to 5 ms on a busy machine), as in ``read``.
                outcome.merge(verify())
            else:
                checks.append(self._verifier.submit(verify))
        for check in checks:
            outcome.merge(check.result())
        if unplaced and not outcome.failed:
            fallback = self.read(tier, namespace, keys, [indices[j] for j in unplaced])
            position = {indices[j]: j for j in unplaced}
            placed_chunks: list[tuple[int, KVChunk]] = []
            for index, chunk in fallback.chunks:
                target = payloads[position[index]]
                np.copyto(target, np.frombuffer(chunk.payload, dtype=np.uint8))
                placed_chunks.append(
                    (index, KVChunk(chunk.key, chunk.tier, chunk.layout, target.data))
                )
            fallback.chunks = placed_chunks
            outcome.merge(fallback)
            outcome.failed = fallback.failed
        return outcome

    def close(self) -> None:
        self._verifier.shutdown(wait=True)


def _window(tier: GuardedTier, namespace: Namespace, count: int) -> int:
    """How many blocks to read per window (all of them unless the overlap pays)."""
    if tier.verifies_reads and not tier.kind.shared:
        return max(1, VERIFY_WINDOW_BYTES // (HEADER_BYTES + namespace.layout.chunk_nbytes))
    return max(1, count)
