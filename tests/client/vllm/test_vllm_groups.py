"""Several KV cache groups (vLLM's hybrid KV cache manager) without vLLM: a group's
format and namespace, the scheduler's per-group plans (a sliding window's null blocks
neither loaded nor saved, every load asynchronous), and the worker's per-group saves
and loads through a real daemon, a failed load named as its request's."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.daemon import Daemon
from support.polling import until

import kvstore
from kvstore.client.connect import KVClient
from kvstore.client.vllm.pages import NULL_BLOCK_ID, BlockTransfer, page_formats
from kvstore.client.vllm.scheduler import SchedulerSide
from kvstore.client.vllm.worker import WorkerSide
from kvstore.errors import ConfigError

BLOCK = 16
WINDOW = 32  # tokens: two blocks


class FullAttentionSpec(SimpleNamespace):
    """vLLM's spec classes are told apart by name; these carry the fields read."""


class SlidingWindowSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def spec(kind: type, block_size: int = BLOCK, **extra: Any) -> Any:
    page_size_bytes = 2 * block_size * 2 * 8 * 4  # heads x tokens x (K|V) x head x fp32
    return kind(
        num_kv_heads=2,
        head_size=8,
        dtype=torch.float32,
        block_size=block_size,
        page_size_bytes=page_size_bytes,
        **extra,
    )


def configs(*groups: tuple[list[str], Any]) -> tuple[Any, Any]:
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="/models/hybrid", revision=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    kv_cache_groups = [
        SimpleNamespace(layer_names=layers, kv_cache_spec=kv_spec) for layers, kv_spec in groups
    ]
    return vllm_config, SimpleNamespace(kv_cache_groups=kv_cache_groups)


HYBRID = configs(
    (["layers.1.attn", "layers.3.attn"], spec(FullAttentionSpec)),
    (["layers.0.attn", "layers.2.attn"], spec(SlidingWindowSpec, sliding_window=WINDOW)),
)
GROUPS = page_formats(*HYBRID, tp_rank=0)
FULL, SLIDING = GROUPS


def test_each_group_is_a_format_and_a_namespace_of_its_own() -> None:
    assert FULL.layer_names == ("layers.1.attn", "layers.3.attn") and FULL.sliding_window is None
    assert SLIDING.sliding_window == WINDOW
    # The same shape, another group: never the same keys.
    assert FULL.layout == SLIDING.layout
    hashes = [hashlib.sha256(b"block").digest()]
    assert FULL.keys(None, hashes) != SLIDING.keys(None, hashes)
    # A model of one group keeps the namespace it always had.
    (only,) = page_formats(*configs((["layers.0.attn"], spec(FullAttentionSpec))), tp_rank=0)
    assert only.group_layer is None
    assert only.namespace(None).model == "vllm:/models/hybrid@main:tp0/1"


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (
            [(["a"], spec(FullAttentionSpec)), (["b"], MambaSpec(block_size=BLOCK))],
            r"not MambaSpec \(layers \['b'\]\)",
        ),
        (
            [(["a"], spec(FullAttentionSpec)), (["b"], spec(FullAttentionSpec, block_size=32))],
            r"one block size for every KV cache group, not \[16, 32\]",
        ),
    ],
)
def test_groups_the_connector_cannot_store_are_refused_at_start(
    groups: list[tuple[list[str], Any]], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        page_formats(*configs(*groups), tp_rank=0)


def request(name: str, blocks: int) -> SimpleNamespace:
    hashes = [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(blocks)]
    return SimpleNamespace(
        request_id=name,
        block_hashes=hashes,
        num_tokens=blocks * BLOCK + 1,
        num_prompt_tokens=blocks * BLOCK + 1,
        cache_salt=None,
    )


def new_request_step(req_id: str, block_ids: list[list[int]], computed: int, scheduled: int) -> Any:
    new = SimpleNamespace(req_id=req_id, block_ids=tuple(block_ids), num_computed_tokens=computed)
    cached = SimpleNamespace(
        req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
    )
    return SimpleNamespace(
        num_scheduled_tokens={req_id: scheduled},
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
    )


class Answers:
    """A store whose lookup finds ``cached`` blocks of the full-attention group's chain."""

    def __init__(self, cached: int) -> None:
        self.cached = cached
        self.asked: list[str] = []

    def lookup(self, namespace: Any, keys: list[Any]) -> Any:
        self.asked.append(namespace.model)
        found = min(self.cached, len(keys))
        return SimpleNamespace(num_chunks=found, load_chunks=None)


def test_a_load_moves_each_group_and_a_sliding_window_only_where_it_has_pages() -> None:
    store = Answers(cached=5)
    side = SchedulerSide(store, GROUPS, BLOCK, lookup_wait_s=5.0)  # type: ignore[arg-type]
    asked = request("r", blocks=6)
    side.arrived(asked)
    # Five blocks found in the full group's chain: asynchronous, small as it is, since
    # vLLM takes no block-level load error from a model of several groups.
    assert side.matched_tokens(asked, 0) == (5 * BLOCK, True)
    assert store.asked == [FULL.namespace(None).model]
    full_ids = [11, 12, 13, 14, 15, 16, 17]
    window_ids = [NULL_BLOCK_ID, NULL_BLOCK_ID, NULL_BLOCK_ID, 23, 24, 25, 26]
    side.allocated(asked, [full_ids, window_ids], 5 * BLOCK)
    loads, saves = side.step(new_request_step("r", [full_ids, window_ids], 5 * BLOCK, 1))
    hashes = tuple(asked.block_hashes)
    assert loads == [
        BlockTransfer("r", None, 0, hashes[:5], (11, 12, 13, 14, 15), None, True, 0),
        BlockTransfer("r", None, 3, hashes[3:5], (23, 24), hashes[2], True, 1),
    ]
    assert saves == []  # nothing computed beyond the loaded blocks yet
    assert side.frees_blocks_while_running
    assert side.finished(asked)  # held until its load is named done
    side.close()


def test_saves_name_each_group_and_skip_a_sliding_window_s_null_blocks() -> None:
    side = SchedulerSide(Answers(cached=0), GROUPS, BLOCK)  # type: ignore[arg-type]
    asked = request("s", blocks=4)
    full_ids, window_ids = [1, 2, 3, 4, 5], [NULL_BLOCK_ID, 7, 8, 9, 10]
    side.allocated(asked, [full_ids, window_ids], 0)
    loads, saves = side.step(new_request_step("s", [full_ids, window_ids], 0, 4 * BLOCK + 1))
    hashes = tuple(asked.block_hashes)
    assert loads == []
    assert saves == [
        BlockTransfer("s", None, 0, hashes, (1, 2, 3, 4), None, False, 0),
        BlockTransfer("s", None, 1, hashes[1:], (7, 8, 9), hashes[0], False, 1),
    ]
    assert side.finished(asked)  # held until its saves are out
    side.close()


def test_a_request_back_from_preemption_is_still_held_for_the_saves_planned_before() -> None:
    """The workers hold a request once a save of it was planned; vLLM allocates a
    preempted request again when it resumes, and, finished then before any new save,
    it must still be held: else the workers name a request vLLM has freed."""
    side = SchedulerSide(Answers(cached=0), GROUPS, BLOCK)  # type: ignore[arg-type]
    asked = request("p", blocks=4)
    full_ids, window_ids = [1, 2, 3, 4, 5], [NULL_BLOCK_ID, 7, 8, 9, 10]
    side.allocated(asked, [full_ids, window_ids], 0)
    _, saves = side.step(new_request_step("p", [full_ids, window_ids], 0, 4 * BLOCK + 1))
    assert saves  # planned: the workers hold "p" from here on
    side.allocated(asked, [full_ids, window_ids], 0)  # preempted, then resumed
    assert side.finished(asked)
    side.close()


STORE_TOML = """\
data_dir = "{data_dir}"

[tiers.dram]
capacity = "32MiB"
"""
BLOCKS = 12


@pytest.fixture
def store(daemon_factory: Callable[..., Daemon]) -> Iterator[KVClient]:
    with kvstore.connect(daemon_factory(STORE_TOML).url, timeout_s=5.0) as client:
        yield client


def caches(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, FULL.num_kv_heads, BLOCK, 2 * FULL.head_size)
    layers = FULL.layer_names + SLIDING.layer_names
    return {name: torch.randn(shape, generator=generator) for name in layers}


def worker(store: KVClient, kv: dict[str, torch.Tensor]) -> WorkerSide:
    side = WorkerSide(store, GROUPS, batch_blocks=2)
    side.register(kv)
    return side


def test_each_group_saves_and_loads_its_own_pages(store: KVClient) -> None:
    source, target = caches(1), caches(2)
    saver, loader = worker(store, source), worker(store, target)
    hashes = tuple(request("g", 4).block_hashes)
    saver.save(
        [
            BlockTransfer("g", None, 0, hashes, (1, 2, 3, 4), group=0),
            BlockTransfer("g", None, 2, hashes[2:], (5, 6), hashes[1], group=1),
        ]
    )
    assert until(lambda: saver.finished({"g"}).saved, "saves out") == {"g"}
    assert saver.saves.counts.saved == 6
    loader.load_async(
        [
            BlockTransfer("back", None, 0, hashes, (7, 8, 9, 10), asynchronous=True, group=0),
            BlockTransfer("back", None, 2, hashes[2:], (11, 3), asynchronous=True, group=1),
        ]
    )
    done = until(lambda: loader.finished(set()).loaded, "load named done")
    assert done == {"back"}  # once, after both groups' transfers
    for name in FULL.layer_names:
        assert torch.equal(target[name][[7, 8, 9, 10]], source[name][[1, 2, 3, 4]])
    for name in SLIDING.layer_names:
        assert torch.equal(target[name][[11, 3]], source[name][[5, 6]])
    saver.close()
    loader.close()


def test_a_failed_load_of_a_model_of_several_groups_is_its_request_s(store: KVClient) -> None:
    """vLLM cannot map a block id back to a request when groups share block ids, so the
    request is named failed (recomputed whole) and no block is reported."""
    loader = worker(store, caches(3))
    hashes = tuple(request("never-saved", 2).block_hashes)
    loader.load_async(
        [
            BlockTransfer("lost", None, 0, hashes, (1, 2), asynchronous=True, group=0),
            BlockTransfer("lost", None, 0, hashes, (3, 4), asynchronous=True, group=1),
        ]
    )
    transfers = until(lambda: (t := loader.finished(set())).loaded and t, "load named done")
    assert transfers.loaded == {"lost"} and transfers.failed == {"lost"}
    assert loader.take_failed_blocks() == set()
    loader.close()
