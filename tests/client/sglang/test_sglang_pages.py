"""An SGLang page hash is one chunk key inside a namespace that binds everything the page's
bytes depend on (no SGLang needed)."""

from __future__ import annotations

import pytest
from support.sglang_pages import PAGE_BYTES, PAGE_SIZE, page_hashes

from kvstore.client.sglang.pages import PageFormat
from kvstore.errors import ConfigError
from kvstore.keys import HashAlgo, external_keys

HASHES = page_hashes(3)


def pages(**changes: object) -> PageFormat:
    fields: dict[str, object] = {
        "model": "Qwen/Qwen3-0.6B",
        "page_size": PAGE_SIZE,
        "page_bytes": PAGE_BYTES,
        "pool_layout": "page_first",
        "dtype": "bfloat16",
    }
    return PageFormat(**{**fields, **changes})  # type: ignore[arg-type]


def test_a_page_hash_is_one_key_of_its_namespace_as_opaque_bytes() -> None:
    fmt = pages()
    namespace = fmt.namespace
    assert namespace.model == "sglang:Qwen/Qwen3-0.6B:pp0/1:tp0/1"
    assert namespace.hash_algo is HashAlgo.SHA256
    assert namespace.layout.name == "sglang-page:page_first:bfloat16"
    assert (namespace.layout.dtype, namespace.layout.chunk_nbytes) == ("uint8", PAGE_BYTES)
    keys = fmt.keys(HASHES)
    assert keys == external_keys(namespace, [page_hash.encode() for page_hash in HASHES])
    assert len(set(keys)) == 3 and all(len(key) == 16 for key in keys)
    assert pages().keys(HASHES) == keys  # a pure function of its inputs


@pytest.mark.parametrize(
    "change",
    [
        {"model": "Qwen/Qwen3-8B"},
        {"page_size": 2 * PAGE_SIZE},
        {"page_bytes": 2 * PAGE_BYTES},
        {"pool_layout": "layer_first"},
        {"dtype": "float16"},
        {"tp_rank": 1, "tp_size": 2},
        {"pp_rank": 1, "pp_size": 2},
        {"shard": "cp1/2"},
        {"tenant_salt": "tenant-a"},
    ],
)
def test_each_bound_field_changes_every_key(change: dict[str, object]) -> None:
    assert not set(pages(**change).keys(HASHES)) & set(pages().keys(HASHES))


def test_mla_pages_are_shared_by_every_tp_rank_and_no_other_pool() -> None:
    rank0 = pages(replicated=True, tp_rank=0, tp_size=2).keys(HASHES)
    assert pages(replicated=True, tp_rank=1, tp_size=4).keys(HASHES) == rank0
    assert pages(replicated=True).namespace.model == "sglang:Qwen/Qwen3-0.6B:pp0/1"
    assert not set(pages(tp_rank=0, tp_size=2).keys(HASHES)) & set(rank0)


def test_a_page_that_fits_no_layout_is_refused() -> None:
    with pytest.raises(ConfigError, match="2 x tokens"):
        pages(page_bytes=2 * PAGE_SIZE + 1)
    with pytest.raises(ConfigError, match="positive"):
        pages(page_size=0)
