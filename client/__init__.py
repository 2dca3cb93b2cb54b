"""Engine-side client of the kvstore daemon (``kvstore serve``) and of embedded stores.

::

    import kvstore

    with kvstore.connect("unix:///run/kvstore/kvstore.sock") as store:
        prefix = store.lookup(ns, token_ids)          # same methods as TieredStore
        chunks = store.get(ns, prefix.keys, out=buffers)
        store.put(ns, token_ids, kv_chunks, session="agent-7")
        store.request_finished("agent-7", steps=3, output_tokens=875, ...)

One design, two faces (as httpx pairs ``Client`` and ``AsyncClient``)::

    KVStoreAPI, KVClientAPI          api.py              the one API protocol every face implements
    connect / connect_async          connect.py          URL (address.py) -> client
      StoreClient | AsyncStoreClient sync_client.py,     I/O only, over httpx transports
                                     async_client.py
                                     transports.py       Unix socket or TCP, bounded pools
                                     blocking.py         one blocking exchange, both shells
        ClientProtocol               protocol.py         every operation, sans-IO generators
          Call, Reply                exchange.py         one exchange asked for, its answer read
          FramesSink, copy_leased    blocks.py           verify each received block
          PutBody                    put_body.py         a put's frames, sealed as it goes
          open_body                  get_body.py         a get's body read off the socket
          BufferPool                 buffers.py          plain gets' payload buffers, reused
          FinishedLeases             finished_leases.py  leases to give back with the next get
          LeasedCopier               leased_copy.py      a shared-memory get's copies out
            SharedArena              shm.py                of the daemon's DRAM arena
            HBMArena, copy_device    device.py             and of its HBM arena (CUDA IPC)
          ClientStats, from_reply    failures.py         what degrades, what raises, counted
      EmbeddedClient | Async...      embedded.py         embedded:// (a store in this process)
    hf/                              transformers models on the store
    vllm/                            vLLM's KV connector
    sglang/                          SGLang HiCache's L3 storage backend

Session events (``RequestStarted``, ...) are ``kvstore.wire.events``: one schema
for the client, the daemon and the predictor. May import: the format, the
store (for the embedded faces and the result types) and the wire; never the
daemon or the predictor.

What degrades and what raises is drawn in ``kvstore.client.failures``.
"""

from kvstore.client.async_client import AsyncStoreClient
from kvstore.client.blocks import Verify
from kvstore.client.connect import AsyncKVClient, KVClient, Transfer, connect, connect_async
from kvstore.client.embedded import AsyncEmbeddedClient, EmbeddedClient
from kvstore.client.failures import ClientStats
from kvstore.client.sync_client import StoreClient
from kvstore.wire.events import Trigger

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
