#!/usr/bin/env python3
"""The scheduler's cost of kvstore's vLLM connector per agentic call, against a local daemon.

vLLM runs the connector's scheduler side on the thread that builds every step:
whatever it spends there, every running request waits for. An agent's call is
a ~119K-token context it sent a moment ago plus ~875 new tokens (as in
kv-cache-tester's Claude Code sessions), so each call looks up 7,438 16-token
blocks, is allocated, scheduled, and finished with session events that carry
its chain.
This drives ``client.vllm.scheduler.SchedulerSide`` as vLLM's scheduler does
(no vLLM needed: requests are the fields the side reads) through a real
``kvstore serve`` daemon (DRAM, predictor on) that holds each call's context::

    arrive (on_new_request) ─ at once ─► ask (get_num_new_matched_tokens),
      again each step while it answers None ─► allocated (update_state_after_alloc)
      ─► step (build_connector_meta: the load and the saves) ─► finished
      (request_finished) ─ a tool's few ms ─► the next call of the session

Timed: the scheduler thread's time in those calls per request ("scheduler ms"),
the steps a request waited for its lookup, and the daemon's round trip for
each lookup, measured at the client ("lookup ms"). Four cases, interleaved
session by session:

    ahead           the connector as shipped: lookups sent on arrival, an ask
                    answered from the blocks the scheduler remembers the store
                    holds while its lookup is on its way (held_blocks), else a
                    step waits at most lookup_wait_ms (2) for it; session events on
    ahead, no memory  the same with held_blocks 0: every ask waits for its lookup
    ahead, no events  the connector as shipped with session_events off: what the
                    events cost
    blocking        the scheduler waits for each lookup to be answered (the
                    connector before lookups ran ahead): the peer design
    blocking, no events

Ratios: each case's p50 and p99 against "ahead" and against the issue's goal of
5 ms p50 per 119K-token call (``GOAL_MS``), and the lookups' p99 against their
deadline. The stored KV is tiny (a one-layer, one-head page): a lookup's cost
is its key count, not its payload.

    python bench/vllm_scheduler.py            # table on stdout
    python bench/vllm_scheduler.py --json     # one JSON object on stdout, table on stderr
    python bench/vllm_scheduler.py --quick    # fewer sessions (< 1 min)
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
from common import (
    CLIENT_TIMEOUT_S,
    DaemonStats,
    bench_arguments,
    bench_session,
    dram_daemon,
    emit_json,
    format_table,
    log,
    machine_info,
    percentile,
    temp_dir,
)

import kvstore
from kvstore.client.connect import KVClient
from kvstore.client.vllm.held_blocks import HeldBlocks
from kvstore.client.vllm.lookups import DEADLINE_S, WAIT_S
from kvstore.client.vllm.pages import PageFormat
from kvstore.client.vllm.scheduler import SchedulerSide
from kvstore.client.vllm.sessions import SessionEvents
from kvstore.keys import ChunkKey

PAGES = PageFormat(
    model="bench-scheduler@main",
    layer_names=("layers.0.attn",),
    num_kv_heads=1,
    head_size=8,
    dtype="float16",
    block_size=16,  # vLLM's default block: a 119K-token context is 7,438 blocks
)
CONTEXT_TOKENS = 119_000
NEW_TOKENS = 875  # per call: a tool's result or a human's message
OUTPUT_TOKENS = 200
STEP_S = 0.02  # the other requests' decode step the scheduler runs between asks
TOOL_S = 0.005  # between a call's end and the session's next call
GOAL_MS = 5.0
BLOCKING_WAIT_S = 10.0  # a wait no lookup reaches: the scheduler waits for the answer
PUT_BATCH = 4096  # the daemon's max_batch_chunks


@dataclass(frozen=True)
class Case:
    name: str
    events: bool
    blocking: bool
    held: bool = False  # answers from the blocks the scheduler remembers (HeldBlocks)


CASES = (
    Case("ahead", events=True, blocking=False, held=True),
    Case("ahead, no memory", events=True, blocking=False),
    Case("ahead, no events", events=False, blocking=False, held=True),
    Case("blocking", events=True, blocking=True),
    Case("blocking, no events", events=False, blocking=True),
)


class TimedLookups:
    """A client whose ``lookup`` round trips are timed; everything else passes through."""

    def __init__(self, client: KVClient) -> None:
        self._client = client
        self.seconds: list[float] = []

    def lookup(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._client.lookup(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@dataclass
class Figures:
    """One case's samples, over every measured call."""

    scheduler_s: list[float] = field(default_factory=list)
    steps_waited: list[int] = field(default_factory=list)
    loaded_tokens: list[int] = field(default_factory=list)

    def summary(self, lookups_s: Sequence[float], late: int) -> dict[str, float]:
        return {
            "calls": len(self.scheduler_s),
            "scheduler_ms_p50": 1e3 * percentile(self.scheduler_s, 0.5),
            "scheduler_ms_p99": 1e3 * percentile(self.scheduler_s, 0.99),
            "steps_waited_mean": sum(self.steps_waited) / len(self.steps_waited),
            "lookup_ms_p50": 1e3 * percentile(lookups_s, 0.5),
            "lookup_ms_p99": 1e3 * percentile(lookups_s, 0.99),
            "lookup_ms_max": 1e3 * max(lookups_s),
            "late_lookups": late,
            "loaded_tokens_p50": percentile(self.loaded_tokens, 0.5),
        }


def session_hashes(name: str, blocks: int) -> list[bytes]:
    """A session's chain of vLLM block hashes (opaque 32-byte values, as vLLM's sha256)."""
    return [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(blocks)]


def call(name: str, hashes: list[bytes], prompt_tokens: int) -> SimpleNamespace:
    """The fields of ``vllm.v1.request.Request`` that the scheduler side reads."""
    return SimpleNamespace(
        request_id=name,
        block_hashes=hashes[: prompt_tokens // PAGES.block_size],
        num_tokens=prompt_tokens,
        num_prompt_tokens=prompt_tokens,
        cache_salt=None,
        output_token_ids=[],
        kv_transfer_params=None,
    )


def step_output(req_id: str, block_ids: list[int], computed: int, scheduled: int) -> Any:
    """``SchedulerOutput`` of one step that schedules one new request."""
    new = SimpleNamespace(req_id=req_id, block_ids=(block_ids,), num_computed_tokens=computed)
    cached = SimpleNamespace(
        req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
    )
    return SimpleNamespace(
        num_scheduled_tokens={req_id: scheduled},
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
    )


def store_chain(store: KVClient, hashes: Sequence[bytes]) -> None:
    """Put a session's blocks (one-layer pages of zeros) as the workers would, a batch at
    a time, each naming its parent."""
    namespace = PAGES.namespace(None)
    keys = PAGES.keys(None, list(hashes))
    page = np.zeros(PAGES.block_bytes, dtype=np.uint8)  # as the workers put
    step = PUT_BATCH - 1  # a batch past the first names its parent too
    for start in range(0, len(keys), step):
        batch = keys[start : start + step]
        parent: list[ChunkKey] = keys[start - 1 : start] if start else []
        chunks: list[np.ndarray | None] = [None] * len(parent) + [page] * len(batch)
        store.put(namespace, [*parent, *batch], chunks)


def run_session(side: SchedulerSide, name: str, calls: int, figures: Figures) -> None:
    """One agent session: ``calls`` calls, each its predecessor's context plus
    ``NEW_TOKENS``; the first is not measured (its keys are derived the first time)."""
    size = PAGES.block_size
    total = CONTEXT_TOKENS + calls * (NEW_TOKENS + OUTPUT_TOKENS)
    hashes = session_hashes(name, total // size + 1)
    prompt = CONTEXT_TOKENS
    for index in range(calls):
        request = call(f"{name}-{index}", hashes, prompt)
        spent, waited = 0.0, 0
        start = time.perf_counter()
        side.arrived(request)  # vLLM adds a request right before it builds a step,
        spent += time.perf_counter() - start  # so the lookup has no head start
        while True:
            start = time.perf_counter()
            tokens, _ = side.matched_tokens(request, 0)
            spent += time.perf_counter() - start
            if tokens is not None:
                break
            waited += 1
            side.step(step_output(request.request_id, [], 0, 0))  # a step without it
            time.sleep(STEP_S)
        blocks = list(range(1, prompt // size + 2))  # vLLM's block 0 is its null block
        start = time.perf_counter()
        side.allocated(request, [blocks], tokens)
        side.step(step_output(request.request_id, blocks, tokens, prompt - tokens))
        request.output_token_ids = [1] * OUTPUT_TOKENS
        request.num_tokens = prompt + OUTPUT_TOKENS
        request.block_hashes = hashes[: request.num_tokens // size]
        side.finished(request)
        spent += time.perf_counter() - start
        if index:
            figures.scheduler_s.append(spent)
            figures.steps_waited.append(waited)
            figures.loaded_tokens.append(tokens)
        prompt += OUTPUT_TOKENS + NEW_TOKENS
        time.sleep(TOOL_S)


@dataclass
class Running:
    """One case's scheduler side and what it measured."""

    case: Case
    side: SchedulerSide
    timed: TimedLookups
    figures: Figures = field(default_factory=Figures)


def sides(store: KVClient, cases: Sequence[Case]) -> Iterator[Running]:
    for case in cases:
        timed = TimedLookups(store)
        events = SessionEvents(store, PAGES) if case.events else None
        wait = BLOCKING_WAIT_S if case.blocking else WAIT_S
        deadline = BLOCKING_WAIT_S if case.blocking else DEADLINE_S
        client = cast(KVClient, timed)
        side = SchedulerSide(
            client,
            [PAGES],
            PAGES.block_size,
            events,
            lookup_wait_s=wait,
            lookup_deadline_s=deadline,
            held=HeldBlocks() if case.held else None,
        )
        yield Running(case, side, timed)


def wait_for_daemon(socket_path: Path, timeout_s: float = 120.0) -> None:
    """Wait until the daemon has prefaulted its DRAM arena and its predictor has loaded
    its model (torch's import), both in the background once it listens, so that no
    case is timed against them."""
    stats = DaemonStats(socket_path)
    try:
        stats.wait_prefaulted(timeout_s)
        deadline = time.monotonic() + timeout_s
        while stats.get()["predictor"]["model"]["features"] is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the predictor's model was not loaded in {timeout_s:.0f} s")
            time.sleep(0.1)
    finally:
        stats.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, help="sessions per case (default 6, quick 2)")
    parser.add_argument("--calls", type=int, help="calls per session (default 12, quick 4)")
    args = parser.parse_args(argv)
    sessions = args.sessions or (2 if args.quick else 6)
    calls = args.calls or (4 if args.quick else 12)
    with bench_session() as stack:
        root = stack.enter_context(temp_dir("kvs-scheduler-"))
        process, socket_path = dram_daemon(root, "1GiB", predictor="tick_s = 1.0")
        stack.enter_context(process)
        wait_for_daemon(socket_path)
        store = kvstore.connect(f"unix://{socket_path}", timeout_s=CLIENT_TIMEOUT_S)
        stack.callback(store.close)
        running = list(sides(store, CASES))
        for run in running:
            stack.callback(run.side.close)
        total = CONTEXT_TOKENS + calls * (NEW_TOKENS + OUTPUT_TOKENS)
        for rep in range(sessions):
            for run in running:  # interleaved: drift hits every case alike
                name = f"{run.case.name}/{rep}"
                store_chain(store, session_hashes(name, total // PAGES.block_size + 1))
                log(f"session {rep + 1}/{sessions}: {run.case.name}")
                run_session(run.side, name, calls, run.figures)
        results = {
            run.case.name: run.figures.summary(run.timed.seconds, run.side.lookups.counts.late)
            for run in running
        }
    base = results["ahead"]
    for figures in results.values():
        figures["p50_vs_ahead"] = figures["scheduler_ms_p50"] / base["scheduler_ms_p50"]
        figures["p99_vs_ahead"] = figures["scheduler_ms_p99"] / base["scheduler_ms_p99"]
        figures["p50_vs_goal"] = figures["scheduler_ms_p50"] / GOAL_MS
        figures["lookup_p99_vs_deadline"] = figures["lookup_ms_p99"] / (1e3 * DEADLINE_S)
    table = format_table(
        ["case", "calls", "sched p50 ms", "sched p99 ms", "x ahead p50", "x goal p50",
         "steps waited", "lookup p50 ms", "lookup p99 ms", "late"],
        [
            [name, f["calls"], f["scheduler_ms_p50"], f["scheduler_ms_p99"], f["p50_vs_ahead"],
             f["p50_vs_goal"], f["steps_waited_mean"], f["lookup_ms_p50"], f["lookup_ms_p99"],
             f["late_lookups"]]
            for name, f in results.items()
        ],
    )  # fmt: skip
    log(table)
    if args.json:
        settings = {
            "context_tokens": CONTEXT_TOKENS,
            "blocks": CONTEXT_TOKENS // PAGES.block_size,
            "new_tokens": NEW_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "step_s": STEP_S,
            "sessions": sessions,
            "calls": calls,
            "goal_ms": GOAL_MS,
            "lookup_wait_s": WAIT_S,
            "lookup_deadline_s": DEADLINE_S,
        }
        emit_json({"machine": machine_info(), "settings": settings, "cases": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
