"""The scheduler's lookups (``client.vllm.lookups``, ``client.vllm.block_keys``) without
vLLM: sent on arrival, awaited at most a step's wait, given up at their deadline; and a
real daemon stopped with SIGSTOP, which costs the scheduler no more than that."""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from support.daemon import Daemon

import kvstore
from kvstore.client.vllm import block_keys
from kvstore.client.vllm.block_keys import BlockKeys
from kvstore.client.vllm.held_blocks import HeldBlocks
from kvstore.client.vllm.lookups import Lookups, StepPace
from kvstore.client.vllm.pages import PageFormat
from kvstore.client.vllm.scheduler import SchedulerSide

PAGES = PageFormat(
    model="lookups@main",
    layer_names=("layers.0.attn",),
    num_kv_heads=1,
    head_size=8,
    dtype="float32",
    block_size=16,
)
WAIT_S = 0.02
DEADLINE_S = 0.3


def request(name: str, blocks: int = 4, salt: str | None = None) -> SimpleNamespace:
    hashes = [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(blocks)]
    return SimpleNamespace(
        request_id=name,
        block_hashes=hashes,
        num_tokens=blocks * PAGES.block_size + 1,
        num_prompt_tokens=blocks * PAGES.block_size + 1,
        cache_salt=salt,
    )


class Gate:
    """A lookup function that answers only when the test opens the gate."""

    def __init__(self, answer: int = 3) -> None:
        self.open = threading.Event()
        self.answer = answer
        self.asked: list[str] = []

    def __call__(self, request: Any) -> int:
        self.asked.append(request.request_id)
        self.open.wait(10.0)
        return self.answer


@pytest.fixture
def gate() -> Iterator[Gate]:
    gate = Gate()
    yield gate
    gate.open.set()  # let the lookup thread finish


def test_a_lookup_sent_on_arrival_is_answered_without_waiting(gate: Gate) -> None:
    lookups = Lookups(gate, wait_s=WAIT_S, deadline_s=DEADLINE_S)
    lookups.send(request("a"))
    gate.open.set()
    deadline = time.monotonic() + 5.0
    while gate.asked != ["a"] and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.01)
    assert lookups.answer(request("a")) == 3
    assert (lookups.counts.sent, lookups.counts.answered, lookups.counts.late) == (1, 1, 0)
    lookups.close()


def test_a_slow_lookup_costs_each_step_its_wait_and_each_request_its_deadline(
    gate: Gate,
) -> None:
    lookups = Lookups(gate, wait_s=WAIT_S, deadline_s=DEADLINE_S)
    first, second = request("first"), request("second")
    lookups.send(first)
    lookups.send(second)
    steps = []
    answers: dict[str, list[int | None]] = {"first": [], "second": []}
    started = time.monotonic()
    # Each request is asked about every step until it has an answer (at most 1,000
    # steps); the two deadlines may pass in different steps, as they were sent apart.
    while any(not got or got[-1] is None for got in answers.values()) and len(steps) < 1000:
        step = time.monotonic()
        for asked in (first, second):
            got = answers[asked.request_id]
            if not got or got[-1] is None:
                got.append(lookups.answer(asked))
        steps.append(time.monotonic() - step)
        lookups.new_step(1)  # a decode step: no pace, so the deadline is the floor
        time.sleep(0.01)
    # Both asks of a step share one wait; no step waited more than it.
    assert max(steps) < WAIT_S + 0.015
    for got in answers.values():
        assert got[-1] == 0 and all(answer is None for answer in got[:-1])
    assert DEADLINE_S <= time.monotonic() - started < DEADLINE_S + 0.2
    assert lookups.counts.late == 2
    # The late lookup answers after all: a request asked about again takes it.
    gate.open.set()
    time.sleep(0.05)
    assert lookups.answer(first) == 3
    lookups.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_paces_are_medians_of_recent_steps() -> None:
    clock = Clock()
    pace = StepPace(clock)
    assert pace.seconds(1000) is None and pace.step_s() is None  # nothing seen: no pace
    for tokens, seconds in [(2048, 2.048), (4, 0.03), (2048, 2.048), (1024, 60.0), (2048, 2.048)]:
        pace.step(tokens)
        clock.now += seconds
    pace.step(0)
    # A decode step (4 tokens) is no sample of the prefill pace; the step followed by
    # a minute idle (1024 tokens, 60 s) is one, and the median leaves it out.
    assert pace.seconds(8000) == pytest.approx(8.0)
    assert pace.step_s() == pytest.approx(2.048)  # of all five steps


def test_a_step_waits_for_lookups_a_share_of_its_time_or_the_floor(gate: Gate) -> None:
    clock = Clock()
    lookups = Lookups(gate, wait_s=0.002, wait_share=0.05, clock=clock)
    assert lookups.step_wait_s() == 0.002  # no step seen
    for _ in range(3):
        lookups.new_step(4)
        clock.now += 0.010  # 10 ms steps: 5% is under the floor
    lookups.new_step(4)
    assert lookups.step_wait_s() == 0.002
    for _ in range(16):
        lookups.new_step(4)
        clock.now += 4.0  # 4 s steps (a CPU engine prefilling): 200 ms
    lookups.new_step(4)
    assert lookups.step_wait_s() == pytest.approx(0.2)
    # A lookup answered soon after it was sent is taken in the step it arrived in.
    lookups.send(request("a"))
    threading.Timer(0.005, gate.open.set).start()
    assert lookups.answer(request("a")) == 3
    assert lookups.counts.not_yet == 0
    lookups.close()


def asked_until_answered(lookups: Lookups, request: SimpleNamespace) -> int:
    """Ask about ``request`` each millisecond until answered, for at most 10 s."""
    for _ in range(10_000):
        if (cached := lookups.answer(request)) is not None:
            return cached
        time.sleep(0.001)
    raise AssertionError(f"{request.request_id} had no answer in 10 s")


def test_a_step_does_not_wait_for_a_lookup_even_the_fastest_recent_one_would_miss(
    gate: Gate,
) -> None:
    clock = Clock()

    def lookup(request: Any) -> int:
        if request.request_id.startswith("slow"):
            clock.now += 10.0  # answered 10 s after it was sent
            return 2
        return gate(request)

    lookups = Lookups(lookup, wait_s=5.0, deadline_s=100.0, clock=clock)
    for i in range(3):
        assert asked_until_answered(lookups, request(f"slow{i}")) == 2
    not_yet = lookups.counts.not_yet
    # Every recent lookup took 10 s: a lookup just sent is not waited for the 5 s.
    start = time.monotonic()
    assert lookups.answer(request("a")) is None
    assert time.monotonic() - start < 2.5
    # One on its way for 6 s is likely within the wait: it is waited for.
    clock.now += 6.0
    threading.Timer(0.005, gate.open.set).start()
    assert lookups.answer(request("a")) == 3
    assert lookups.counts.answered == 4
    assert lookups.counts.not_yet == not_yet + 1  # the first ask of "a"
    assert lookups.took_ms() == pytest.approx(10_000.0)
    lookups.close()


def test_a_long_prompt_waits_for_its_lookup_a_share_of_its_prefill_time(gate: Gate) -> None:
    clock = Clock()
    lookups = Lookups(gate, wait_s=0.001, deadline_s=0.1, share=0.1, clock=clock)
    for _ in range(3):  # 2,048 tokens a second
        lookups.new_step(2048)
        clock.now += 1.0
    lookups.new_step(1)
    long, short = request("long", blocks=1000), request("short", blocks=2)  # 16,001 and 33 tokens
    assert lookups.deadline_s(long.num_tokens) == pytest.approx(0.1 * 16001 / 2048)
    assert lookups.deadline_s(short.num_tokens) == 0.1  # the floor
    lookups.send(long)
    lookups.send(short)
    clock.now += 0.5
    assert lookups.answer(long) is None  # 0.5 s of 0.78: still waited for
    assert lookups.answer(short) == 0  # past its 0.1 s
    clock.now += 0.3
    assert lookups.answer(long) == 0
    assert lookups.counts.late == 2
    lookups.close()


def test_a_forgotten_request_is_looked_up_again_when_asked_about(gate: Gate) -> None:
    gate.open.set()
    lookups = Lookups(gate, wait_s=1.0, deadline_s=DEADLINE_S)
    lookups.send(request("r"))
    assert lookups.answer(request("r")) == 3
    lookups.forget("r")  # scheduled; preempted later and asked about afresh
    gate.answer = 1
    assert lookups.answer(request("r")) == 1
    assert gate.asked == ["r", "r"] and lookups.counts.sent == 2
    lookups.close()


def test_block_keys_are_derived_once_per_salt() -> None:
    keys = BlockKeys(PAGES)
    hashes = request("chain", 6).block_hashes
    assert keys.keys(None, hashes) == PAGES.keys(None, hashes)
    assert keys.keys("tenant", hashes) == PAGES.keys("tenant", hashes)
    assert keys.keys(None, hashes)[0] != keys.keys("tenant", hashes)[0]
    longer = request("chain", 8).block_hashes
    assert keys.keys(None, longer) == PAGES.keys(None, longer)


def test_block_keys_keep_the_newest_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_keys, "SALTS_KEPT", 2)
    keys = BlockKeys(PAGES, keep=8)
    for name in ("a", "b", "c"):
        hashes = request(name, 6).block_hashes
        assert keys.keys(None, hashes) == PAGES.keys(None, hashes)
    for salt in ("s1", "s2", "s3"):
        hashes = request("a", 2).block_hashes
        assert keys.keys(salt, hashes) == PAGES.keys(salt, hashes)


def test_held_blocks_remember_saves_and_forget_what_a_lookup_did_not_find() -> None:
    held = HeldBlocks()
    chain = request("chain", 6).block_hashes
    assert held.run(None, chain) == 0
    held.saved(None, chain[:4])
    assert held.run(None, chain) == 4
    assert held.run("tenant", chain) == 0  # another salt is another chain
    mark = held.mark()
    held.saved(None, chain[4:5])  # planned after the lookup below was sent
    # The lookup found 2 of the chain: blocks 2 and 3, remembered before it was sent,
    # are forgotten; block 4, remembered since, may not have landed when it answered.
    held.found(None, chain, 2, mark)
    assert held.run(None, chain) == 2
    assert held.run(None, chain[4:]) == 1
    held.found(None, chain, 6, held.mark())  # a later lookup found all of it
    assert held.run(None, chain) == 6


def test_held_blocks_keep_the_newest_when_full() -> None:
    held = HeldBlocks(keep=16)  # the third chain fills it: the newest 8 blocks stay
    chains = [request(name, 6).block_hashes for name in ("a", "b", "c")]
    for chain in chains:
        held.saved(None, chain)
    assert held.run(None, chains[2]) == 6
    assert held.run(None, chains[0]) == 0


def same_chain(asked: SimpleNamespace, request_id: str) -> SimpleNamespace:
    """Another request with ``asked``'s tokens (an agent's call sent again)."""
    return SimpleNamespace(**{**vars(asked), "request_id": request_id})


def scheduled(asked: SimpleNamespace, block_ids: list[int]) -> SimpleNamespace:
    """A ``SchedulerOutput`` of a step that schedules all of new request ``asked``."""
    return SimpleNamespace(
        num_scheduled_tokens={asked.request_id: asked.num_tokens},
        scheduled_new_reqs=[
            SimpleNamespace(req_id=asked.request_id, block_ids=[block_ids], num_computed_tokens=0)
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set()),
    )


STALL_TOML = """\
data_dir = "{data_dir}"

[tiers.dram]
capacity = "16MiB"
"""


def test_a_stopped_daemon_costs_the_scheduler_its_wait_per_step(
    daemon_factory: Any,
) -> None:
    daemon: Daemon = daemon_factory(STALL_TOML)
    with kvstore.connect(daemon.url, timeout_s=2.0) as store:
        side = SchedulerSide(
            store, [PAGES], PAGES.block_size, lookup_wait_s=WAIT_S, lookup_deadline_s=DEADLINE_S
        )
        cached = request("cached", 4)
        keys = PAGES.keys(None, cached.block_hashes)
        payload = np.zeros(PAGES.page_bytes, np.uint8)
        assert store.put(PAGES.namespace(None), keys, [payload] * 4) == 4
        side.arrived(cached)
        deadline = time.monotonic() + 10.0
        while (matched := side.matched_tokens(cached, 0)) == (None, False):
            assert time.monotonic() < deadline
            side.step(no_work())
        assert matched == (4 * PAGES.block_size, False)  # every whole block, synchronously
        # Loads of async_load_bytes or more go off the step; smaller ones stay in it.
        three_blocks = 3 * PAGES.block_bytes
        ahead = SchedulerSide(
            store, [PAGES], PAGES.block_size, lookup_wait_s=5.0, async_load_bytes=three_blocks
        )
        ahead.arrived(cached)
        assert ahead.matched_tokens(cached, 0) == (4 * PAGES.block_size, True)
        assert ahead.matched_tokens(cached, 2 * PAGES.block_size) == (2 * PAGES.block_size, False)
        ahead.close()
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            stalled = [request(f"stalled-{i}", 4) for i in range(3)]
            for each in stalled:
                side.arrived(each)
            steps: list[float] = []
            answers: list[list[int | None]] = []
            while not answers or None in answers[-1]:
                start = time.monotonic()
                answers.append([side.matched_tokens(each, 0)[0] for each in stalled])
                side.step(no_work())
                steps.append(time.monotonic() - start)
                time.sleep(0.005)
            assert max(steps) < WAIT_S + 0.015
            assert answers[-1] == [0, 0, 0]  # computed, not loaded: nothing wrong
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        side.close()


def no_work() -> SimpleNamespace:
    """A ``SchedulerOutput`` of a step that scheduled nothing."""
    return SimpleNamespace(
        num_scheduled_tokens={},
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set()),
    )


def test_a_returning_call_is_answered_from_the_saves_its_scheduler_planned(
    daemon_factory: Any,
) -> None:
    daemon: Daemon = daemon_factory(STALL_TOML)
    size = PAGES.block_size
    with kvstore.connect(daemon.url, timeout_s=2.0) as store:
        held = HeldBlocks()
        side = SchedulerSide(
            store, [PAGES], size, lookup_wait_s=WAIT_S, lookup_deadline_s=DEADLINE_S, held=held
        )
        call = request("agent", 4)
        side.allocated(call, [[1, 2, 3, 4, 5]], 0)
        _, saves = side.step(scheduled(call, [1, 2, 3, 4, 5]))
        assert [save.block_ids for save in saves] == [(1, 2, 3, 4)]
        keys = PAGES.keys(None, call.block_hashes)
        payload = np.zeros(PAGES.page_bytes, np.uint8)
        assert store.put(PAGES.namespace(None), keys, [payload] * 4) == 4  # the worker's
        side.finished(call)
        returning = request("agent", 6)  # the same 4 blocks, and 2 more
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            # Its lookup cannot be answered: the answer is the saves remembered.
            side.arrived(returning)
            assert side.matched_tokens(returning, 0) == (4 * size, False)
            # Asked again (its load failed, say), it waits for its lookup.
            assert side.matched_tokens(returning, 0) == (None, False)
            other = same_chain(returning, "other")
            side.arrived(other)
            assert side.matched_tokens(other, 3 * size) == (size, False)  # beyond vLLM's hit
            assert side.lookups.counts.recalled == 2
            # Once the lookup on the wire is overdue the daemon may be stalled: asks wait
            # for their own lookups.
            time.sleep(DEADLINE_S + 0.05)
            again = same_chain(returning, "again")
            side.arrived(again)
            assert side.matched_tokens(again, 0) == (None, False)
            assert side.lookups.counts.recalled == 2
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        # The store loses blocks 2 and 3: the next lookup of the chain corrects the memory.
        assert store.delete(PAGES.namespace(None), keys[2:]) == 2
        side.arrived(same_chain(returning, "lost"))
        deadline = time.monotonic() + 10.0
        while held.run(None, returning.block_hashes) != 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        side.close()
