"""The backend's exists / get / put on real stores (an embedded LMDB store, a daemon), without
SGLang: leading runs, the exists deadline, and failed or corrupt pages reported missing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from support.daemon import Daemon
from support.lmdb_blocks import damage_block
from support.sglang_pages import PAGE_BYTES, PAGE_SIZE, page_hashes, random_pages

import kvstore
from kvstore import TierKind
from kvstore.client.embedded import EmbeddedClient
from kvstore.client.sglang.page_store import PageStore, PageStoreOptions
from kvstore.client.sglang.pages import PageFormat
from kvstore.store.config import StoreConfig
from kvstore.tiers.registry import TierConfig

HASHES = page_hashes(6)
PAGES = random_pages(6, seed=0)


def page_format(tenant_salt: str | None = None) -> PageFormat:
    return PageFormat(
        model="Qwen/Qwen3-0.6B",
        page_size=PAGE_SIZE,
        page_bytes=PAGE_BYTES,
        pool_layout="page_first",
        dtype="bfloat16",
        tenant_salt=tenant_salt,
    )


def lmdb_only(tmp_path: Path) -> StoreConfig:
    """Every read comes off LMDB and is verified; the files can be damaged between runs."""
    return StoreConfig(tiers=(TierConfig(TierKind.SSD, 64 << 20, path=tmp_path / "lmdb"),))


@pytest.fixture
def client(tmp_path: Path) -> Iterator[EmbeddedClient]:
    with EmbeddedClient(lmdb_only(tmp_path)) as embedded:
        yield embedded


def empty_like(pages: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(page) for page in pages]


def test_exists_is_the_leading_run_and_get_returns_exactly_what_was_put(
    client: EmbeddedClient,
) -> None:
    store = PageStore(client, page_format())
    assert store.put(HASHES[:4], PAGES[:4]) == [True] * 4
    assert store.put(HASHES[5:], PAGES[5:]) == [True]
    assert store.exists(HASHES) == 4  # page 4 was never stored: page 5 does not count
    out = empty_like(PAGES)
    assert store.get(HASHES, out) == [True, True, True, True, False, True]
    for index in (0, 1, 2, 3, 5):
        assert torch.equal(out[index], PAGES[index])
    assert store.exists([]) == 0


def test_exists_asks_no_slice_after_its_deadline(client: EmbeddedClient) -> None:
    PageStore(client, page_format()).put(HASHES, PAGES)
    expired = PageStore(
        client, page_format(), PageStoreOptions(exists_slice_pages=2, exists_deadline_s=0)
    )
    assert expired.exists(HASHES) == 2  # the first slice is always asked
    patient = PageStore(
        client, page_format(), PageStoreOptions(exists_slice_pages=2, exists_deadline_s=60)
    )
    assert patient.exists(HASHES) == 6


def test_a_corrupt_page_is_reported_missing_never_returned(tmp_path: Path) -> None:
    with EmbeddedClient(lmdb_only(tmp_path)) as client:
        store = PageStore(client, page_format())
        assert store.put(HASHES[:3], PAGES[:3]) == [True] * 3
    pages = page_format()
    damage_block(tmp_path / "lmdb", pages.namespace, pages.keys(HASHES)[1])
    with EmbeddedClient(lmdb_only(tmp_path)) as client:
        store = PageStore(client, page_format())
        assert store.exists(HASHES[:3]) == 3  # a lookup reads no payload
        out = empty_like(PAGES[:3])
        assert store.get(HASHES[:3], out) == [True, False, True]
        assert torch.equal(out[0], PAGES[0]) and torch.equal(out[2], PAGES[2])
        assert client.stats().tiers[TierKind.SSD].corrupt_blocks == 1
        assert store.exists(HASHES[:3]) == 1  # the damaged page was dropped


def test_a_page_of_the_wrong_size_is_refused_and_not_stored(client: EmbeddedClient) -> None:
    store = PageStore(client, page_format())
    short = torch.zeros(PAGE_BYTES // 2 - 1, dtype=torch.bfloat16)
    assert store.put(HASHES[:2], [PAGES[0], short]) == [False, False]  # one request, refused
    assert store.exists(HASHES) == 0
    assert store.get(HASHES[:1], [torch.zeros(3, dtype=torch.bfloat16)]) == [False]


def test_another_tenant_finds_none_of_the_pages(client: EmbeddedClient) -> None:
    assert PageStore(client, page_format("tenant-a")).put(HASHES, PAGES) == [True] * 6
    other = PageStore(client, page_format("tenant-b"))
    assert other.exists(HASHES) == 0
    assert other.get(HASHES[:2], empty_like(PAGES[:2])) == [False, False]
    assert PageStore(client, page_format("tenant-a")).exists(HASHES) == 6


def test_a_stopped_daemon_fails_every_call_and_a_restarted_one_serves_the_pages(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory()
    with kvstore.connect(daemon.url, timeout_s=2.0, backoff_s=0.0) as remote:
        store = PageStore(remote, page_format())
        assert store.put(HASHES[:3], PAGES[:3]) == [True] * 3
        daemon.stop()
        assert store.exists(HASHES) == 0
        assert store.get(HASHES[:3], empty_like(PAGES[:3])) == [False] * 3
        assert store.put(HASHES[3:], PAGES[3:]) == [False] * 3
        daemon.start()
        assert store.exists(HASHES) == 3  # LMDB kept them; the put while down was lost
        out = empty_like(PAGES[:3])
        assert store.get(HASHES[:3], out) == [True] * 3
        assert all(torch.equal(got, page) for got, page in zip(out, PAGES, strict=False))
