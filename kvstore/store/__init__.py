"""The embedded engine: one thread-safe store over every configured tier.

::

    tiered_store.py  TieredStore: the embedded store's methods (lookup, put, get, ...)
    async_store.py   AsyncTieredStore: the same methods, awaitable
    core.py          StoreCore: one store's state and the steps its faces share
    state.py         StoreState: the lock, index, placement and counters, which only
                     this folder's modules touch
    shared.py        SharedServing: what other processes may do with the blocks
                     through a daemon (shared-memory gets, landed puts)
    placement.py     moving blocks between tiers: admission, write-back, promotion
    reservation.py   space in an arena written before anyone may read it (a daemon's
                     put lands its blocks there), published or given back
    eviction.py      EvictionPolicy (which block leaves a tier first) and LRU
    index.py         which tiers hold each chunk, its parent, its pins; per tier, the
                     prefix tree eviction takes leaves of
    reader.py        reading and verifying blocks out of a tier
    guarded.py       a tier failure as a miss, in one place
    write_through.py every put copied to a shared tier (Redis), off the put's path
    maintenance.py   scrubbing and flushing
    chunk.py         what callers hand the store and get back (KVChunk, CachedPrefix)
    out_buffers.py   a get's out= buffers: host ones filled in place, device tensors
                     through verified host staging
    config.py        StoreConfig and CostModel: the store's settings
    stats.py         the counters
    closing.py       the with-statement every face shares

May import: the format (``kvstore.errors``, ``keys``, ``block``, ``codec``,
``config``) and ``kvstore.tiers``; never the wire, the daemon, the client or
the predictor. Importing this package loads nothing: the names live in their
modules (``kvstore.TieredStore`` is the front door's).
"""
