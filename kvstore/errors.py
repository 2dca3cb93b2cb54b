"""The one exception tree of kvstore.

Every error the store raises on purpose is a ``KVStoreError``; backend
exceptions (``lmdb.Error``, ``redis.RedisError``, CUDA errors) are translated at
the boundary of the tier that talks to that backend, so callers never catch a
backend type::

    KVStoreError
     +-- ConfigError            the configuration cannot be used as written
     +-- BadRequest             a request the daemon cannot accept (malformed, out of range)
     +-- UnknownNamespace       a request names a namespace the store was not given
     +-- LayoutMismatch         data whose shape, dtype or layout is not the namespace's
     +-- RequestTooLarge        a request over a configured bound (batch, bytes)
     +-- CorruptBlock           a stored block failed its checksum or header checks
     +-- TierError              a tier could not do what was asked
     |    +-- TierUnavailable   the backend is down or answered too slowly
     |    +-- TierRefused       the backend answered but would not store (disk full)
     |    +-- TierFull          no room even after eviction
     +-- WireError              a request or answer breaks the wire format; carries its
     |                          ErrorCode, so it lives with the codes (kvstore.wire.codes)
     +-- StartupError           the daemon cannot start as configured (socket, port)
     +-- PutAborted             a put's block landed after the put had failed (daemon)
     +-- LoadInterrupted        a layer-wise load delivered fewer tokens than planned
     |                          (transformers integration: rerun from the good ones)
     +-- CommandFailed          a ``kvstore`` command's one line before its non-zero exit
                                (kvstore.cli.daemon_client)

``CorruptBlock`` and ``TierError`` rarely reach a caller of ``TieredStore``:
the store turns both into misses (and counts them), because a miss costs a
recompute while a wrong block silently corrupts a generation.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""


class ConfigError(KVStoreError):
    """The configuration is invalid (unknown tier, bad size, bad TOML)."""


class BadRequest(KVStoreError):
    """The daemon refused a request whose content it cannot accept (malformed, a number
    out of range, an event time too far from its clock)."""


class UnknownNamespace(KVStoreError):
    """A request refers to a namespace digest the store does not know."""


class LayoutMismatch(KVStoreError):
    """A chunk's dtype, shape or byte size does not match its namespace."""


class RequestTooLarge(KVStoreError):
    """A request exceeds a configured bound (chunks per batch, bytes per chunk)."""


class CorruptBlock(KVStoreError):
    """A stored block failed verification: magic, length, checksum, key or namespace."""


class TierError(KVStoreError):
    """A tier failed an operation; ``tier`` names which."""

    def __init__(self, tier: str, message: str) -> None:
        super().__init__(f"{tier}: {message}")
        self.tier = tier


class TierUnavailable(TierError):
    """The tier's backend is unreachable or timed out."""


class TierRefused(TierError):
    """The tier's backend answered but would not store the write (its disk is full,
    Redis is out of memory): reads still work, so it is not down."""


class TierFull(TierError):
    """The tier cannot hold the block even after evicting everything evictable."""


class StartupError(KVStoreError):
    """The daemon cannot start as configured (socket in use, port taken)."""


class PutAborted(KVStoreError):
    """A block finished landing after its put had already failed."""


class LoadInterrupted(KVStoreError):
    """A layer-wise load delivered fewer tokens than the forward was started with.

    Raised inside the forward by the first layer to need the missing data;
    rerun the prefill with a cache of ``good_tokens`` tokens.
    """

    def __init__(self, planned_tokens: int, good_tokens: int) -> None:
        super().__init__(f"loaded {good_tokens} of {planned_tokens} planned tokens")
        self.planned_tokens = planned_tokens
        self.good_tokens = good_tokens
