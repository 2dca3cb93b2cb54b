"""vLLM v1 on kvstore: ``kv_connector_module_path = "kvstore.client.vllm"``.

::

    connector.py   KVStoreConnector: the class vLLM builds, one per role (needs vLLM)
    scheduler.py   the scheduler side: lookups and load/save plans
      lookups.py     lookups sent on arrival, on their own thread, within a deadline
      held_blocks.py the blocks it remembers the store holds, answered from at once
      sessions.py    session events for the daemon's predictor
    worker.py      the worker side: loads before the forward, saves after it
      loads.py       large loads off the step, on a thread of their own
      saves.py       saves gathered into a bounded pool, put by their own thread
      cache_pages.py every copy into and out of vLLM's KV cache
    pages.py       the page format both sides assume (no vLLM needed)
    block_keys.py  vLLM block hashes as kvstore keys, derived once

vLLM imports this package and asks it for ``KVStoreConnector``; the connector
module, which needs vLLM itself, is imported only then, so ``pages``,
``scheduler`` and ``worker`` import and are tested where vLLM is not installed.
"""

from __future__ import annotations

import importlib
from typing import Any

_CONNECTOR_NAMES = frozenset({"KVStoreConnector", "KVStoreConnectorMetadata"})


def __getattr__(name: str) -> Any:
    if name in _CONNECTOR_NAMES:
        return getattr(importlib.import_module("kvstore.client.vllm.connector"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
