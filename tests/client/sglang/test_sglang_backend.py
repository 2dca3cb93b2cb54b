"""``KVStoreHiCache`` built by SGLang's own backend factory and driven through the calls
SGLang's HiCache controller makes, over a real ``kvstore serve`` daemon.

The controller (``sglang.srt.managers.cache_controller``) creates the backend
with ``StorageBackendFactory.create_backend("dynamic", config, host_pool)``,
registers the host pool, then, per batch of at most ``STORAGE_BATCH_SIZE``
pages: ``batch_exists`` on its prefetch thread, ``batch_get_v1`` (or
``batch_get``) on its prefetch I/O thread, ``batch_set_v1`` (or ``batch_set``)
on its backup thread. Page hashes come from SGLang's ``get_hash_str``. The
host pool is ``support.sglang_pages.HostPool``: SGLang's own pools do not import
next to the CPU torch (that module's docstring says which import fails).

Run by ``make test-sglang`` (its own virtual environment); skipped where SGLang
is not installed, as in the main suite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="SGLang is not installed here; `make test-sglang` runs these",
)

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from support.daemon import Daemon  # noqa: E402
from support.lmdb_blocks import damage_block  # noqa: E402
from support.sglang_pages import PAGE_BYTES, PAGE_SIZE, HostPool  # noqa: E402

import kvstore  # noqa: E402
from kvstore.client.sglang.backend import KVStoreHiCache  # noqa: E402
from kvstore.kinds import TierKind  # noqa: E402

Attach = Callable[..., KVStoreHiCache]
MODEL = "Qwen/Qwen3-0.6B"
PAGES = 6
TOKENS = list(range(100, 100 + PAGES * PAGE_SIZE))
HASHES: list[str] = get_hash_str(TOKENS, None, page_size=PAGE_SIZE)
# LMDB only: every read is verified, and the files survive a restart and can be damaged.
SSD_ONLY = """\
data_dir = "{data_dir}"

[tiers.ssd]
capacity = "64MiB"
"""


def attach(
    daemon: Daemon, pool: HostPool, *, zero_copy: bool = True, tp: tuple[int, int] = (0, 1),
    **extra: Any,
) -> KVStoreHiCache:  # fmt: skip
    """The backend as the controller attaches it (``attach_storage_backend``)."""
    config = HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=MODEL,
        extra_config={
            "backend_name": "kvstore", "module_path": "kvstore.client.sglang",
            "class_name": "KVStoreHiCache", "interface_v1": int(zero_copy),
            "url": daemon.url, "backoff_s": 0, **extra,
        },
    )  # fmt: skip
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    storage.on_host_pools_registered()
    assert isinstance(storage, KVStoreHiCache)
    return storage


def prefetch_hits(storage: HiCacheStorage, hashes: list[str]) -> int:
    """``_storage_hit_query``: batch by batch, stopping at the first short answer."""
    hits = 0
    for start in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[start : start + STORAGE_BATCH_SIZE]
        found = storage.batch_exists(batch, HiCacheStorageExtraInfo(prefix_keys=None))
        hits += found
        if found < len(batch):
            break
    return hits


def backed_up(storage: HiCacheStorage, pages: range) -> list[bool]:
    """``_page_set_zero_copy`` of ``pages`` from the backend's host pool, same slots."""
    slots = storage.mem_pool_host.slots(pages)
    result: list[bool] = storage.batch_set_v1(
        HASHES[pages.start : pages.stop], slots, HiCacheStorageExtraInfo()
    )
    return result


def loaded(storage: HiCacheStorage, first_slot: int, count: int) -> list[bool]:
    """``_page_get_zero_copy`` of pages ``0 .. count-1`` into the backend's host pool,
    at its pages from ``first_slot`` on."""
    slots = storage.mem_pool_host.slots(range(first_slot, first_slot + count))
    result: list[bool] = storage.batch_get_v1(HASHES[:count], slots, HiCacheStorageExtraInfo())
    return result


def ssd_stats(daemon: Daemon) -> Any:
    with kvstore.connect(daemon.url, timeout_s=10.0) as client:
        return client.stats().tiers[TierKind.SSD]


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(SSD_ONLY)


@pytest.fixture
def backend(daemon: Daemon) -> Iterator[Attach]:
    """``attach`` to ``daemon``; every backend it made is closed after the test (``detach``)."""
    made: list[KVStoreHiCache] = []

    def make(pool: HostPool, **options: Any) -> KVStoreHiCache:
        made.append(attach(daemon, pool, **options))
        return made[-1]

    yield make
    for storage in made:
        storage.close()


@dataclass
class TwoEngines:
    """Two engine processes of one model and rank: ``writer`` has backed up pages 0-3
    of ``source``; ``reader`` loads into the empty ``target``, two pages a request."""

    source: HostPool
    target: HostPool
    writer: KVStoreHiCache
    reader: KVStoreHiCache


@pytest.fixture
def engines(backend: Attach) -> TwoEngines:
    source, target = HostPool(PAGES, seed=1), HostPool(PAGES + 2)
    engines = TwoEngines(source, target, backend(source), backend(target, batch_pages=2))
    assert backed_up(engines.writer, range(4)) == [True] * 4
    return engines


def test_sglang_builds_the_backend_from_its_dynamic_extra_config(
    daemon: Daemon, backend: Attach
) -> None:
    storage = backend(HostPool(PAGES))
    assert isinstance(storage, HiCacheStorage)
    pages = storage.store.pages
    assert pages.namespace.model == f"sglang:{MODEL}:pp0/1:tp0/1"
    assert pages.namespace.layout.name == "sglang-page:page_first:bfloat16"
    assert (pages.page_size, pages.page_bytes) == (PAGE_SIZE, PAGE_BYTES)


def test_pages_backed_up_by_one_engine_load_into_another_exactly(engines: TwoEngines) -> None:
    assert prefetch_hits(engines.reader, HASHES) == 4
    assert loaded(engines.reader, first_slot=2, count=4) == [True] * 4
    for page in range(4):
        assert torch.equal(engines.target.page(2 + page), engines.source.page(page))
    assert torch.count_nonzero(engines.target.kv_buffer[:, : 2 * PAGE_SIZE]) == 0


def test_the_tensor_interface_round_trips_and_misses_as_none(
    daemon: Daemon, backend: Attach
) -> None:
    pool = HostPool(PAGES, seed=2)
    storage = backend(pool, zero_copy=False)
    # ``_generic_page_set``: the pool's pages as tensors.
    assert storage.batch_set(HASHES[:3], [pool.page(page) for page in range(3)])
    assert storage.exists(HASHES[2]) and not storage.exists(HASHES[3])
    # ``_generic_page_get``: dummy pages to fill, None for a page not held.
    pages = storage.batch_get(HASHES[:4], [pool.get_dummy_flat_data_page() for _ in range(4)])
    assert [page is None for page in pages] == [False, False, False, True]
    for index in range(3):
        assert torch.equal(pages[index], pool.page(index))
    single = storage.get(HASHES[1])
    assert single is not None and torch.equal(single, pool.page(1))
    assert storage.set(HASHES[3], pool.page(3)) and prefetch_hits(storage, HASHES) == 4


def test_a_stopped_daemon_fails_every_call_and_pages_outlive_its_restart(
    daemon: Daemon, engines: TwoEngines
) -> None:
    writer, reader, target = engines.writer, engines.reader, engines.target
    daemon.stop()
    assert prefetch_hits(reader, HASHES) == 0
    assert loaded(reader, first_slot=0, count=4) == [False] * 4
    assert backed_up(writer, range(4, 6)) == [False] * 2
    assert torch.count_nonzero(target.kv_buffer) == 0
    daemon.start()
    assert prefetch_hits(reader, HASHES) == 4  # the backup while it was down was lost
    assert loaded(reader, first_slot=0, count=4) == [True] * 4
    pages_0_to_3 = slice(0, 4 * PAGE_SIZE)
    assert torch.equal(target.kv_buffer[:, pages_0_to_3], engines.source.kv_buffer[:, pages_0_to_3])


def test_a_corrupt_page_is_missing_and_its_slot_left_untouched(
    daemon: Daemon, engines: TwoEngines
) -> None:
    reader, target = engines.reader, engines.target
    pages = reader.store.pages
    daemon.stop()
    damage_block(daemon.data_dir / "lmdb", pages.namespace, pages.keys(HASHES)[1])
    daemon.start()
    before = ssd_stats(daemon).corrupt_blocks
    assert prefetch_hits(reader, HASHES) == 4  # a lookup reads no payload
    assert loaded(reader, first_slot=0, count=4) == [True, False, True, True]
    assert ssd_stats(daemon).corrupt_blocks - before == 1
    assert torch.count_nonzero(target.page(1)) == 0
    for page in (0, 2, 3):
        assert torch.equal(target.page(page), engines.source.page(page))
    assert prefetch_hits(reader, HASHES) == 1  # the store dropped the damaged page


def test_other_tenants_and_ranks_find_none_of_the_pages(daemon: Daemon, backend: Attach) -> None:
    source = HostPool(PAGES, seed=5)
    writer = backend(source, tenant_salt="tenant-a")
    assert backed_up(writer, range(PAGES)) == [True] * PAGES
    others = [
        backend(HostPool(PAGES), tenant_salt="tenant-b"),
        backend(HostPool(PAGES)),  # no salt
        backend(HostPool(PAGES), tenant_salt="tenant-a", tp=(1, 2)),
    ]
    for other in others:
        assert prefetch_hits(other, HASHES) == 0
        assert loaded(other, first_slot=0, count=2) == [False, False]
    assert prefetch_hits(backend(HostPool(PAGES), tenant_salt="tenant-a"), HASHES) == PAGES
