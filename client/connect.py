"""``connect`` / ``connect_async``: one URL in, a client with the store's methods out."""

from __future__ import annotations

import enum
from typing import TypedDict, Unpack

from kvstore.client.address import Address, Scheme, bearer_token
from kvstore.client.api import AsyncKVClientAPI, KVClientAPI
from kvstore.client.async_client import AsyncStoreClient
from kvstore.client.blocks import Verify
from kvstore.client.embedded import AsyncEmbeddedClient, EmbeddedClient
from kvstore.client.protocol import DEFAULTS, ClientOptions
from kvstore.client.sync_client import StoreClient
from kvstore.client.transports import async_transport, transport
from kvstore.errors import ConfigError
from kvstore.store.config import StoreConfig

# What ``connect`` / ``connect_async`` return: the daemon's client or an embedded one.
KVClient = KVClientAPI
AsyncKVClient = AsyncKVClientAPI
# Connections per client (and per transport: an asyncio client has two).
MAX_CONNECTIONS = 64


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


class ConnectOptions(TypedDict, total=False):
    """The keywords of ``connect`` and ``connect_async``, every one optional.

    ``token`` (default ``$KVSTORE_AUTH_TOKEN``) is sent over TCP only.
    ``timeout_s`` (2) bounds each I/O phase (pool, connect, write, read).
    ``transfer`` (``"auto"``) is how gets' blocks travel (``Transfer``).
    ``backoff_s`` (1) is how long calls degrade without trying after the
    daemon failed one. ``max_connections`` (64) bounds the connection pool.
    ``verify`` (``"fast"`` or ``"full"``) is how blocks copied out of shared
    memory are checked (``client.blocks.Verify``). ``embedded://`` ignores
    every option but the URL.
    """

    token: str | None
    timeout_s: float
    transfer: Transfer | str
    backoff_s: float
    max_connections: int
    verify: Verify | str


def connect(url: str, **options: Unpack[ConnectOptions]) -> KVClient:
    """A blocking client of the store at ``url`` (see ``client.address`` for the forms;
    ``ConnectOptions`` for the keywords).

    Nothing is sent until the first call, so an engine starts even while its
    daemon is down.
    """
    address = Address.parse(url)
    if address.scheme is Scheme.EMBEDDED:
        return EmbeddedClient(_embedded_config(address))
    client_options, pool = _resolved(address, options)
    return StoreClient(
        address.base_url, transport=transport(address.path, pool), options=client_options
    )


def connect_async(url: str, **options: Unpack[ConnectOptions]) -> AsyncKVClient:
    """The asyncio client of ``connect`` (same keywords); ``await client.close()``."""
    address = Address.parse(url)
    if address.scheme is Scheme.EMBEDDED:
        return AsyncEmbeddedClient(_embedded_config(address))
    client_options, pool = _resolved(address, options)
    return AsyncStoreClient(
        address.base_url,
        transport=async_transport(address.path, pool),
        # Bytes gets go over this one, on worker threads (``client.blocking``).
        blocking_transport=transport(address.path, pool),
        options=client_options,
    )


def _resolved(address: Address, options: ConnectOptions) -> tuple[ClientOptions, int]:
    """The client's options for ``address``, and the size of its connection pool."""
    unknown = set(options) - ConnectOptions.__optional_keys__
    if unknown:
        raise TypeError(f"unknown connect option(s): {sorted(unknown)}")
    resolved = ClientOptions(
        token=bearer_token(address, options.get("token")),
        timeout_s=options.get("timeout_s", DEFAULTS.timeout_s),
        shm=_uses_shm(address, options.get("transfer", Transfer.AUTO)),
        backoff_s=options.get("backoff_s", DEFAULTS.backoff_s),
        verify=options.get("verify", DEFAULTS.verify),
    )
    return resolved, options.get("max_connections", MAX_CONNECTIONS)


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
