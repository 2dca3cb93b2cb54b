"""SGLang HiCache's L3 storage on kvstore: ``--hicache-storage-backend dynamic``.

::

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
      --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.client.sglang", "class_name": "KVStoreHiCache",
        "interface_v1": 1, "url": "unix:///root/.cache/kvstore/kvstore.sock"}'

::

    backend.py      KVStoreHiCache: the HiCacheStorage SGLang builds (needs SGLang)
    page_store.py   exists / get / put of pages on any kvstore client (no SGLang needed)
    pages.py        a page as a chunk: namespace and keys (no SGLang needed)

Written against SGLang 0.5.23's ``sglang.srt.mem_cache.hicache_storage``.
``"interface_v1": 1`` makes the controller call the slot-based
``batch_get_v1``/``batch_set_v1``, which read and write the host pool in
place; without it, SGLang hands pages as tensors to ``batch_get``/``batch_set``.
Either way the page bytes are opaque, keyed by SGLang's own page hashes.

Extra config keys besides SGLang's three: ``url`` (``unix://``, ``http://`` or
``embedded://``; default ``$KVSTORE_URL``, else the daemon's default socket),
``timeout_s`` (per I/O phase, default 2), ``backoff_s`` (how long calls
answer "nothing" without trying after the daemon failed one, default 1),
``tenant_salt`` (a deployment's
salt in the namespace, default none), ``batch_pages`` (pages per get or put,
32), ``exists_slice_pages`` (pages per lookup, 32) and ``exists_deadline_s``
(after it ``batch_exists`` asks no further slice, 0.05). Over ``http://`` the
token is ``$KVSTORE_AUTH_TOKEN``.

SGLang imports this package and asks it for ``KVStoreHiCache``; the backend
module, which needs SGLang itself, is imported only then, so ``pages`` and
``page_store`` import and are tested where SGLang is not installed.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name == "KVStoreHiCache":
        return importlib.import_module("kvstore.client.sglang.backend").KVStoreHiCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
