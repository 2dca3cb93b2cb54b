"""The worker side (``client.vllm.worker``, ``client.vllm.saves``) on CPU KV caches shaped as
vLLM's, against a real daemon, with no vLLM: saves put off the step, requests held until
their saves are out, a store that lags costing saves and never the step, and loads that
bring back the very pages saved."""

from __future__ import annotations

import hashlib
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from support.daemon import Daemon
from support.polling import until

import kvstore
from kvstore.client.connect import KVClient
from kvstore.client.vllm.pages import BlockTransfer, PageFormat
from kvstore.client.vllm.worker import Transfers, WorkerSide

PAGES = PageFormat(
    model="worker@main",
    layer_names=("layers.0.attn", "layers.1.attn"),
    num_kv_heads=2,
    head_size=8,
    dtype="float32",
    block_size=16,
)
BLOCKS = 32  # blocks in each cache
BATCH = 2  # blocks per get and put
STORE_TOML = """\
data_dir = "{data_dir}"

[tiers.dram]
capacity = "32MiB"
"""


def caches(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """vLLM's caches of ``PAGES``: per layer ``[blocks, heads, block_size, 2 * head]``."""
    generator = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, PAGES.num_kv_heads, PAGES.block_size, 2 * PAGES.head_size)
    return {
        name: torch.randn(shape, generator=generator).to(device) for name in PAGES.layer_names
    }


def chain(name: str, blocks: int) -> list[bytes]:
    return [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(blocks)]


def save(req_id: str, hashes: list[bytes], first: int, block_ids: list[int]) -> BlockTransfer:
    parent = hashes[first - 1] if first else None
    end = first + len(block_ids)
    return BlockTransfer(req_id, None, first, tuple(hashes[first:end]), tuple(block_ids), parent)


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(STORE_TOML)


@pytest.fixture
def store(daemon: Daemon) -> Iterator[KVClient]:
    with kvstore.connect(daemon.url, timeout_s=5.0) as client:
        yield client


def sent(side: WorkerSide, finished_req_ids: set[str]) -> set[str]:
    """The finished requests ``side`` names as having their saves out."""
    return side.finished(finished_req_ids).saved


def worker(store: KVClient, kv: dict[str, torch.Tensor], pool_bytes: int = 64 << 20) -> WorkerSide:
    side = WorkerSide(store, [PAGES], batch_blocks=BATCH, save_pool_bytes=pool_bytes)
    side.register(kv)
    return side


def test_saved_pages_load_back_bit_for_bit_into_other_blocks(store: KVClient) -> None:
    source, target = caches(1), caches(2)
    saver, loader = worker(store, source), worker(store, target)
    hashes = chain("a", 5)
    # Two steps of one request: blocks 0-2, then 3-4 (the second names block 2 as parent).
    saver.save([save("a", hashes, 0, [7, 3, 9])])
    saver.save([save("a", hashes, 3, [1, 30])])
    assert until(lambda: sent(saver, {"a"}), "saves out") == {"a"}
    assert saver.saves.counts.saved == 5
    prefix = store.lookup(PAGES.namespace(None), PAGES.keys(None, hashes))
    assert prefix.num_chunks == 5  # one chain: the second batch found its parent

    loader.load([BlockTransfer("b", None, 0, tuple(hashes), (0, 1, 2, 3, 4))])
    assert loader.take_failed_blocks() == set()
    for name in PAGES.layer_names:
        assert torch.equal(target[name][[0, 1, 2, 3, 4]], source[name][[7, 3, 9, 1, 30]])
    saver.close()
    loader.close()


def test_pages_that_are_not_one_run_of_bytes_load_through_staging(store: KVClient) -> None:
    """vLLM-CPU's pages are each one run of bytes, so a load lands in them with one
    copy; a cache whose pages are not (heads outermost, a layout some GPU backends
    use) loads the same pages through staging and a scatter."""
    source = caches(3)
    heads_outermost = (PAGES.num_kv_heads, BLOCKS, PAGES.block_size, 2 * PAGES.head_size)
    target = {
        name: torch.zeros(heads_outermost).permute(1, 0, 2, 3) for name in PAGES.layer_names
    }
    saver, loader = worker(store, source), worker(store, target)
    assert saver.caches[0].loads_in_place and not loader.caches[0].loads_in_place
    hashes = chain("staged", 3)
    saver.save([save("staged", hashes, 0, [5, 6, 7])])
    assert until(lambda: sent(saver, {"staged"}), "saves out") == {"staged"}
    loader.load([BlockTransfer("back", None, 0, tuple(hashes), (1, 0, 2))])
    assert loader.take_failed_blocks() == set()
    for name in PAGES.layer_names:
        assert torch.equal(target[name][[1, 0, 2]], source[name][[5, 6, 7]])
    saver.close()
    loader.close()


def test_an_asynchronous_load_is_named_done_with_the_blocks_that_failed(store: KVClient) -> None:
    source, target = caches(6), caches(7)
    saver, loader = worker(store, source), worker(store, target)
    hashes = chain("async", 5)
    saver.save([save("async", hashes, 0, [2, 4, 6])])  # the last two blocks never saved
    assert until(lambda: sent(saver, {"async"}), "saves out") == {"async"}

    asked = BlockTransfer("back", None, 0, tuple(hashes), (10, 11, 12, 13, 14), asynchronous=True)
    loader.load_async([asked])
    assert until(lambda: loader.finished(set()).loaded, "load named done") == {"back"}
    assert loader.take_failed_blocks() == {13, 14}
    for name in PAGES.layer_names:
        assert torch.equal(target[name][[10, 11, 12]], source[name][[2, 4, 6]])
    assert loader.finished(set()) == Transfers(set(), set(), set())  # named once only
    saver.close()
    loader.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pages_round_trip_through_the_side_stream_and_the_load_thread(
    store: KVClient,
) -> None:
    """KV caches on the device, as vLLM's CUDA workers hold them: saves gathered on the
    side stream, then loaded back before the forward and on the load thread's stream."""
    source, target = caches(8, "cuda"), caches(9, "cuda")
    saver, loader = worker(store, source), worker(store, target)
    hashes = chain("cuda", 6)
    saver.save([save("cuda", hashes, 0, [5, 6, 7, 8, 9, 10])])
    assert until(lambda: sent(saver, {"cuda"}), "saves out") == {"cuda"}

    loader.load([BlockTransfer("sync", None, 0, tuple(hashes[:3]), (0, 1, 2))])
    rest = BlockTransfer("async", None, 3, tuple(hashes[3:]), (3, 4, 11), asynchronous=True)
    loader.load_async([rest])
    assert until(lambda: loader.finished(set()).loaded, "load named done") == {"async"}
    assert loader.take_failed_blocks() == set()
    torch.cuda.synchronize()
    for name in PAGES.layer_names:
        assert torch.equal(target[name][[0, 1, 2, 3, 4, 11]], source[name][[5, 6, 7, 8, 9, 10]])
    saver.close()
    loader.close()


def test_a_request_is_held_until_its_saves_are_out_and_named_once(
    daemon: Daemon, store: KVClient
) -> None:
    side = worker(store, caches(3))
    hashes = chain("held", 2)
    side.save([save("held", hashes, 0, [4, 5])])
    assert until(lambda: sent(side, set()) == set() and side.saves.counts.saved, "put")
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        more = chain("held", 4)
        side.save([save("held", more, 2, [6, 7])])  # queued; the put waits on the daemon
        assert sent(side, {"held", "never-saved"}) == set()  # not out yet
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert until(lambda: sent(side, set()), "named once out") == {"held"}
    assert sent(side, {"held"}) == set()  # named once only
    side.close()


def test_a_store_that_lags_costs_saves_not_the_step(daemon: Daemon, store: KVClient) -> None:
    pages_bytes = BATCH * PAGES.block_bytes
    side = worker(store, caches(4), pool_bytes=2 * pages_bytes)  # two batches in flight
    hashes = chain("lag", 8)
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        side.save([save("lag", hashes, 0, [0, 1, 2, 3, 4, 5])])  # three batches, room for two
        side.save([save("lag", hashes, 6, [6, 7])])  # after a drop: dropped, not gathered
        assert time.monotonic() - start < 1.0  # queued or dropped, never waited on
        assert side.saves.counts.dropped == 4
        assert sent(side, {"lag"}) == set()
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert until(lambda: sent(side, set()), "the queued two put") == {"lag"}
    assert (side.saves.counts.saved, side.saves.counts.dropped) == (4, 4)
    found = store.lookup(PAGES.namespace(None), PAGES.keys(None, hashes))
    assert found.num_chunks == 4  # the chain up to the first dropped block
    side.close()


def test_a_request_whose_load_failed_saves_nothing_but_is_still_named(store: KVClient) -> None:
    side = worker(store, caches(5))
    hashes = chain("missing", 2)
    side.load([BlockTransfer("r", None, 0, tuple(hashes), (10, 11))])  # nothing cached
    side.save([save("r", hashes, 0, [10, 11])])
    assert sent(side, {"r"}) == {"r"}
    assert side.saves.counts.saved == 0
    assert side.take_failed_blocks() == {10, 11}
    side.close()
