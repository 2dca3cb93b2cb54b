"""Raw ceilings for ``bench/tiers.py`` and ``bench/cluster.py``: each tier's backend
driven directly.

The store is measured against these: the same bytes moved by the backend with
nothing of kvstore around it (numpy memcpy, py-lmdb, redis-py, a torch copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from kvstore.tiers.registry import TierConfig


class RawBackend(Protocol):
    """The backend of one tier driven directly, with the same bytes as the store."""

    def load(self, payloads: Sequence[np.ndarray]) -> None:
        """Take this chunk size's payloads (untimed: conversions, buffers)."""

    def put(self, keys: Sequence[bytes]) -> None:
        """Store payload ``i`` under ``keys[i]``."""

    def get(self, keys: Sequence[bytes]) -> list[Any]:
        """Read the values under ``keys``."""

    def get_into(self, keys: Sequence[bytes], outs: Sequence[np.ndarray]) -> None:
        """Read the values under ``keys`` into the preallocated ``outs``, as cheaply as
        the backend allows (the ceiling of ``get(..., out=)``)."""

    def delete(self, keys: Sequence[bytes]) -> None: ...

    def close(self) -> None: ...


def _client_settings(config: TierConfig) -> dict[str, Any]:
    """redis-py connection settings as the Redis tier sets them (``tiers/redis_tier.py``)."""
    return {
        "decode_responses": False,
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "health_check_interval": 15,
        "max_connections": 32,
    }


class RawDRAM:
    """memcpy (``np.copyto``, one thread) into and out of preallocated, touched buffers."""

    def load(self, payloads: Sequence[np.ndarray]) -> None:
        self._sources = list(payloads)
        sizes = [p.nbytes for p in payloads]
        self._offsets = np.cumsum([0, *sizes[:-1]]).tolist()
        self._arena = np.zeros(sum(sizes), dtype=np.uint8)
        self._outs = [np.zeros(n, dtype=np.uint8) for n in sizes]

    def put(self, keys: Sequence[bytes]) -> None:
        arena = self._arena
        for source, offset in zip(self._sources, self._offsets, strict=False):
            np.copyto(arena[offset : offset + source.nbytes], source)

    def get(self, keys: Sequence[bytes]) -> list[Any]:
        self.get_into(keys, self._outs)
        return self._outs

    def get_into(self, keys: Sequence[bytes], outs: Sequence[np.ndarray]) -> None:
        arena = self._arena
        for out, offset in zip(outs, self._offsets, strict=False):
            np.copyto(out, arena[offset : offset + out.nbytes])

    def delete(self, keys: Sequence[bytes]) -> None:
        pass

    def close(self) -> None:
        self._arena = self._sources = self._outs = None  # type: ignore[assignment]


class RawLMDB:
    """py-lmdb with the LMDB tier's open flags, in its own env beside the store's."""

    def __init__(self, path: Path, map_size: int, *, sync: bool = True) -> None:
        import lmdb

        # Same flags as kvstore.tiers.lmdb_tier.LMDBTier opens with.
        self._env = lmdb.open(
            str(path),
            map_size=map_size,
            subdir=True,
            sync=sync,
            readahead=False,
            meminit=False,
            lock=True,
            max_dbs=0,
        )

    def load(self, payloads: Sequence[np.ndarray]) -> None:
        self._values = [p.tobytes() for p in payloads]

    def put(self, keys: Sequence[bytes]) -> None:
        with self._env.begin(write=True) as txn:
            for key, value in zip(keys, self._values, strict=False):
                txn.put(key, value)

    def get(self, keys: Sequence[bytes]) -> list[Any]:
        with self._env.begin() as txn:  # buffers=False: each value comes back as bytes
            return [txn.get(key) for key in keys]

    def get_into(self, keys: Sequence[bytes], outs: Sequence[np.ndarray]) -> None:
        with self._env.begin(buffers=True) as txn:  # zero-copy views of the map
            for key, out in zip(keys, outs, strict=True):
                value = txn.get(key)
                if value is None:
                    raise KeyError(key)
                np.copyto(out, np.frombuffer(value, dtype=np.uint8))

    def delete(self, keys: Sequence[bytes]) -> None:
        with self._env.begin(write=True) as txn:
            for key in keys:
                txn.delete(key)

    def close(self) -> None:
        self._env.close()


class RawRedis:
    """redis-py pipelined SET/GET (hiredis parser), the Redis tier's client settings."""

    def __init__(self, url: str, config: TierConfig) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._pool = redis.BlockingConnectionPool.from_url(
            url,
            timeout=config.socket_timeout_s,
            retry=Retry(NoBackoff(), retries=1),
            **_client_settings(config),
        )
        self._client = redis.Redis(connection_pool=self._pool)

    def load(self, payloads: Sequence[np.ndarray]) -> None:
        self._values = [p.tobytes() for p in payloads]

    def put(self, keys: Sequence[bytes]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key, value in zip(keys, self._values, strict=False):
            pipe.set(b"raw:" + key, value)
        pipe.execute()

    def get(self, keys: Sequence[bytes]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.get(b"raw:" + key)
        return list(pipe.execute())

    def get_into(self, keys: Sequence[bytes], outs: Sequence[np.ndarray]) -> None:
        for value, out in zip(self.get(keys), outs, strict=True):
            np.copyto(out, np.frombuffer(value, dtype=np.uint8))

    def delete(self, keys: Sequence[bytes]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.delete(b"raw:" + key)
        pipe.execute()

    def close(self) -> None:
        self._client.close()
        self._pool.disconnect()


class RawRedisCluster:
    """redis-py cluster pipelines (hiredis parser) with the Redis tier's client settings,
    on whole Redis keys: a ``SET``/``GET``/``EXISTS`` per key, one pipeline per call,
    which redis-py splits by master. One instance per thread (each its own pools)."""

    def __init__(self, nodes: Sequence[str], config: TierConfig) -> None:
        import redis.cluster

        startup = [
            redis.cluster.ClusterNode(host, int(port))
            for host, _, port in (node.rpartition(":") for node in nodes)
        ]
        self._client = redis.cluster.RedisCluster(startup_nodes=startup, **_client_settings(config))

    def _pipelined(
        self, command: str, keys: Sequence[bytes], *values: Sequence[bytes]
    ) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for key, *value in zip(keys, *values, strict=True):
            pipe.execute_command(command, key, *value)
        return list(pipe.execute())

    def set_many(self, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        self._pipelined("SET", keys, values)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._pipelined("GET", keys)

    def exists_all(self, keys: Sequence[bytes]) -> bool:
        return all(self._pipelined("EXISTS", keys))

    def delete(self, keys: Sequence[bytes]) -> None:
        self._pipelined("DEL", keys)

    def close(self) -> None:
        self._client.close()


class RawHBM:
    """Pinned host <-> device ``copy_(non_blocking=True)`` per chunk, one sync per batch."""

    def __init__(self, device: str = "cuda") -> None:
        self._device = torch.device(device)

    def load(self, payloads: Sequence[np.ndarray]) -> None:
        self._sources = [torch.from_numpy(p).pin_memory() for p in payloads]
        sizes = [p.nbytes for p in payloads]
        self._offsets = np.cumsum([0, *sizes[:-1]]).tolist()
        self._arena = torch.zeros(sum(sizes), dtype=torch.uint8, device=self._device)
        self._outs = [torch.zeros(n, dtype=torch.uint8, pin_memory=True) for n in sizes]

    def put(self, keys: Sequence[bytes]) -> None:
        for source, offset in zip(self._sources, self._offsets, strict=False):
            self._arena[offset : offset + source.numel()].copy_(source, non_blocking=True)
        torch.cuda.synchronize(self._device)

    def get(self, keys: Sequence[bytes]) -> list[Any]:
        for out, offset in zip(self._outs, self._offsets, strict=False):
            out.copy_(self._arena[offset : offset + out.numel()], non_blocking=True)
        torch.cuda.synchronize(self._device)
        return self._outs

    def get_into(self, keys: Sequence[bytes], outs: Sequence[np.ndarray]) -> None:
        for out, offset in zip(outs, self._offsets, strict=False):
            target = torch.from_numpy(out)
            target.copy_(self._arena[offset : offset + target.numel()], non_blocking=True)
        torch.cuda.synchronize(self._device)

    def delete(self, keys: Sequence[bytes]) -> None:
        pass

    def close(self) -> None:
        self._sources = self._outs = []
        self._arena = torch.empty(0)
