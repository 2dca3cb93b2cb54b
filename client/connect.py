"""``connect`` / ``connect_async``: one URL in, a client with the store's methods out."""

from __future__ import annotations

import enum

from kvstore.client.address import Address, Scheme, bearer_token
from kvstore.client.api import AsyncKVClientAPI, KVClientAPI
from kvstore.client.async_client import AsyncStoreClient
from kvstore.client.blocks import DEFAULT_VERIFY, Verify
from kvstore.client.embedded import AsyncEmbeddedClient, EmbeddedClient
from kvstore.client.sync_client import StoreClient
from kvstore.client.transports import async_transport, transport
from kvstore.errors import ConfigError
from kvstore.store.config import StoreConfig

# What ``connect`` / ``connect_async`` return: the daemon's client or an embedded one.
KVClient = KVClientAPI
AsyncKVClient = AsyncKVClientAPI


class Transfer(enum.Enum):
    """How a get's blocks reach the client.

    ``SHM``: blocks held in DRAM are copied out of the daemon's shared-memory
    arena, mapped read only (Unix socket only: same host); the rest travel
    as bytes. ``BYTES``: every block travels in the response body. ``AUTO``:
    ``SHM`` on a Unix socket, ``BYTES`` over TCP.
    """

    AUTO = "auto"
    SHM = "shm"
    BYTES = "bytes"


def connect(
    url: str,
    *,
    token: str | None = None,
    timeout_s: float = 2.0,
    transfer: Transfer | str = Transfer.AUTO,
    backoff_s: float = 1.0,
    max_connections: int = 64,
    verify: Verify | str = DEFAULT_VERIFY,
) -> KVClient:
    """A blocking client of the store at ``url`` (see ``client.address`` for the forms).

    Nothing is sent until the first call, so an engine starts even while its
    daemon is down. ``token`` (default ``$KVSTORE_AUTH_TOKEN``) is sent over
    TCP only. ``timeout_s`` bounds each I/O phase (pool, connect, write,
    read); ``backoff_s`` is how long calls degrade without trying after the
    daemon failed one. ``verify`` (``"fast"`` or ``"full"``) is how blocks copied out
    of shared memory are checked (``client.blocks.Verify``). ``embedded://``
    ignores every option but the URL.
    """
    address = Address.parse(url)
    if address.scheme is Scheme.EMBEDDED:
        return EmbeddedClient(_embedded_config(address))
    return StoreClient(
        address.base_url,
        transport=transport(address.path, max_connections),
        token=bearer_token(address, token),
        timeout_s=timeout_s,
        shm=_uses_shm(address, transfer),
        backoff_s=backoff_s,
        verify=verify,
    )


def connect_async(
    url: str,
    *,
    token: str | None = None,
    timeout_s: float = 2.0,
    transfer: Transfer | str = Transfer.AUTO,
    backoff_s: float = 1.0,
    max_connections: int = 64,
    verify: Verify | str = DEFAULT_VERIFY,
) -> AsyncKVClient:
    """The asyncio client of ``connect`` (same options); ``await client.close()``."""
    address = Address.parse(url)
    if address.scheme is Scheme.EMBEDDED:
        return AsyncEmbeddedClient(_embedded_config(address))
    return AsyncStoreClient(
        address.base_url,
        transport=async_transport(address.path, max_connections),
        # Bytes gets go over this one, on worker threads (``client.blocking``).
        blocking_transport=transport(address.path, max_connections),
        token=bearer_token(address, token),
        timeout_s=timeout_s,
        shm=_uses_shm(address, transfer),
        backoff_s=backoff_s,
        verify=verify,
    )


def _embedded_config(address: Address) -> StoreConfig:
    return StoreConfig.from_toml(address.path) if address.path else StoreConfig.from_env()


def _uses_shm(address: Address, choice: Transfer | str) -> bool:
    try:
        transfer = Transfer(choice)
    except ValueError:
        raise ConfigError(f"transfer must be 'auto', 'shm' or 'bytes', not {choice!r}") from None
    if transfer is Transfer.SHM and address.scheme is not Scheme.UNIX:
        raise ConfigError("transfer='shm' needs a unix:// daemon (the arena is on its host)")
    return transfer is Transfer.SHM or (transfer is Transfer.AUTO and address.scheme is Scheme.UNIX)
