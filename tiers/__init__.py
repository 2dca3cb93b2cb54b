"""The tiers: one batched byte store per level of the hierarchy, behind one protocol.

::

    registry.py     TierConfig, and the explicit table that opens a tier of each kind
    base.py         the Tier protocol every backend implements, and its contract
    extents.py      the page-aligned extent allocator of the memory arenas
    arena_tier.py   what the two memory tiers share: an index over an arena, generations
    arena_handle.py how a local client opens the daemon's HBM arena (CUDA IPC)
    hbm.py          GPU memory (a device tensor; ``device="cpu"`` runs it without a GPU)
    dram.py         host memory in a named shared-memory segment, pinned under CUDA
    prefault.py     committing the DRAM arena's pages in the background
    shm_segments.py room for the DRAM tier's segments in /dev/shm, and their leftovers
    lmdb_tier.py    local SSD through one LMDB environment
    lmdb_directory.py the directory it owns: one process at a time, damage moved aside
    redis_tier.py   Redis or Redis Cluster, the tier shared between hosts
    redis_access.py how the Redis tier reaches its server: addresses, AUTH/ACL, TLS
    redis_masters.py a cluster's masters, each answering for itself (a breaker each)
    redis_routing.py how one batch reaches each master of a Redis Cluster

A tier neither chooses what to evict nor knows about prefixes: that is the
store's (``kvstore.store``). The kinds themselves (``TierKind`` and the traits
table) are the format's, ``kvstore.kinds``: every layer names a kind, and the
daemon reaches no tier. May import: the format (``kvstore.errors``, ``keys``,
``kinds``, ``block``, ``config``) and nothing above it. The private redis-servers the
replay, the benchmarks and the tests start are ``kvstore.local``'s.
"""
