"""Every face of the store implements the one API (``kvstore.client.api``), parameter by
parameter, so the six faces cannot drift apart."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from kvstore.client.api import AsyncKVClientAPI, AsyncKVStoreAPI, KVClientAPI, KVStoreAPI
from kvstore.client.async_client import AsyncStoreClient
from kvstore.client.embedded import AsyncEmbeddedClient, EmbeddedClient
from kvstore.client.sync_client import StoreClient
from kvstore.store.async_store import AsyncTieredStore
from kvstore.store.tiered_store import TieredStore

FACES: list[tuple[type, type]] = [
    (TieredStore, KVStoreAPI),
    (AsyncTieredStore, AsyncKVStoreAPI),
    (StoreClient, KVClientAPI),
    (EmbeddedClient, KVClientAPI),
    (AsyncStoreClient, AsyncKVClientAPI),
    (AsyncEmbeddedClient, AsyncKVClientAPI),
]
# Operations of the embedded store beyond the data path, which its awaitable face mirrors.
STORE_OPERATIONS = ("demote", "promote", "write_back", "pin", "unpin", "scrub", "flush")


def members(api: type) -> list[str]:
    """The methods a protocol (with its bases) declares."""
    return sorted(
        name
        for klass in api.__mro__
        if klass not in (object,) and getattr(klass, "_is_protocol", False)
        for name, value in vars(klass).items()
        if callable(value) and (not name.startswith("_") or name in _DUNDERS)
    )


_DUNDERS = {"__enter__", "__exit__", "__aenter__", "__aexit__"}


def parameters(method: Callable[..., Any]) -> list[tuple[str, Any, Any, Any]]:
    """Name, kind, default and annotation of each parameter but ``self``."""
    signature = inspect.signature(method)
    return [
        (p.name, p.kind, p.default, p.annotation) for p in list(signature.parameters.values())[1:]
    ]


@pytest.mark.parametrize(("face", "api"), FACES, ids=lambda item: item.__name__)
def test_each_face_has_every_method_of_its_protocol_with_its_parameters(
    face: type, api: type
) -> None:
    declared = members(api)
    assert declared  # the protocol is read, not empty
    for name in declared:
        wanted, given = getattr(api, name), getattr(face, name, None)
        assert given is not None, f"{face.__name__} lacks {name}"
        assert parameters(given) == parameters(wanted), f"{face.__name__}.{name}"
        assert inspect.iscoroutinefunction(given) == inspect.iscoroutinefunction(wanted), (
            f"{face.__name__}.{name} is {'not ' * inspect.iscoroutinefunction(wanted)}async"
        )


@pytest.mark.parametrize("name", STORE_OPERATIONS)
def test_the_awaitable_store_mirrors_every_operation_of_the_blocking_one(name: str) -> None:
    blocking, awaitable = getattr(TieredStore, name), getattr(AsyncTieredStore, name)
    assert inspect.iscoroutinefunction(awaitable)
    assert parameters(awaitable) == parameters(blocking)


def test_the_protocols_differ_only_in_being_awaited() -> None:
    for blocking, awaitable in ((KVStoreAPI, AsyncKVStoreAPI), (KVClientAPI, AsyncKVClientAPI)):
        names = [
            n.replace("__enter__", "__aenter__").replace("__exit__", "__aexit__")
            for n in members(blocking)
        ]
        assert sorted(names) == members(awaitable)
        for name in members(blocking):
            twin = name.replace("__enter__", "__aenter__").replace("__exit__", "__aexit__")
            assert parameters(getattr(blocking, name)) == parameters(getattr(awaitable, twin))


@pytest.mark.asyncio
async def test_an_embedded_client_is_the_store_and_drops_events() -> None:
    from support import kv

    with EmbeddedClient(kv.config(kv.dram(8))) as client:
        assert isinstance(client, KVClientAPI)
        client.put(kv.namespace(), kv.tokens(2), kv.chunks(2))
        client.request_finished(
            "s", steps=1, output_tokens=1, context_tokens=1, loaded_tokens=0, recomputed_tokens=1
        )
        assert client.lookup(kv.namespace(), kv.tokens(2)).num_chunks == 2
        assert client.client_stats().events_dropped == 0
    async with AsyncEmbeddedClient(kv.config(kv.dram(8))) as aclient:
        assert isinstance(aclient, AsyncKVClientAPI)
        await aclient.request_started("s", prompt_tokens=2, cached_tokens=0)
        assert await aclient.put(kv.namespace(), kv.tokens(2), kv.chunks(2)) == 2
        assert (await aclient.lookup(kv.namespace(), kv.tokens(2))).num_chunks == 2
