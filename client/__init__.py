"""Engine-side client of the kvstore daemon (``kvstore serve``) and of embedded stores.

::

    import kvstore

    with kvstore.connect("unix:///run/kvstore/kvstore.sock") as store:
        prefix = store.lookup(ns, token_ids)          # same methods as TieredStore
        chunks = store.get(ns, prefix.keys, out=buffers)
        store.put(ns, token_ids, kv_chunks, session="agent-7")
        store.request_finished("agent-7", steps=3, output_tokens=875, ...)

One design, two faces (as httpx pairs ``Client`` and ``AsyncClient``)::

    connect / connect_async          connect.py     URL (address.py) -> client
      StoreClient | AsyncStoreClient sync.py, aio.py  I/O only, over httpx transports
                                     transports.py  Unix socket or TCP, bounded pools
        ClientProtocol               protocol.py    every operation, sans-IO generators
          FramesSink, copy_leased    blocks.py      verify each received block
          BufferPool                 buffers.py     plain gets' payload buffers, reused
          SharedArena                shm.py         the daemon's DRAM arena, read only
          from_transport, from_reply failures.py    what degrades, what raises
          ClientStats                stats.py       what degraded, counted
          RequestStarted, ...        kvstore.events session events (schema shared with the daemon)
      EmbeddedClient | Async...      embedded.py    embedded:// (a store in this process)

What degrades and what raises is drawn in ``kvstore.client.failures``.
"""

from kvstore.client.aio import AsyncStoreClient
from kvstore.client.blocks import Verify
from kvstore.client.connect import AsyncKVClient, KVClient, Transfer, connect, connect_async
from kvstore.client.embedded import AsyncEmbeddedClient, EmbeddedClient
from kvstore.client.stats import ClientStats
from kvstore.client.sync import StoreClient
from kvstore.events import Trigger

__all__ = [
    "AsyncEmbeddedClient",
    "AsyncKVClient",
    "AsyncStoreClient",
    "ClientStats",
    "EmbeddedClient",
    "KVClient",
    "StoreClient",
    "Transfer",
    "Trigger",
    "Verify",
    "connect",
    "connect_async",
]
